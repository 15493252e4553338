"""Benchmark that can rank federated methods: the same client compute for every method, tuned on validation.

Protocol (the learning-speed issue's Part 1):
- Budget: client compute in forward-pass equivalents of the full model, summed over the federation, the same for
  every method (`--budget`, sized by benchmarks/calibrate.py so that centralized MeZO gains clearly over
  zero-shot). A method's rounds follow from it: rounds = budget / (clients per round x its per-client cost a
  round), the cost counted by the method itself (two passes per ZO query and step, three per back-propagated
  step, a cached frozen prefix its share of the blocks).
- Trainable set (`--trainable`): one set for every ZO row, so the baselines run their published algorithms on
  zofed's tensors. zofed's engine lever (the frozen prefix cached, several queries a step) is a row property:
  `zofed` has it, `zofed-uncached` does not (the method alone), and `<baseline>-cached` rows give it to a
  baseline, so a reader sees how much of a margin is the method and how much the engine.
- Federation: 50 clients under Dirichlet label skew (each client's label mix ~ Dir(alpha), equal sizes: the
  partition scheme dirichlet-mix), 5 a round, 4 local steps of batch 8.
- Tuning (`--phase tune`): every method on the same small grid (client lr x server lr factor), one seed, alpha 0.1,
  scored on a seeded validation split carved from the training data (data.evaluate_on: validation); the choice of
  each (dataset, method) and the grid are stored beside the rows.
- Final rows (`--phase final`): the chosen settings, scored on the test split (curves on a fixed 300-example test
  subset, the final accuracy on the whole split), several seeds.
- Report: mean and spread per method, each method's compute to reach the best ZO baseline's final subset
  accuracy, and zofed's paired difference to the best ZO baseline with its standard error; figures of accuracy
  against compute, uplink bytes and rounds. Every sentence is computed from the rows.

Rows are appended to docs/results/ranking.json as they finish (two at a time with `--jobs 2 --threads 1`), so
the matrix fills over sittings. Skipped with a message when ../shared/data is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from calibrate import TASKS  # benchmarks/ is the script's own directory, so first on sys.path
from curve_plot import draw_seed_band, label_and_save
from row_pool import record_rows, run_rows

from zofed.data.builtin import shared_data_dir
from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan
from zofed.run.checkpoint import find_checkpoint, write_atomic_text
from zofed.run.config import FederatedConfig, load_config
from zofed.run.federated import run_federated
from zofed.run.metrics import MetricsLog

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
CLIENTS, PER_ROUND, LOCAL_STEPS, BATCH, VALIDATION = 50, 5, 4, 8, 400
# The trainable set every row shares (`--trainable`): its overrides, the share of SmolLM2's 30 blocks a perturbed
# pass runs when the frozen prefix is cached, and zofed's engine lever on it (the prefix cached and several
# queries a step; none where nothing can be cached). The baselines run their published algorithms on the same
# tensors as zofed; a baseline row with the lever shows how much of a margin is the engine rather than the method.
TOP4 = ["trainable.mode=patterns",
        "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', '^model\\.norm\\.weight$']"]
LEVER_Q4, LEVER_Q16 = ["zo.prefix_cache=true", "zo.queries=4"], ["zo.prefix_cache=true", "zo.queries=16"]
TRAINABLE: dict[str, tuple[list[str], float, list[str]]] = {
    "gains": (["trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']"], 1.0, []),  # all 61 gains
    "top4": (TOP4, 4 / 30, LEVER_Q4),  # the gains of the top 4 blocks and the final norm
    "head": (["trainable.mode=none", "trainable.label_head=true"], 0.0, LEVER_Q16),  # the verbalizer's rows
    "head-top4": ([*TOP4, "trainable.label_head=true"], 4 / 30, LEVER_Q4),
}
# row name -> (federation.method, runs with the engine lever)
ROWS: dict[str, tuple[str, bool]] = {
    "zofed": ("zofed", True),
    "zofed-uncached": ("zofed", False),  # the method alone, at the baselines' one query a step
    "zofed-shared": ("zofed", True),  # the round's clients share step seeds (ROW_OPTIONS): the server's cheap case
    "zofed-zo-adam": ("zofed", True),  # local ZO-Adam on the clients, replayed exactly by the server
    "zofed-tensor": ("zofed", True),  # one server second moment per tensor (zofed's default until global won)
    "zofed-uncached-tensor": ("zofed", False),
    "zofed-cosine-tensor": ("zofed", True),  # the server lr falls along a cosine to zero over the run
    "zofed-beta1-0.5": ("zofed", True),  # a server momentum that forgets in 2 rounds, not 10
    "zofed-beta1-ramp": ("zofed", True),  # server beta1 rising from 0.5 to 0.9 over the run
    "zofed-features": ("zofed", True),  # noise scaled by 1 / RMS of each coordinate's input feature
    "zofed-forward": ("zofed", True),  # one-sided queries around a shared centre pass: q + 1 passes, not 2 q
    "hiso": ("hiso", False),
    "fedkseed": ("fedkseed", False),
    "decomfl": ("decomfl", False),
    "zo-seeds": ("zo-seeds", False),
    "fedmezo": ("fedmezo", False),
    "hiso-cached": ("hiso", True),
    "fedkseed-cached": ("fedkseed", True),
    "decomfl-cached": ("decomfl", True),
    "fedavg-lora": ("fedavg", False),  # first-order: LoRA, its own trainable set (the accuracy ceiling)
}
HEADLINE = ["zofed", "hiso", "fedkseed", "decomfl", "zo-seeds", "fedmezo", "fedavg-lora"]
METHOD_OPTIONS = {"fedkseed": ["federation.pool_size=64"]}
TENSORWISE = "federation.server_optimizer.granularity=tensor"
ROW_OPTIONS = {"zofed-shared": ["federation.sampling.shared_seeds=true"], "zofed-zo-adam": ["optimizer.name=zo-adam"],
               "zofed-tensor": [TENSORWISE], "zofed-uncached-tensor": [TENSORWISE],
               "zofed-cosine-tensor": [TENSORWISE, "federation.server_optimizer.decay=cosine"],
               "zofed-beta1-0.5": ["federation.server_optimizer.beta1=0.5"],
               "zofed-beta1-ramp": ["federation.server_optimizer.beta1_start=0.5"],
               "zofed-features": ["zo.precondition=features"], "zofed-forward": ["zo.estimator=forward"]}


def row_overrides(row: str, trainable: str) -> tuple[list[str], float]:
    """A row's config overrides on a trainable set, and the share of the blocks its perturbed passes run."""
    method, cached = ROWS[row]
    if get_method(method).first_order:
        return ["trainable.mode=lora", *METHOD_OPTIONS.get(method, [])], 1.0
    overrides, fraction, lever = TRAINABLE[trainable]
    lever = lever if cached else []
    return ([*overrides, *lever, *METHOD_OPTIONS.get(method, []), *ROW_OPTIONS.get(row, [])],
            fraction if lever else 1.0)


# The grid every method is tuned on: client lr, and a factor on the server optimizer's default lr. The ZO lrs
# reach 1e-2 because the plain-averaging baselines step by the client lr and did best at the former top, 3e-3.
CLIENT_LRS = {"zo": [3e-4, 1e-3, 3e-3, 1e-2], "first_order": [3e-4, 1e-3, 3e-3]}
SERVER_FACTORS = [1.0, 3.0]
COMMON = ["model.name=smollm2-135m", "optimizer.name=mezo", "zo.eps=1e-3", f"train.batch_size={BATCH}",
          "task.max_length=64", "train.eval_batch_size=32", f"federation.partition.num_clients={CLIENTS}",
          f"federation.clients_per_round={PER_ROUND}", f"federation.local_steps={LOCAL_STEPS}",
          "federation.partition.scheme=dirichlet-mix", "federation.partition.test_fraction=0.1",
          f"data.validation_examples={VALIDATION}", "data.eval_examples=300"]


def per_client_round_cost(row: str, trainable: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row, as its method counts them."""
    overrides, fraction = row_overrides(row, trainable)
    config = load_config(None, [*COMMON, *overrides, f"federation.method={ROWS[row][0]}"], schema=FederatedConfig)
    plan = FederationPlan.from_config(config, CLIENTS, fraction)  # the plan a run of this row follows
    return get_method(ROWS[row][0]).forward_passes(plan.round(0))


def rounds_for(row: str, trainable: str, budget: float) -> int:
    return max(1, int(budget // (PER_ROUND * per_client_round_cost(row, trainable))))


def grid(row: str, lrs: list[float] | None = None, factors: list[float] | None = None) -> list[tuple[float, float]]:
    """The (client lr, server lr factor) points a row is tuned on; `lrs`/`factors` replace the defaults."""
    kind = "first_order" if get_method(ROWS[row][0]).first_order else "zo"
    default_factors = [1.0] if kind == "first_order" else SERVER_FACTORS  # FedAvg's server step is plain averaging
    return [(lr, f) for lr in (lrs or CLIENT_LRS[kind]) for f in (factors or default_factors)]


def row_key(phase: str, row: str, trainable: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float) -> str:
    return f"{phase}|{row}|{trainable}|{dataset}|{alpha}|{seed}|{lr:g}|{factor:g}|{budget:g}"


def _config(phase: str, row: str, trainable: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float, out: Path) -> FederatedConfig:
    method = ROWS[row][0]
    overrides, _ = row_overrides(row, trainable)
    rounds = rounds_for(row, trainable, budget)
    first_order = get_method(method).first_order
    default = get_method(method).server_default
    lr_key = "federation.first_order_lr" if first_order else "optimizer.lr"
    return load_config(None, [
        *COMMON, *TASKS[dataset], *overrides, f"federation.method={method}", f"{lr_key}={lr}",
        f"federation.server_optimizer.lr={default.lr * factor}", f"federation.rounds={rounds}",
        f"federation.eval_every={max(1, rounds // 6)}",
        f"data.evaluate_on={'validation' if phase == 'tune' else 'test'}", f"data.source=shared:{dataset}",
        f"federation.partition.alpha={alpha}", f"federation.partition.seed={seed}", f"train.seed={seed}",
        f"out_dir={out}"], schema=FederatedConfig)


def run_one(phase: str, row: str, trainable: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float) -> dict:
    out = ROOT / "runs" / "bench" / "ranking" / row_key(phase, row, trainable, dataset, alpha, seed, lr, factor,
                                                        budget).replace("|", "_")
    config = _config(phase, row, trainable, dataset, alpha, seed, lr, factor, budget, out)
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None,
                            show_progress=sys.stderr.isatty())
    expected = per_client_round_cost(row, trainable)
    if abs(results["forward_passes_per_client_round"] - expected) > 1e-9:  # the row's cost model must be the run's
        raise RuntimeError(f"{row}: the run counted {results['forward_passes_per_client_round']} passes a client "
                           f"round, the benchmark planned {expected}")
    rounds = [r for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]
    start = results["eval_accuracy_start"]
    curve = [[0.0, 0.0, 0, start]] + [[r["forward_passes"], r["bytes_up_per_client"] * r["round"], r["round"],
                                       r["eval_accuracy"]] for r in rounds if "eval_accuracy" in r]
    return {"phase": phase, "row": row, "trainable": trainable, "trainable_parameters":
            results["trainable_parameters"], "dataset": dataset, "alpha": alpha, "seed": seed, "lr": lr,
            "server_factor": factor, "budget": budget, "rounds": config.federation.rounds,
            "forward_passes": results["forward_passes"], "final_accuracy": round(results["test"]["accuracy"], 4),
            "client_accuracy_mean": results.get("client_accuracy_mean"),
            "bytes_up_per_client_round": results["bytes_up_per_client_round"],
            "bytes_down_per_client_round": results["bytes_down_per_client_round"],
            "curve": curve, "wall_seconds": round(sum(r["round_seconds"] for r in rounds), 1),
            "run_dir": str(out.relative_to(ROOT))}


def _process(phase: str, row: str, trainable: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
             budget: float, threads: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_one(phase, row, trainable, dataset, alpha, seed, lr, factor, budget), "torch_threads": threads}


def choices(table: dict) -> dict[str, dict]:
    """Per (dataset, trainable set, budget, row): the grid point with the best validation accuracy among the
    tuning rows."""
    best: dict[str, dict] = {}
    tried: dict[str, list[str]] = {}
    for r in table["rows"].values():
        if r["phase"] != "tune":
            continue
        key = setting_key(r["dataset"], r["trainable"], r["budget"], r["row"])
        tried.setdefault(key, []).append(f"({r['lr']:g}, {r['server_factor']:g})")
        if key not in best or r["final_accuracy"] > best[key]["final_accuracy"]:
            best[key] = r
    return {k: {"lr": r["lr"], "server_factor": r["server_factor"], "validation_accuracy": r["final_accuracy"],
                "tried": sorted(tried[k])} for k, r in best.items()}


def setting_key(dataset: str, trainable: str, budget: float, row: str) -> str:
    return f"{dataset}|{trainable}|{budget:g}|{row}"


def by_setting(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (dataset, alpha, trainable set, budget): the rows one table or figure compares."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["alpha"], r["trainable"], r["budget"]), []).append(r)
    return dict(sorted(groups.items()))


def reached(curve: list[list[float]], target: float) -> float | None:
    """Forward passes at which a curve first reaches `target` (None: never within its budget)."""
    return next((point[0] for point in curve if point[3] >= target), None)


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for (dataset, alpha, trainable, budget), group in by_setting([r for r in rows if r["phase"] == "final"]).items():
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
        lines += comparison_lines(by_row)
        lines.append("")
    return lines


def comparison_lines(by_row: dict[str, list[dict]]) -> list[str]:
    """zofed against the best ZO baseline of one setting, and the learning-speed issue's targets, from the rows."""
    if "zofed" not in by_row:
        return []
    baselines = {n: rs for n, rs in by_row.items() if ROWS[n][0] != "zofed" and not ROWS[n][1]
                 and not get_method(ROWS[n][0]).first_order}  # published ZO algorithms, without the lever
    # a baseline is compared once it has every seed zofed has, and on those seeds only
    zofed_seeds = {r["seed"] for r in by_row["zofed"]}
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
    mine = {r["seed"]: r for r in by_row["zofed"]}
    theirs = {r["seed"]: r for r in baselines[best]}
    seeds = sorted(mine.keys() & theirs.keys())
    lines += ["", "Targets (the learning-speed issue, from these rows):", ""]
    hits = [reached(mine[s]["curve"], target) for s in seeds]
    spent = float(np.mean([theirs[s]["forward_passes"] for s in seeds]))
    if all(h is not None for h in hits):
        share = float(np.mean(hits)) / spent
        lines.append(f"- Half the compute: zofed reaches {best}'s final subset accuracy at {share:.2f} of {best}'s "
                     f"{spent:,.0f} passes on average: " + ("met" if share <= 0.5 else f"missed by {share - 0.5:.2f}"))
    else:
        lines.append(f"- Half the compute: missed, {sum(h is None for h in hits)} of zofed's {len(hits)} seeds never "
                     f"reach {best}'s final subset accuracy")
    if len(seeds) >= 2:
        diff = np.array([mine[s]["final_accuracy"] - theirs[s]["final_accuracy"] for s in seeds]) * 100
        se = diff.std(ddof=1) / np.sqrt(len(diff))
        verdict = "met" if diff.mean() >= 2 and diff.mean() >= 2 * se else "missed"
        lines.append(f"- zofed minus {best}, paired over seeds {seeds}: {diff.mean():+.2f} points (standard error "
                     f"{se:.2f}); at least +2 points and two standard errors: {verdict}")
    fedavg = [r for r in by_row.get("fedavg-lora", []) if r["seed"] in zofed_seeds]
    if len(fedavg) == len(zofed_seeds):
        gap = 100 * (np.mean([r["final_accuracy"] for r in fedavg])
                     - np.mean([r["final_accuracy"] for r in mine.values()]))
        lines.append(f"- FedAvg with LoRA leads zofed by {gap:+.2f} points; within 3 points: "
                     + ("met" if gap <= 3 else "missed"))
    up = float(np.mean([r["bytes_up_per_client_round"] for r in mine.values()]))
    lines.append(f"- zofed's uplink: {up:,.0f} bytes per client and round; at most 1 KB: "
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
    for (dataset, alpha, trainable, budget), same in by_setting(rows).items():
        finals = [r for r in same if r["phase"] == "final"]
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
             "| validation accuracy | grid points run (client lr, server factor) |", "|" + "---|" * 8]
    for key, c in sorted(choices(table).items()):
        dataset, trainable, budget, row = key.split("|")
        lines.append(f"| {dataset} | {trainable} | {budget} | {row} | {c['lr']:g} | {c['server_factor']:g} "
                     f"| {c['validation_accuracy']:.4f} | {', '.join(c['tried'])} |")
    lines += ["", f"The full grid: client lr {CLIENT_LRS} and server lr factors {SERVER_FACTORS} (first-order rows: "
              "1); a row tuned on fewer points says so in its last column.",
              "", "## Final rows", "", *summary_lines(rows), "## Curves", "", *figures(rows)]
    write_atomic_text(RESULTS / "ranking.md", "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["tune", "final"], default="tune")
    parser.add_argument("--rows", nargs="*", default=HEADLINE, choices=list(ROWS))
    parser.add_argument("--trainable", default="top4", choices=list(TRAINABLE), help="the set every ZO row trains")
    parser.add_argument("--datasets", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--alphas", type=float, nargs="*", default=[0.1])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--budget", type=float, default=2000, help="federation-wide forward-pass equivalents")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--grid-lrs", type=float, nargs="*", help="client lrs to tune on (default: the grid's)")
    parser.add_argument("--grid-factors", type=float, nargs="*", help="server lr factors to tune on")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    path = RESULTS / "ranking.json"
    table = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    if args.table_only:
        write_report(table)
        return
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding sst2/, agnews/, mr/)")
        return
    table["meta"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                     "common": COMMON, "trainable_sets": TRAINABLE, "rows": ROWS}
    chosen = choices(table)
    pending = []
    for dataset in args.datasets:
        for row in args.rows:
            if args.phase == "tune":
                points = grid(row, args.grid_lrs, args.grid_factors)
                seeds, alphas = [args.seeds[0]], [0.1]
            else:
                key = setting_key(dataset, args.trainable, args.budget, row)
                if key not in chosen:
                    print(f"no tuning rows for {row} on {dataset} ({args.trainable}, budget {args.budget:g}): run "
                          "--phase tune first; left out", flush=True)
                    continue
                c = chosen[key]
                points, seeds, alphas = [(c["lr"], c["server_factor"])], args.seeds, args.alphas
            pending += [(args.phase, row, args.trainable, dataset, alpha, seed, lr, factor, args.budget)
                        for alpha in alphas for seed in seeds for lr, factor in points
                        if row_key(args.phase, row, args.trainable, dataset, alpha, seed, lr, factor, args.budget)
                        not in table["rows"]]
    print(f"{len(pending)} runs to do, {args.jobs} at a time", flush=True)
    record_rows(run_rows(_process, pending, row_key, args.jobs, args.threads), table, path,
                lambda: write_report(table), "curve")


if __name__ == "__main__":
    main()
