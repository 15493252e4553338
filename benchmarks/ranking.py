"""Benchmark that can rank federated methods: the same client compute for every method, tuned on validation.

Protocol (the learning-speed issue's Part 1):
- Budget: client compute in forward-pass equivalents of the full model, summed over the federation, the same for
  every method (`--budget`, sized by benchmarks/calibrate.py so that centralized MeZO gains clearly over
  zero-shot). A method's rounds follow from it: rounds = budget / (clients per round x its per-client cost a
  round), the cost counted by the method itself (two passes per ZO query and step, three per back-propagated
  step, a cached frozen prefix its share of the blocks).
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
from row_pool import run_rows

from zofed.data.builtin import shared_data_dir
from zofed.fl.methods import get_method
from zofed.fl.plan import LocalTraining
from zofed.run.checkpoint import find_checkpoint, write_atomic_text
from zofed.run.config import FederatedConfig, load_config
from zofed.run.federated import run_federated
from zofed.run.metrics import MetricsLog

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
CLIENTS, PER_ROUND, LOCAL_STEPS, BATCH, VALIDATION = 50, 5, 4, 8, 400
GAINS = ["trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']"]
TOP4 = ["trainable.mode=patterns",
        "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', '^model\\.norm\\.weight$']",
        "zo.prefix_cache=true", "zo.queries=4"]
# row name -> (federation.method, overrides, share of SmolLM2's 30 blocks a perturbed pass runs)
ROWS: dict[str, tuple[str, list[str], float]] = {
    "zofed": ("zofed", GAINS, 1.0),
    "zofed-top4-cached": ("zofed", TOP4, 4 / 30),
    "hiso": ("hiso", GAINS, 1.0),
    "fedkseed": ("fedkseed", [*GAINS, "federation.pool_size=64"], 1.0),
    "decomfl": ("decomfl", GAINS, 1.0),
    "zo-seeds": ("zo-seeds", GAINS, 1.0),
    "fedmezo": ("fedmezo", GAINS, 1.0),
    "decomfl-top4-cached": ("decomfl", TOP4, 4 / 30),  # the strongest-baseline row with zofed's engine lever
    "fedavg-lora": ("fedavg", ["trainable.mode=lora"], 1.0),
}
# The grid every method is tuned on: client lr, and a factor on the server optimizer's default lr.
CLIENT_LRS = {"zo": [1e-4, 3e-4, 1e-3], "first_order": [3e-4, 1e-3, 3e-3]}
SERVER_FACTORS = [1.0, 3.0]
COMMON = ["model.name=smollm2-135m", "optimizer.name=mezo", "zo.eps=1e-3", f"train.batch_size={BATCH}",
          "task.max_length=64", "train.eval_batch_size=32", f"federation.partition.num_clients={CLIENTS}",
          f"federation.clients_per_round={PER_ROUND}", f"federation.local_steps={LOCAL_STEPS}",
          "federation.partition.scheme=dirichlet-mix", "federation.partition.test_fraction=0.1",
          f"data.validation_examples={VALIDATION}", "data.eval_examples=300"]


def per_client_round_cost(row: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row, as its method counts them."""
    method, overrides, fraction = ROWS[row]
    queries = next((int(o.split("=")[1]) for o in overrides if o.startswith("zo.queries=")), 1)
    local = LocalTraining(method, 0, 0, LOCAL_STEPS, 1.0, 1e-3, queries=queries, pass_fraction=fraction)
    return get_method(method).forward_passes(local)


def rounds_for(row: str, budget: float) -> int:
    return max(1, int(budget // (PER_ROUND * per_client_round_cost(row))))


def grid(row: str, lrs: list[float] | None = None, factors: list[float] | None = None) -> list[tuple[float, float]]:
    """The (client lr, server lr factor) points a row is tuned on; `lrs`/`factors` replace the defaults."""
    kind = "first_order" if get_method(ROWS[row][0]).first_order else "zo"
    default_factors = [1.0] if kind == "first_order" else SERVER_FACTORS  # FedAvg's server step is plain averaging
    return [(lr, f) for lr in (lrs or CLIENT_LRS[kind]) for f in (factors or default_factors)]


def row_key(phase: str, row: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float) -> str:
    return f"{phase}|{row}|{dataset}|{alpha}|{seed}|{lr:g}|{factor:g}|{budget:g}"


def _config(phase: str, row: str, dataset: str, alpha: float, seed: int, lr: float, factor: float, budget: float,
            out: Path) -> FederatedConfig:
    method, overrides, _ = ROWS[row]
    first_order = get_method(method).first_order
    default = get_method(method).server_default
    lr_key = "federation.first_order_lr" if first_order else "optimizer.lr"
    return load_config(None, [
        *COMMON, *TASKS[dataset], *overrides, f"federation.method={method}", f"{lr_key}={lr}",
        f"federation.server_optimizer.lr={default.lr * factor}", f"federation.rounds={rounds_for(row, budget)}",
        f"federation.eval_every={max(1, rounds_for(row, budget) // 6)}",
        f"data.evaluate_on={'validation' if phase == 'tune' else 'test'}", f"data.source=shared:{dataset}",
        f"federation.partition.alpha={alpha}", f"federation.partition.seed={seed}", f"train.seed={seed}",
        f"out_dir={out}"], schema=FederatedConfig)


def run_one(phase: str, row: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float) -> dict:
    out = ROOT / "runs" / "bench" / "ranking" / row_key(phase, row, dataset, alpha, seed, lr, factor,
                                                        budget).replace("|", "_")
    config = _config(phase, row, dataset, alpha, seed, lr, factor, budget, out)
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None,
                            show_progress=sys.stderr.isatty())
    expected = per_client_round_cost(row)
    if abs(results["forward_passes_per_client_round"] - expected) > 1e-9:  # the row's cost model must be the run's
        raise RuntimeError(f"{row}: the run counted {results['forward_passes_per_client_round']} passes a client "
                           f"round, the benchmark planned {expected}")
    rounds = [r for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]
    start = results["eval_accuracy_start"]
    curve = [[0.0, 0.0, 0, start]] + [[r["forward_passes"], r["bytes_up_per_client"] * r["round"], r["round"],
                                       r["eval_accuracy"]] for r in rounds if "eval_accuracy" in r]
    return {"phase": phase, "row": row, "dataset": dataset, "alpha": alpha, "seed": seed, "lr": lr,
            "server_factor": factor, "budget": budget, "rounds": config.federation.rounds,
            "forward_passes": results["forward_passes"], "final_accuracy": round(results["test"]["accuracy"], 4),
            "client_accuracy_mean": results.get("client_accuracy_mean"),
            "bytes_up_per_client_round": results["bytes_up_per_client_round"],
            "bytes_down_per_client_round": results["bytes_down_per_client_round"],
            "curve": curve, "wall_seconds": round(sum(r["round_seconds"] for r in rounds), 1),
            "run_dir": str(out.relative_to(ROOT))}


def _process(phase: str, row: str, dataset: str, alpha: float, seed: int, lr: float, factor: float, budget: float,
             threads: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_one(phase, row, dataset, alpha, seed, lr, factor, budget), "torch_threads": threads}


def choices(table: dict) -> dict[str, dict]:
    """Per (dataset, row): the grid point with the best validation accuracy among the tuning rows."""
    best: dict[str, dict] = {}
    for r in table["rows"].values():
        if r["phase"] != "tune":
            continue
        key = f"{r['dataset']}|{r['row']}"
        if key not in best or r["final_accuracy"] > best[key]["final_accuracy"]:
            best[key] = r
    return {k: {"lr": r["lr"], "server_factor": r["server_factor"], "validation_accuracy": r["final_accuracy"]}
            for k, r in best.items()}


def reached(curve: list[list[float]], target: float) -> float | None:
    """Forward passes at which a curve first reaches `target` (None: never within its budget)."""
    return next((point[0] for point in curve if point[3] >= target), None)


def summary_lines(rows: list[dict]) -> list[str]:
    finals = [r for r in rows if r["phase"] == "final"]
    lines = []
    for dataset, alpha in sorted({(r["dataset"], r["alpha"]) for r in finals}):
        group = [r for r in finals if (r["dataset"], r["alpha"]) == (dataset, alpha)]
        by_row: dict[str, list[dict]] = {}
        for r in group:
            by_row.setdefault(r["row"], []).append(r)
        lines += [f"### {dataset}, alpha {alpha}", "",
                  "| row | seeds | final accuracy (mean ± std) | subset accuracy at the end | rounds | passes "
                  "| bytes up / client / round |", "|" + "---|" * 7]
        for name, rs in by_row.items():
            acc = np.array([r["final_accuracy"] for r in rs])
            end = np.mean([r["curve"][-1][3] for r in rs])
            lines.append(f"| {name} | {len(rs)} | {acc.mean():.4f} ± {acc.std():.4f} | {end:.4f} | {rs[0]['rounds']} "
                         f"| {rs[0]['forward_passes']:,.0f} | {rs[0]['bytes_up_per_client_round']:,.0f} |")
        baselines = {n: rs for n, rs in by_row.items() if not n.startswith("zofed")
                     and not get_method(ROWS[n][0]).first_order}
        if baselines and "zofed" in by_row:
            best = max(baselines, key=lambda n: np.mean([r["curve"][-1][3] for r in baselines[n]]))
            target = float(np.mean([r["curve"][-1][3] for r in baselines[best]]))
            lines += ["", f"The best ZO baseline here is {best} (subset accuracy {target:.4f} at the end of its "
                          "budget). Compute each row needs to reach it, mean over its seeds that reach it:", ""]
            for name, rs in by_row.items():
                hits = [reached(r["curve"], target) for r in rs]
                got = [h for h in hits if h is not None]
                lines.append(f"- {name}: " + (f"{np.mean(got):,.0f} forward passes ({len(got)} of {len(rs)} seeds)"
                                              if got else f"not reached by any of {len(rs)} seeds"))
            mine = {r["seed"]: r["final_accuracy"] for r in by_row["zofed"]}
            theirs = {r["seed"]: r["final_accuracy"] for r in baselines[best]}
            seeds = sorted(mine.keys() & theirs.keys())
            if len(seeds) >= 2:
                diff = np.array([mine[s] - theirs[s] for s in seeds]) * 100
                se = diff.std(ddof=1) / np.sqrt(len(diff))
                lines.append(f"- zofed minus {best}, paired over seeds {seeds}: {diff.mean():+.2f} points "
                             f"(standard error {se:.2f})")
        lines.append("")
    return lines


def write_report(table: dict) -> None:
    rows = list(table["rows"].values())
    lines = ["# Ranking federated methods at equal client compute", "",
             f"SmolLM2-135M; {CLIENTS} clients (Dirichlet label skew), {PER_ROUND} a round, {LOCAL_STEPS} local steps "
             f"of batch {BATCH}; the same client compute (forward-pass equivalents of the full model, summed over "
             f"the federation) for every row; settings tuned on a {VALIDATION}-example validation split carved from "
             "the training data; final accuracy on the full test split, curves on a fixed 300-example test subset. "
             "Reproduce: `.venv/bin/python benchmarks/ranking.py --phase tune`, then `--phase final`.", "",
             "## Tuning choices", "", "| dataset | row | client lr | server lr factor | validation accuracy |",
             "|---|---|---|---|---|"]
    for key, c in sorted(choices(table).items()):
        dataset, row = key.split("|")
        lines.append(f"| {dataset} | {row} | {c['lr']:g} | {c['server_factor']:g} | {c['validation_accuracy']:.4f} |")
    lines += ["", f"Grid: client lr {CLIENT_LRS} and server lr factors {SERVER_FACTORS} (first-order rows: 1).",
              "", "## Final rows", "", *summary_lines(rows)]
    write_atomic_text(RESULTS / "ranking.md", "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["tune", "final"], default="tune")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
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
                     "common": COMMON, "rows": {k: v[1] for k, v in ROWS.items()}}
    chosen = choices(table)
    pending = []
    for dataset in args.datasets:
        for row in args.rows:
            if args.phase == "tune":
                points = grid(row, args.grid_lrs, args.grid_factors)
                seeds, alphas = [args.seeds[0]], [0.1]
            else:
                if f"{dataset}|{row}" not in chosen:
                    print(f"no tuning rows for {row} on {dataset}: run --phase tune first; left out", flush=True)
                    continue
                c = chosen[f"{dataset}|{row}"]
                points, seeds, alphas = [(c["lr"], c["server_factor"])], args.seeds, args.alphas
            pending += [(args.phase, row, dataset, alpha, seed, lr, factor, args.budget) for alpha in alphas
                        for seed in seeds for lr, factor in points
                        if row_key(args.phase, row, dataset, alpha, seed, lr, factor, args.budget)
                        not in table["rows"]]
    print(f"{len(pending)} runs to do, {args.jobs} at a time", flush=True)
    for key, row in run_rows(_process, pending, row_key, args.jobs, args.threads):
        if isinstance(row, BaseException):
            print(f"run {key} failed: {row!r}", file=sys.stderr, flush=True)
            continue
        table["rows"][key] = row
        write_atomic_text(path, json.dumps(table, indent=2))
        write_report(table)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)


if __name__ == "__main__":
    main()
