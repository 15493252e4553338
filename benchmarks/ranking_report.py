"""The ranking benchmark's report (docs/results/ranking.md and its figures), written from the rows alone: the
tuning choices, the final rows with their spread, zofed against the best ZO baseline and the learning-speed
issue's targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from curve_plot import draw_seed_band, label_and_save  # benchmarks/ is the script's own directory
from ranking_protocol import (
    BATCH,
    CLIENT_LRS,
    CLIENTS,
    LOCAL_STEPS,
    PER_ROUND,
    RESULTS,
    ROWS,
    SERVER_FACTORS,
    TRAINABLE,
    VALIDATION,
    choices,
    setting_key,
)

from zofed.atomic_files import write_atomic_text
from zofed.fl.methods import get_method


def by_setting(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (dataset, alpha, trainable set, budget): the rows one table or figure compares."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["alpha"], r["trainable"], r["budget"]), []).append(r)
    return dict(sorted(groups.items()))


def reached(curve: list[list[float]], target: float) -> float | None:
    """Forward passes at which a curve first reaches `target` (None: never within its budget)."""
    # a mean of k/300 accuracies is a float a few ulps off the fraction a seed hits exactly: compare with a tolerance
    return next((point[0] for point in curve if point[3] >= target - 1e-9), None)


def judged_row(chosen: dict[str, dict], dataset: str, trainable: str, budget: float) -> tuple[str, float | None]:
    """The zofed row a setting's targets are judged on, and its validation accuracy: of the zofed variants tuned
    there, the best on validation (zofed's levers are chosen the way its lr is, never on the test split), whether
    or not it has final rows yet; plain `zofed` where none was tuned."""
    tuned = {n: c["validation_accuracy"] for n in ROWS if ROWS[n][0] == "zofed"
             and (c := chosen.get(setting_key(dataset, trainable, budget, n))) is not None}
    if not tuned:
        return "zofed", None
    best = max(tuned, key=tuned.__getitem__)
    return best, tuned[best]


def current_finals(rows: list[dict]) -> list[dict]:
    """The final rows run at the grid point tuning chooses now: a row tuned again on more points may choose another
    lr, and its finals at the old one then describe a setting no longer chosen (kept in the table, not reported)."""
    chosen = choices({"rows": dict(enumerate(rows))})

    def current(r: dict) -> bool:
        c = chosen.get(setting_key(r["dataset"], r["trainable"], r["budget"], r["row"]))
        return c is None or (r["lr"], r["server_factor"]) == (c["lr"], c["server_factor"])

    return [r for r in rows if r["phase"] == "final" and current(r)]


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    finals = current_finals(rows)
    stale = sum(r["phase"] == "final" for r in rows) - len(finals)
    if stale:
        lines += [f"{stale} final rows were run at a grid point their row's tuning no longer chooses; they stay in "
                  "ranking.json and are left out below.", ""]
    chosen = choices({"rows": dict(enumerate(rows))})
    for (dataset, alpha, trainable, budget), group in by_setting(finals).items():
        by_row: dict[str, list[dict]] = {}
        for r in group:
            by_row.setdefault(r["row"], []).append(r)
        lines += [f"### {dataset}, alpha {alpha}, trainable set {trainable}, budget {budget:,.0f} passes", "",
                  "| row | seeds | final accuracy (mean ± std) | subset accuracy at the end | rounds | passes "
                  "| bytes up / client / round |", "|" + "---|" * 7]
        for name, rs in by_row.items():
            acc = np.array([r["final_accuracy"] for r in rs])
            end = np.mean([r["curve"][-1][3] for r in rs])
            spread = f"{acc.std(ddof=1):.4f}" if len(acc) > 1 else "n/a"  # the sample standard deviation
            lines.append(f"| {name} | {len(rs)} | {acc.mean():.4f} ± {spread} | {end:.4f} | {rs[0]['rounds']} "
                         f"| {rs[0]['forward_passes']:,.0f} | {rs[0]['bytes_up_per_client_round']:,.0f} |")
        mine, validation = judged_row(chosen, dataset, trainable, budget)
        if validation is not None:
            lines += ["", f"zofed's row here, the zofed variant with the best validation accuracy: {mine} "
                          f"({validation:.4f})."]
        fedavg = [r for r in finals if r["row"] == "fedavg-lora" and (r["dataset"], r["alpha"], r["budget"])
                  == (dataset, alpha, budget)]  # its own trainable set, whatever the ZO rows train
        lines += comparison_lines(by_row, mine, fedavg, alpha)
        lines += same_engine_lines(by_row, fedavg)
        lines.append("")
    return lines


TARGET_SEEDS = 5  # the seeds the learning-speed issue's targets are judged on, at the headline alpha
HEADLINE_ALPHA, OTHER_ALPHA_SEEDS = 0.1, 3  # the issue runs its other alpha on 2-3 seeds


def comparison_lines(by_row: dict[str, list[dict]], zofed: str = "zofed",
                     fedavg: list[dict] | None = None, alpha: float = HEADLINE_ALPHA) -> list[str]:
    """zofed (its row `zofed`) against the best ZO baseline of one setting, and the learning-speed issue's
    targets, from the rows; `fedavg`: FedAvg with LoRA's rows (default: the setting's own). Away from the
    headline alpha the targets' measures are read on fewer seeds, as the issue runs that alpha."""
    if zofed not in by_row:
        return ["", f"{zofed} has no final rows here yet: the targets are not judged."]
    baselines = {n: rs for n, rs in by_row.items() if ROWS[n][0] != "zofed" and not ROWS[n][1]
                 and not get_method(ROWS[n][0]).first_order}  # published ZO algorithms, without the lever
    if not baselines:
        return ["", "No published ZO baseline (without zofed's engine lever) has final rows here yet: the targets "
                    "are not judged."]
    # a baseline is compared once it has every seed zofed has, and on those seeds only
    zofed_seeds = {r["seed"] for r in by_row[zofed]}
    baselines = {n: [r for r in rs if r["seed"] in zofed_seeds] for n, rs in baselines.items()}
    lines = []
    partial = sorted(n for n, rs in baselines.items() if len(rs) < len(zofed_seeds))
    if partial:
        lines += ["", f"Not compared yet, fewer seeds than zofed's {len(zofed_seeds)}: "
                  + ", ".join(f"{n} ({len(baselines[n])})" for n in partial) + "."]
    baselines = {n: rs for n, rs in baselines.items() if n not in partial}
    if not baselines:
        return lines
    best = max(baselines, key=lambda n: np.mean([r["curve"][-1][3] for r in baselines[n]]))
    target = float(np.mean([r["curve"][-1][3] for r in baselines[best]]))
    lines += ["", f"The best ZO baseline here is {best} (subset accuracy {target:.4f} at the end of its "
                  "budget). Compute each row needs to reach it, mean over its seeds that reach it:", ""]
    for name, rs in by_row.items():
        got = [h for h in (reached(r["curve"], target) for r in rs) if h is not None]
        lines.append(f"- {name}: " + (f"{np.mean(got):,.0f} forward passes ({len(got)} of {len(rs)} seeds)"
                                      if got else f"not reached by any of {len(rs)} seeds"))
    mine = {r["seed"]: r for r in by_row[zofed]}
    theirs = {r["seed"]: r for r in baselines[best]}
    seeds = sorted(mine.keys() & theirs.keys())
    needed = TARGET_SEEDS if alpha == HEADLINE_ALPHA else OTHER_ALPHA_SEEDS
    lines += ["", "Targets (the learning-speed issue, from these rows):" if alpha == HEADLINE_ALPHA else
              f"The targets' measures at alpha {alpha} (the issue sets its targets at alpha {HEADLINE_ALPHA} on "
              f"{TARGET_SEEDS} seeds, and runs this alpha on {OTHER_ALPHA_SEEDS}):", ""]
    # fewer seeds than the setting runs can only say a target is on track
    met = "met" if len(seeds) >= needed else f"met on {len(seeds)} of the {needed} seeds so far"
    hits = [reached(mine[s]["curve"], target) for s in seeds]
    spent = float(np.mean([theirs[s]["forward_passes"] for s in seeds]))
    zero_shot = float(np.mean([theirs[s]["curve"][0][3] for s in seeds]))
    if all(h is not None for h in hits):
        share = float(np.mean(hits)) / spent
        lines.append(f"- Half the compute: {zofed} reaches {best}'s final subset accuracy at {share:.2f} of {best}'s "
                     f"{spent:,.0f} passes on average: " + (met if share <= 0.5 else f"missed by {share - 0.5:.2f}")
                     + (f" (an empty bar: {best} ends at or below the zero-shot subset accuracy, {zero_shot:.4f})"
                        if target <= zero_shot + 1e-9 else ""))
    else:
        lines.append(f"- Half the compute: missed, {sum(h is None for h in hits)} of {zofed}'s {len(hits)} seeds never "
                     f"reach {best}'s final subset accuracy")
    # the margin is judged against the baseline with the best final accuracy on the whole test split, which need
    # not be the one whose curve ends highest on the watched subset
    strongest = max(baselines, key=lambda n: np.mean([r["final_accuracy"] for r in baselines[n]]))
    seeds = sorted(mine.keys() & {r["seed"] for r in baselines[strongest]})
    if len(seeds) >= 2:
        diff = paired(by_row[zofed], baselines[strongest])[1]
        se = diff.std(ddof=1) / np.sqrt(len(diff))
        verdict = met if diff.mean() >= 2 and diff.mean() >= 2 * se else "missed"
        lines.append(f"- {zofed} minus {strongest} (the baseline with the best final accuracy), paired over seeds "
                     f"{seeds}: {diff.mean():+.2f} points (standard error {se:.2f}); at least +2 points and two "
                     f"standard errors: {verdict}")
    fedavg = [r for r in (by_row.get("fedavg-lora", []) if fedavg is None else fedavg) if r["seed"] in zofed_seeds]
    if len(fedavg) == len(zofed_seeds):
        gap = 100 * (np.mean([r["final_accuracy"] for r in fedavg])
                     - np.mean([r["final_accuracy"] for r in mine.values()]))
        standing = f"leads {zofed} by {gap:.2f} points" if gap > 0 else f"is {-gap:.2f} points behind {zofed}"
        lines.append(f"- FedAvg with LoRA {standing}; within 3 points: " + ("met" if gap <= 3 else "missed"))
    else:
        lines.append(f"- FedAvg with LoRA: final rows on {len(fedavg)} of {zofed}'s {len(zofed_seeds)} seeds here; "
                     "within 3 points: not judged yet")
    up = float(np.mean([r["bytes_up_per_client_round"] for r in mine.values()]))
    lines.append(f"- {zofed}'s uplink: {up:,.0f} bytes per client and round; at most 1 KB: "
                 + ("met" if up <= 1024 else "missed"))
    return lines


def plot_curves(groups: dict[str, list[dict]], title: str, path: Path) -> None:
    """Accuracy against client compute, uplink bytes per client and rounds: per row the mean over its seeds, with
    the seeds' range as a band (rows of one setting share their evaluation points)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for name, rs in groups.items():
        curves = np.array([r["curve"] for r in rs if len(r["curve"]) == len(rs[0]["curve"])])
        draw_seed_band(axes, name, curves, curves[:, :, 3])
    label_and_save(fig, axes, "accuracy", title, path)


def figures(rows: list[dict]) -> list[str]:
    """One figure per setting: the final rows (test subset), or while there are none, each row's chosen tuning
    run (validation); returns the markdown that shows them."""
    lines = []
    chosen = choices({"rows": dict(enumerate(rows))})
    current = {id(r) for r in current_finals(rows)}
    for (dataset, alpha, trainable, budget), same in by_setting(rows).items():
        finals = [r for r in same if id(r) in current]
        if finals:
            picked, what = finals, "final rows, test subset"
        else:
            picked = [r for r in same if r["phase"] == "tune"
                      and (r["lr"], r["server_factor"]) == tuple(chosen[setting_key(
                          dataset, trainable, budget, r["row"])][k] for k in ("lr", "server_factor"))]
            what = "tuning runs at each row's chosen point, validation, one seed"
        groups: dict[str, list[dict]] = {}
        for r in picked:
            groups.setdefault(r["row"], []).append(r)
        name = f"ranking_{dataset}_a{alpha}_{trainable}_b{budget:g}.png"
        plot_curves(groups, f"{dataset}, alpha {alpha}, {trainable}, {budget:,.0f} passes ({what})", RESULTS / name)
        lines += [f"![{dataset} {trainable}]({name})", ""]
    return lines


def paired(mine: list[dict], theirs: list[dict]) -> tuple[list[int], np.ndarray]:
    """The seeds both row lists have, and the paired final-accuracy differences on them in points."""
    a, b = {r["seed"]: r for r in mine}, {r["seed"]: r for r in theirs}
    seeds = sorted(a.keys() & b.keys())
    return seeds, np.array([a[s]["final_accuracy"] - b[s]["final_accuracy"] for s in seeds]) * 100


def same_engine_lines(by_row: dict[str, list[dict]], fedavg: list[dict]) -> list[str]:
    """Each zofed variant row against the baseline given the same lever (its row name with the method swapped:
    zofed-features-cached against hiso-features-cached), and against FedAvg with LoRA, on the seeds they share:
    how much of a margin is the method's and how much the engine's."""
    lines = []
    for name, rs in by_row.items():
        method, _, lever = name.partition("-")
        if method != "zofed" or not lever:
            continue
        # a per-class head changes only what zofed's block sampling chooses among (a baseline perturbs every
        # tensor each step), so its baseline row is the one with the one-tensor head
        lever = lever.removeprefix("perclass-")
        others = [(f"{m}-{lever}", by_row[f"{m}-{lever}"]) for m in sorted({ROWS[n][0] for n in ROWS} - {"zofed"})
                  if f"{m}-{lever}" in by_row]
        for label, theirs in [*others, ("fedavg-lora", fedavg)]:
            seeds, diff = paired(rs, theirs)
            if not seeds:
                continue
            se = f"{diff.std(ddof=1) / np.sqrt(len(diff)):.2f}" if len(diff) > 1 else "n/a"
            lines.append(f"- {name} minus {label}, paired over seeds {seeds}: {diff.mean():+.2f} points (standard "
                         f"error {se})")
    return (["", "The same engine (a zofed variant against the baseline row with its lever, and against FedAvg "
             "with LoRA):", "", *lines] if lines else [])


def write_report(table: dict) -> None:
    rows = list(table["rows"].values())
    lines = ["# Ranking federated methods at equal client compute", "",
             f"SmolLM2-135M; {CLIENTS} clients (Dirichlet label skew), {PER_ROUND} a round, {LOCAL_STEPS} local steps "
             f"of batch {BATCH}; the same client compute (forward-pass equivalents of the full model, summed over "
             f"the federation) for every row; settings tuned on a {VALIDATION}-example validation split carved from "
             "the training data; final accuracy on the full test split, curves on a fixed 300-example test subset. "
             "Reproduce: `.venv/bin/python benchmarks/ranking.py --phase tune`, then `--phase final`.", "",
             "Trainable sets: " + "; ".join(f"`{k}`: {' '.join(v[0])}" for k, v in TRAINABLE.items()) + ".", "",
             "## Tuning choices", "", "| dataset | trainable | budget | row | client lr | server lr factor "
             "| validation accuracy | seeds | grid points run (client lr, server factor) |", "|" + "---|" * 9]
    for key, c in sorted(choices(table).items()):
        dataset, trainable, budget, row = key.split("|")
        lines.append(f"| {dataset} | {trainable} | {budget} | {row} | {c['lr']:g} | {c['server_factor']:g} "
                     f"| {c['validation_accuracy']:.4f} | {c['seeds']} | {', '.join(c['tried'])} |")
    lines += ["", f"The full grid: client lr {CLIENT_LRS} and server lr factors {SERVER_FACTORS} (first-order rows: "
              "1); a row tuned on fewer points says so in its last column. A point's validation accuracy is its "
              "mean over the seeds it was tuned on; a point tuned on more seeds is preferred to one tuned on fewer.",
              "", "## Final rows", "", *summary_lines(rows), "## Curves", "", *figures(rows)]
    write_atomic_text(RESULTS / "ranking.md", "\n".join(lines) + "\n")
