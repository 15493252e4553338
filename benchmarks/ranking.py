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
- Tuning (`--phase tune`): every method on the same small grid (client lr x server lr factor), alpha 0.1, one
  seed or several (`--seeds`: a grid point's score is its mean over them), scored on a seeded validation split
  carved from the training data (data.evaluate_on: validation); the choice of each (dataset, method) and the
  grid are stored beside the rows.
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
from calibrate import REMEMBER_FEATURES, TASKS  # benchmarks/ is the script's own directory, so first on sys.path
from ranking_protocol import (
    COMMON,
    HEADLINE,
    RESULTS,
    ROOT,
    ROWS,
    TRAINABLE,
    choices,
    grid,
    per_client_round_cost,
    rounds_for,
    row_key,
    row_overrides,
    server_default,
    setting_key,
)
from ranking_report import write_report
from row_pool import record_rows, run_rows

from zofed.data.builtin import shared_data_dir
from zofed.data.partition import client_splits
from zofed.data.tasks import by_length
from zofed.fl.methods import get_method
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build

WARM_CHUNK = 1024


def _config(phase: str, row: str, trainable: str, dataset: str, alpha: float, seed: int, lr: float, factor: float,
            budget: float, out: Path) -> FederatedConfig:
    method = ROWS[row][0]
    overrides, _ = row_overrides(row, trainable)
    rounds = rounds_for(row, trainable, budget)
    first_order = get_method(method).first_order
    default = server_default(row)
    lr_key = "federation.first_order_lr" if first_order else "optimizer.lr"
    # a frozen body: the simulation runs each example through it once, for every row and seed (REMEMBER_FEATURES)
    remember = REMEMBER_FEATURES if TRAINABLE[trainable][1] == 0.0 and not first_order else []
    return load_config(None, [
        *COMMON, *TASKS[dataset], *overrides, *remember, f"federation.method={method}", f"{lr_key}={lr}",
        f"federation.server_optimizer.name={default.name}", f"federation.server_optimizer.lr={default.lr * factor}",
        f"federation.rounds={rounds}",
        f"federation.eval_every={max(1, rounds // 6)}",
        f"data.evaluate_on={'validation' if phase == 'tune' else 'test'}", f"data.source=shared:{dataset}",
        f"federation.partition.alpha={alpha}", f"federation.partition.seed={seed}", f"train.seed={seed}",
        f"out_dir={out}"], schema=FederatedConfig)


def warm_features(pending: list[tuple], threads: int) -> None:
    """Run the frozen body once over the examples the pending runs read (their clients' and the evaluated split),
    here with every thread, and store the features: the runs then read them instead of each computing them."""
    torch.set_num_threads(threads)
    done = set()
    for phase, row, trainable, dataset, alpha, seed, lr, factor, budget in pending:
        config = _config(phase, row, trainable, dataset, alpha, seed, lr, factor, budget, ROOT / "runs" / "unused")
        if not config.train.remember_features or (phase, dataset, alpha, seed) in done:
            continue
        done.add((phase, dataset, alpha, seed))
        setup = build(config)
        splits = client_splits(setup.train_data, config.federation.partition)
        clients = np.unique(np.concatenate([np.concatenate([s.train, s.test]) for s in splits]))
        for name, data, order in [("evaluated split", setup.test, by_length(setup.test)),
                                  ("clients' examples", setup.train, by_length(setup.train, clients))]:
            for start in range(0, len(order), WARM_CHUNK):
                setup.task.remembered_features(data, order[start:start + WARM_CHUNK])
                setup.task.save_remembered()  # a chunk at a time: an interrupted warm-up keeps what it ran
                print(f"features of {dataset} seed {seed} ({phase}): {name} "
                      f"{min(start + WARM_CHUNK, len(order))}/{len(order)}", flush=True)


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
                seeds, alphas = args.seeds, [0.1]
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
    warm_features(pending, args.threads * args.jobs)
    record_rows(run_rows(_process, pending, row_key, args.jobs, args.threads), table, path,
                lambda: write_report(table), "curve")


if __name__ == "__main__":
    main()
