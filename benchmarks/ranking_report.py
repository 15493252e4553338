"""The ranking benchmark's report (docs/results/ranking.md, its figures and the README's summary), written from
the protocol (benchmarks/ranking.yaml) and the stored rows of that protocol alone: every number is computed here,
and a row not run yet is listed as missing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from curve_plot import draw_seed_band, label_and_save  # benchmarks/ is the script's own directory
from ranking_calibration import calibration_lines
from ranking_protocol import (
    COMPONENTS,
    RESULTS,
    ROOT,
    Protocol,
    base_config,
    choices,
    current_rows,
    grid,
    lr_key,
    per_client_round_cost,
    protocol,
    rounds_for,
    row_plan,
    setting_key,
    table_budget,
    zofed_settings,
)

from zofed.atomic_files import write_atomic_text
from zofed.fl.methods import get_method

README = ROOT / "README.md"
BEGIN, END = "<!-- ranking:begin -->", "<!-- ranking:end -->"
COST_MODEL = RESULTS / "cost_model.json"


def reached(curve: list[list[float]], target: float) -> float | None:
    """Forward passes at which a curve first reaches `target` (None: never within its budget)."""
    # a mean of k/300 accuracies is a float a few ulps off the fraction a seed hits exactly: compare with a tolerance
    return next((point[0] for point in curve if point[3] >= target - 1e-9), None)


def current_finals(rows: list[dict]) -> list[dict]:
    """The final rows run at the lr tuning chooses now (a row tuned again may choose another; its finals at the
    old lr stay in the JSON, unreported). A zero-shot row has no lr to choose."""
    chosen = choices(rows)

    def current(r: dict) -> bool:
        c = chosen.get(setting_key(r["table"], r["dataset"], r["alpha"], r["row"]))
        return c is None or r["lr"] == c["lr"]

    return [r for r in rows if r["phase"] == "final" and current(r)]


def kind_of(p: Protocol, table: str, row: str) -> str:
    """zero-shot, zofed (the judged row), ablation (zofed with a component off), zo (a ZO baseline) or
    first-order."""
    spec = p.tables[table].rows[row]
    if spec.kind == "zero-shot":
        return "zero-shot"
    if spec.method == "zofed":
        return "zofed" if row == "zofed" else "ablation"
    return "first-order" if get_method(spec.method).first_order else "zo"


def paired(mine: list[dict], theirs: list[dict]) -> tuple[list[int], np.ndarray]:
    """The seeds both have, and zofed's paired final-accuracy differences on them in points; a row of one seed
    (zero-shot: deterministic) pairs with every seed."""
    a = {r["seed"]: r["final_accuracy"] for r in mine}
    if len(theirs) == 1 and theirs[0]["row"] == "zero-shot":
        b = dict.fromkeys(a, theirs[0]["final_accuracy"])
    else:
        b = {r["seed"]: r["final_accuracy"] for r in theirs}
    seeds = sorted(a.keys() & b.keys())
    return seeds, np.array([a[s] - b[s] for s in seeds]) * 100


def _mean_std(rs: list[dict]) -> str:
    acc = np.array([r["final_accuracy"] for r in rs])
    return f"{acc.mean():.4f} ± {acc.std(ddof=1):.4f}" if len(acc) > 1 else f"{acc.mean():.4f}"


def settings_lines(p: Protocol, table: str, rows: list[dict]) -> list[str]:
    """zofed's resolved settings on a table and which of its two components they leave active."""
    config = base_config(p, table, "zofed")
    tensors = next((r["trainable_tensors"] for r in rows if r["table"] == table and "trainable_tensors" in r
                    and p.tables[table].rows[r["row"]].trainable != "own"), None)
    s = zofed_settings(config, tensors or 0, row_plan(table, "zofed", p.datasets[0]).feature_cache)
    tuned = lr_key(p, table, "zofed") == "federation.server_optimizer.lr"
    server_lr = f"lr tuned on its grid, default {s['server_lr']:g}" if tuned else f"lr {s['server_lr']:g}"
    lines = [f"zofed's row is `zofed run`'s own settings here (recipe {s['recipe']}): {s['estimator']} estimator, "
             f"{s['queries']} queries a step, {s['local_steps']} local steps of batch {s['batch_size']}, zo.cache "
             f"{s['cache']} ({s['cached_examples']} cached examples a client round), {s['scalar_bits']}-bit scalars, "
             f"logit adjustment {s['logit_adjust']:g}, tail averaging from {s['average_from']}, "
             f"server optimizer {s['server_optimizer']} ({server_lr}), block sampling over "
             f"{s['blocks'] or 'an unknown number of'} blocks (personalize {s['personalize']})."]
    states = dict(s["active"])
    if tensors is None:  # the block count is read from a run's trainable tensors
        del states["block_sampling"]
        lines.append(f"Whether {COMPONENTS['block_sampling']} is active is known once a row of this table has run "
                     "(it needs more than one block to draw from).")
    active = [COMPONENTS[k] for k, on in states.items() if on]
    inactive = [COMPONENTS[k] for k, on in states.items() if not on]
    if active or tensors is None:
        text = "; ".join([*(f"active: {c}" for c in active), *(f"inactive: {c}" for c in inactive)])
        lines.append(text[:1].upper() + text[1:] + ".")
    if tensors is not None and not active:
        sided = "one-sided (forward)" if s["estimator"] == "forward" else "two-sided (central)"
        lines.append(f"Neither of zofed's two components is active here ({'; '.join(inactive)}): on this table "
                     f"zofed's row is zo-seeds with {sided} queries ({s['queries']} a step) on its engine.")
    return lines


def _charged(table: str, row: str, dataset: str, rs: list[dict]) -> str:
    """A row's passes per client round and rounds (two cells): as its final runs counted them, which a method
    that charges each step from the tensors it drew spends differently from run to run; else as planned."""
    if not rs:
        return f"{per_client_round_cost(table, row, dataset):.4g} | {rounds_for(table, row, dataset)}"
    rounds = sorted({r["rounds"] for r in rs})
    shown = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]} to {rounds[-1]}"
    return f"{np.mean([r['forward_passes_per_client_round'] for r in rs]):.4g} | {shown}"


def dataset_lines(p: Protocol, table: str, dataset: str, alpha: float, rows: list[dict]) -> list[str]:
    """One dataset's table: each row's chosen lr, final accuracy, cost and rounds; the missing rows; zofed's
    paired differences; the compute to reach the best ZO baseline."""
    chosen = choices(rows)
    finals = [r for r in current_finals(rows) if (r["table"], r["dataset"], r["alpha"]) == (table, dataset, alpha)]
    by_row = {name: [r for r in finals if r["row"] == name] for name in p.tables[table].rows}
    if not any((r["table"], r["dataset"]) == (table, dataset) for r in rows):
        return [f"### {dataset}, alpha {alpha}", "", "Not run yet: no row has a tuning or final run here."]
    lines = [f"### {dataset}, alpha {alpha}", "",
             "| row | chosen lr | validation accuracy (tune seeds) | test accuracy (mean ± std) | final seeds "
             "| uplink bytes / client round | passes / client round | rounds |", "|" + "---|" * 8]
    missing = []
    for name, rs in by_row.items():
        c = chosen.get(setting_key(table, dataset, p.federation.alphas[0], name))
        tuned = f"{c['lr']:g}" if c else "n/a"
        validation = f"{c['validation_accuracy']:.4f} ({c['seeds']})" if c else "n/a"
        trains = kind_of(p, table, name) != "zero-shot"
        tuned_seeds, final_seeds = (c["seeds"] if c else 0), len(p.seeds.final) if trains else 1
        short = [f"tuned on {tuned_seeds} of {len(p.seeds.tune)} seeds"] * (trains and tuned_seeds < len(p.seeds.tune))
        short += [f"final on {len(rs)} of {final_seeds}"] * (len(rs) < final_seeds)
        if short:
            missing.append(f"{name} ({', '.join(short)})")
        up = f"{np.mean([r['bytes_up_per_client_round'] for r in rs]):,.0f}" if rs else "n/a"
        accuracy = _mean_std(rs) if rs else "missing"
        lines.append(f"| {name} | {tuned} | {validation} | {accuracy} | {len(rs)} | {up} "
                     f"| {_charged(table, name, dataset, rs)} |")
    if missing:
        lines += ["", "Still missing: " + ", ".join(missing) + "."]
    zofed = by_row.get("zofed", [])
    if not zofed:
        return [*lines, "", "zofed has no final rows here yet: no differences are computed."]
    lines += ["", "zofed minus each row, paired by seed (points of test accuracy, standard error over seeds):", ""]
    for name, rs in by_row.items():
        seeds, diff = paired(zofed, rs)
        if name == "zofed" or not seeds:
            continue
        se = f"{diff.std(ddof=1) / np.sqrt(len(diff)):.2f}" if len(diff) > 1 else "n/a"
        lines.append(f"- {name}: {diff.mean():+.2f} (standard error {se}) over seeds {seeds}")
    baselines = {n: rs for n, rs in by_row.items() if rs and kind_of(p, table, n) == "zo"}
    if not baselines:
        return [*lines, "", "No ZO baseline has final rows here yet: the compute to reach one is not computed."]
    best = max(baselines, key=lambda n: np.mean([r["curve"][-1][3] for r in baselines[n]]))
    target = float(np.mean([r["curve"][-1][3] for r in baselines[best]]))
    lines += ["", f"The best ZO baseline by final subset accuracy is {best} ({target:.4f} at the end of its budget, "
                  f"{len(baselines[best])} seeds). Compute each row needs to reach it, mean over its seeds that do:",
              ""]
    for name, rs in by_row.items():
        if not rs or not rs[0]["curve"]:
            continue
        got = [h for h in (reached(r["curve"], target) for r in rs) if h is not None]
        lines.append(f"- {name}: " + (f"{np.mean(got):,.0f} forward passes ({len(got)} of {len(rs)} seeds)"
                                      if got else f"not reached by any of its {len(rs)} seeds"))
    return lines


def plot_curves(groups: dict[str, list[dict]], title: str, path: Path, zero_shot: float | None = None) -> None:
    """Accuracy against client compute, uplink bytes per client and rounds: per row the mean over its seeds with
    the seeds' range as a band; zero-shot's whole-split accuracy as a grey line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for name, rs in groups.items():
        curves = np.array([r["curve"] for r in rs if len(r["curve"]) == len(rs[0]["curve"])])
        draw_seed_band(axes, name, curves, curves[:, :, 3])
    if zero_shot is not None:
        for ax in axes:
            ax.axhline(zero_shot, color="grey", linestyle=":", label="zero-shot (whole test split)")
    ends = [rs[0]["curve"][-1][1] for rs in groups.values()]
    wide = min(ends) > 0 and max(ends) > 100 * min(ends)  # a dense uplink beside scalar ones: a log axis shows both
    if wide:
        axes[1].set_xscale("symlog", linthresh=min(ends) / 10)
        axes[1].set_xlim(left=0)
    label_and_save(fig, axes, "accuracy", title, path, ", log scale" if wide else "")


def figure_lines(p: Protocol, table: str, dataset: str, alpha: float, rows: list[dict]) -> list[str]:
    """One figure per (table, dataset, alpha): the final rows (test subset), or while a row has none, its chosen
    tuning runs (validation)."""
    chosen = choices(rows)
    finals = current_finals(rows)
    groups: dict[str, list[dict]] = {}
    zero_shot = next((r["final_accuracy"] for r in finals if r["row"] == "zero-shot"
                      and (r["table"], r["dataset"], r["alpha"]) == (table, dataset, alpha)), None)
    for name in p.tables[table].rows:
        same = [r for r in rows if (r["table"], r["dataset"], r["alpha"], r["row"]) == (table, dataset, alpha, name)
                and r["curve"]]
        picked = [r for r in same if r in finals]
        c = chosen.get(setting_key(table, dataset, alpha, name))
        if not picked and c is not None:
            picked = [r for r in same if r["phase"] == "tune" and r["lr"] == c["lr"]]
            name = f"{name} (validation)"
        if picked:
            groups[name] = picked
    if not groups:
        return []
    png = f"ranking_{table}_{dataset}_a{alpha}.png"
    plot_curves(groups, f"{table}: {dataset}, alpha {alpha}, {table_budget(p, table):,.0f} passes", RESULTS / png,
                zero_shot)
    return ["", f"![{table} {dataset}]({png})"]


def cost_model_lines() -> list[str]:
    """The cost model's measured ratios beside its rule, where docs/results/cost_model.json holds them."""
    if not COST_MODEL.is_file():
        return []
    try:
        data = json.loads(COST_MODEL.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return ["## Cost model", "", f"{COST_MODEL.name} could not be read: {err}."]
    pairs = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            if "measured" in node and "rule" in node:
                name = node.get("row", node.get("name", path or "(top)"))
                pairs.append(f"| {name} | {node.get('what', '')} | {_number(node['measured'])} "
                             f"| {_number(node['rule'])} |")
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(data, "")
    if not pairs:
        return ["## Cost model", "", f"{COST_MODEL.name} holds no measured/rule pairs."]
    return ["## Cost model", "", f"Each step's cost in full forward passes, measured on this machine against the rule "
            f"the rows are charged by ({COST_MODEL.name}):", "", "| entry | what | measured | rule |",
            "|---|---|---|---|", *pairs]


def _number(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def protocol_lines(p: Protocol) -> list[str]:
    f = p.federation
    return ["## Protocol (benchmarks/ranking.yaml)", "",
            f"{f.model}; {f.clients} clients under {f.scheme} label skew (alpha {', '.join(map(str, f.alphas))}), "
            f"{f.per_round} a round, {f.test_fraction:g} of each client's examples held out; the same client "
            f"compute for every row: {f.budget:,.0f} forward-pass equivalents of the full model summed over the "
            f"federation (rounds = budget // ({f.per_round} x the row's passes per client round); a row whose steps "
            f"are charged by the tensors they drew runs until another round could pass the budget). Each row's client "
            f"lr is tuned on its grid ({'; '.join(f'{k}: {v}' for k, v in p.grids.items())}; "
            f"{', '.join(f'the {k} grid sets {v}' for k, v in p.grid_keys.items()) or 'each sets the clients lr'}) "
            f"on seeds "
            f"{p.seeds.tune}, scored on a {f.validation_examples}-example validation split carved from the training "
            f"data; finals at the chosen lr on seeds {p.seeds.final}, on the whole test split (curves on a fixed "
            f"{f.eval_examples}-example subset). Datasets: {', '.join(p.datasets)}. Reproduce: "
            "`.venv/bin/python benchmarks/ranking.py --phase tune`, then `--phase final`."]


def tuning_runs(p: Protocol, table: str) -> int:
    """The tuning runs one dataset of a table takes: every training row's grid on every tuning seed (under
    successive halving, on the first; its survivors on the rest)."""
    k = p.tables[table].survivors
    later = len(p.seeds.tune) - 1
    return sum(len(lrs) + later * (min(k, len(lrs)) if k else len(lrs))
               for lrs in (grid(p, table, row) for row in p.tables[table].rows))


def benchmarks_section(table: dict) -> str:
    """The README's summary of the ranking: per dataset of the first table, zofed against the best ZO baseline,
    the first-order row on the same set and zero-shot, or that it has not run yet."""
    p = protocol()
    name = next(iter(p.tables))
    rows, _ = current_rows(p, table)
    finals = current_finals(rows)
    alpha = p.federation.alphas[0]
    neither = [line for line in settings_lines(p, name, rows) if line.startswith("Neither")]
    lines = [f"Ranking ([docs/results/ranking.md](docs/results/ranking.md)), table {name}, "
             f"{table_budget(p, name):,.0f} passes of client compute, alpha {alpha}; test accuracy mean ± std (seeds)."
             + (" Neither of zofed's two components is active on it: its row is "
                + neither[0].split("zofed's row is ")[1] if neither else ""), ""]
    for dataset in p.datasets:
        by_row: dict[str, list[dict]] = {}
        for r in finals:
            if (r["table"], r["dataset"], r["alpha"]) == (name, dataset, alpha):
                by_row.setdefault(r["row"], []).append(r)
        if "zofed" not in by_row:
            tuned = sum((r["table"], r["dataset"], r["phase"]) == (name, dataset, "tune") for r in rows)
            lines.append(f"- {dataset}: no final rows yet ({tuned} tuning runs of {tuning_runs(p, name)} done)"
                         if tuned else f"- {dataset}: not run yet")
            continue
        parts = [f"zofed {_mean_std(by_row['zofed'])} ({len(by_row['zofed'])})"]
        compared = []
        zo = {n: rs for n, rs in by_row.items() if kind_of(p, name, n) == "zo"}
        if zo:
            best = max(zo, key=lambda n: np.mean([r["final_accuracy"] for r in zo[n]]))
            parts.append(f"best ZO baseline {best} {_mean_std(zo[best])} ({len(zo[best])})")
            compared.append(best)
        for other in [n for n in p.tables[name].rows if kind_of(p, name, n) == "first-order"][:1]:
            if other in by_row:
                parts.append(f"{other} {_mean_std(by_row[other])} ({len(by_row[other])})")
                compared.append(other)
        if "zero-shot" in by_row:
            parts.append(f"zero-shot {by_row['zero-shot'][0]['final_accuracy']:.4f}")
        verdicts = [verdict(other, *paired(by_row["zofed"], by_row[other])) for other in compared]
        lines.append(f"- {dataset}: " + "; ".join(parts) + (". zofed " + "; ".join(verdicts) if verdicts else ""))
    return "\n".join(lines)


def verdict(other: str, seeds: list[int], diff: np.ndarray) -> str:
    """zofed against `other` from their paired differences (points): ahead or behind where the mean lies two
    standard errors or more from zero, else level; no verdict on fewer than two seeds."""
    if len(seeds) < 2:
        return f"against {other}: {len(seeds)} paired seed, no verdict yet"
    mean, se = float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff)))
    word = "ahead of" if mean >= 2 * se else "behind" if mean <= -2 * se else "level with"
    return f"{word} {other} ({mean:+.2f} points, standard error {se:.2f}, {len(seeds)} seeds)"


def update_readme(section: str, path: Path | None = None) -> bool:
    """Rewrite the README's text between the ranking markers; False (nothing written) where they are absent."""
    path = path or README
    if not path.is_file():
        return False
    text = path.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    new = text[:start + len(BEGIN)] + "\n" + section + "\n" + text[end:]
    if new != text:
        write_atomic_text(path, new)
    return True


def write_report(table: dict) -> None:
    p = protocol()
    rows, old = current_rows(p, table)
    if old:
        print(f"{old} stored rows belong to another protocol: left out of the report", flush=True)
    lines = ["# Ranking federated methods at equal client compute", "", *protocol_lines(p)]
    for name, t in p.tables.items():
        calibration = [r for r in rows if r["table"] == name and r["phase"] == "calibrate"]
        mine = [r for r in rows if r["table"] == name and r["phase"] != "calibrate"]
        budget = [f"Its own budget: {t.budget:,.0f} passes (calibrated below)."] if t.budget else []
        if t.survivors:
            budget.append(f"Tuning by successive halving: every row's whole grid on seed {p.seeds.tune[0]}, then its "
                          f"{t.survivors} best points there on seeds {p.seeds.tune[1:]}; the chosen lr is the best of "
                          f"those on all {len(p.seeds.tune)} seeds.")
        lines += ["", f"## Table {name}: {t.title}", "", *settings_lines(p, name, mine), *budget, "",
                  "Rows: " + ", ".join(f"{n} ({kind_of(p, name, n)}" + (f", the runs of table {r.from_table}"
                                                                          if r.from_table else "") + ")"
                                       for n, r in t.rows.items()) + ".",
                  *calibration_lines(p, name, calibration)]
        if not mine:
            lines += ["", "Not run yet."]
            continue
        for dataset in p.datasets:
            for alpha in p.federation.alphas:
                lines += ["", *dataset_lines(p, name, dataset, alpha, mine),
                          *figure_lines(p, name, dataset, alpha, mine)]
    cost = cost_model_lines()
    if cost:
        lines += ["", *cost]
    write_atomic_text(RESULTS / "ranking.md", "\n".join(lines) + "\n")
    update_readme(benchmarks_section(table))
