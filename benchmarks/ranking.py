"""Benchmark that ranks federated methods at equal client compute, its protocol read from benchmarks/ranking.yaml.

- Budget: client compute in forward-pass equivalents of the full model, summed over the federation, the same for
  every row; a row's rounds follow from it and its method's own count of a client round's passes.
- Tables: one per trainable set (`--table`). zofed's row is exactly what `zofed run` does there (its recipe and
  defaults, nothing set by the benchmark but the federation's shape, data, seed, rounds and lr); the ZO baselines
  differ from it only in the method; first-order FedAvg on the same set and FedAvg-LoRA are the first-order rows;
  zero-shot is the initial model on the whole test split.
- Tuning (`--phase tune`): every row on its grid of client lrs, on the protocol's tune seeds, scored on a seeded
  validation split carved from the training data; a table with `survivors` tunes by successive halving (the whole
  grid on the first tune seed, its best points on the rest, the same rule for every row). Finals (`--phase
  final`): each row's chosen lr on the final seeds, scored on the test split (curves on a fixed subset, the final
  accuracy on the whole split).
- Pending runs go by seed, then dataset, then row, then grid point, so a partial sitting gives every row its
  first seed early; rows are appended to docs/results/ranking.json as they finish and the report is rewritten
  (benchmarks/ranking_report.py). `--dry-run` lists the pending runs and each row's rounds and cost.

Skipped with a message when ../shared/data is absent.
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
from calibrate import use_feature_store  # benchmarks/ is the script's own directory, so first on sys.path
from ranking_calibration import calibration_stop
from ranking_protocol import (
    PHASES,
    RESULTS,
    ROOT,
    Protocol,
    budget_stop,
    check_charge,
    check_names,
    choices,
    current_rows,
    is_current,
    least_client_round_cost,
    pending_runs,
    per_client_round_cost,
    phase_budget,
    protocol,
    rounds_for,
    row_digest,
    row_key,
    run_overrides,
)
from ranking_report import write_report
from row_pool import record_rows, run_rows
from safetensors import safe_open

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import shared_data_dir
from zofed.data.partition import client_splits
from zofed.data.tasks import by_length
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build

WARM_CHUNK = 1024
TABLE = RESULTS / "ranking.json"


def run_config(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float,
               out: Path) -> FederatedConfig:
    return load_config(None, run_overrides(protocol(), phase, table, row, dataset, alpha, seed, lr, out),
                       schema=FederatedConfig)


def run_dir(*run: object) -> Path:
    return ROOT / "runs" / "bench" / "ranking" / row_key(*run).replace("|", "_")  # type: ignore[arg-type]


def warm_features(pending: list[tuple], threads: int) -> None:
    """Run the frozen body once over the examples the pending runs read (their clients' and the evaluated split)
    and store the features: the runs then read them instead of each computing them. `threads` must be the rows'
    own: a stored feature's last bits depend on the thread count."""
    torch.set_num_threads(threads)
    done = set()
    for run in pending:
        phase, _, _, dataset, alpha, seed, _ = run
        config = run_config(*run, ROOT / "runs" / "unused")
        if config.zo.cache != "features" or (phase, dataset, alpha, seed) in done:
            continue
        done.add((phase, dataset, alpha, seed))
        setup = build(config)
        splits = client_splits(setup.train_data, config.federation.partition)
        clients = np.unique(np.concatenate([np.concatenate([s.train, s.test]) for s in splits]))
        for name, data, order in [("evaluated split", setup.test, by_length(setup.test)),
                                  ("clients' examples", setup.train, by_length(setup.train, clients))]:
            for start in range(0, len(order), WARM_CHUNK):
                setup.task.last_features(setup.body.cache, data, order[start:start + WARM_CHUNK], body=setup.body)
                setup.save_remembered()  # a chunk at a time: an interrupted warm-up keeps what it ran
                print(f"features of {dataset} seed {seed} ({phase}): {name} "
                      f"{min(start + WARM_CHUNK, len(order))}/{len(order)}", flush=True)


def _identity(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float) -> dict:
    return {"phase": phase, "table": table, "row": row, "dataset": dataset, "alpha": alpha, "seed": seed, "lr": lr,
            "budget": phase_budget(protocol(), table, phase), "protocol": row_digest(protocol(), table, row, phase)}


def zero_shot(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float) -> dict:
    """The initial model's accuracy on the whole test split (no training, no compute charged)."""
    config = run_config(phase, table, row, dataset, alpha, seed, lr, run_dir(phase, table, row, dataset, alpha,
                                                                            seed, lr))
    setup = build(config)
    test = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size, body=setup.body)
    setup.save_remembered()
    return {**_identity(phase, table, row, dataset, alpha, seed, lr), "rounds": 0, "forward_passes": 0.0,
            "forward_passes_per_client_round": 0.0, "final_accuracy": round(test["accuracy"], 4),
            "test_examples": len(setup.test), "trainable_parameters": setup.trainable.numel(),
            "trainable_tensors": len(setup.trainable.names), "bytes_up_per_client_round": 0.0,
            "bytes_down_per_client_round": 0.0, "curve": [], "wall_seconds": 0.0}


IDENTITY = "row.json"  # a run directory's protocol row (its identity and digest), written when a run starts in it


def claim_run_dir(out: Path, identity: dict) -> None:
    """Mark `out` as the run of `identity`, or refuse to continue a run there of another protocol: a run directory
    is named by the row's key alone, so after the protocol changed a resume would carry the old run's rounds into a
    row stored as the new one. A directory whose run started before these marks is taken as it stands."""
    path = out / IDENTITY
    if path.is_file():
        held = json.loads(path.read_text())
        if held != identity:
            raise SystemExit(f"{out} holds a run of protocol {held.get('protocol')} (budget {held.get('budget')}), "
                             f"not {identity['protocol']} (budget {identity['budget']}): delete that directory to run "
                             f"the row again")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_atomic_text(path, json.dumps(identity, indent=2))


def run_one(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float) -> dict:
    if protocol().tables[table].rows[row].kind == "zero-shot":
        return zero_shot(phase, table, row, dataset, alpha, seed, lr)
    out = run_dir(phase, table, row, dataset, alpha, seed, lr)
    claim_run_dir(out, _identity(phase, table, row, dataset, alpha, seed, lr))
    config = run_config(phase, table, row, dataset, alpha, seed, lr, out)
    stops = [budget_stop(table, row, dataset, phase)]
    if phase == "calibrate":  # the rows stored so far, this sitting's included (record_rows writes each as it ends)
        stored = current_rows(protocol(), json.loads(TABLE.read_text()))[0] if TABLE.is_file() else []
        stops.append(calibration_stop(protocol(), table, row, dataset, stored, lambda: starting_accuracy(out)))
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None,
                            show_progress=sys.stderr.isatty(), stop=lambda record: any(s(record) for s in stops))
    check_charge(row, results["forward_passes_per_client_round"], least_client_round_cost(table, row, dataset),
                 per_client_round_cost(table, row, dataset))
    rounds = [r for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]
    curve = [[0.0, 0.0, 0, results["eval_accuracy_start"]]] + [
        [r["forward_passes"], r["bytes_up_per_client"] * r["round"], r["round"], r["eval_accuracy"]]
        for r in rounds if "eval_accuracy" in r]
    with safe_open(out / "final" / "trainable.safetensors", "pt") as stored:
        tensors = len(list(stored.keys()))
    return {**_identity(phase, table, row, dataset, alpha, seed, lr), "rounds": results["rounds"],
            "forward_passes": results["forward_passes"],
            "forward_passes_per_client_round": results["forward_passes_per_client_round"],
            "final_accuracy": round(results["test"]["accuracy"], 4), "test_examples": results["test_examples"],
            "client_accuracy_mean": results.get("client_accuracy_mean"),
            "trainable_parameters": results["trainable_parameters"], "trainable_tensors": tensors,
            "bytes_up_per_client_round": results["bytes_up_per_client_round"],
            "bytes_down_per_client_round": results["bytes_down_per_client_round"],
            "curve": curve, "wall_seconds": round(sum(r["round_seconds"] for r in rounds), 1),
            "run_dir": str(out.relative_to(ROOT))}


def starting_accuracy(out: Path) -> float:
    """A run's round-0 curve point, from its metrics."""
    starts = [r["eval_accuracy"] for r in MetricsLog(out / "metrics.jsonl").read()
              if r.get("event") == "eval" and r.get("round") == 0]
    return starts[-1]


def _process(phase: str, table: str, row: str, dataset: str, alpha: float, seed: int, lr: float,
             threads: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_one(phase, table, row, dataset, alpha, seed, lr), "torch_threads": threads}


def dry_run(table: str, phase: str, rows: list[str], datasets: list[str], pending: list[tuple]) -> None:
    """Each row's cost and rounds on each dataset, then the pending runs' keys, in the order they would run."""
    p = protocol()
    budget = phase_budget(p, table, phase)
    for dataset in datasets:
        for row in rows:
            cost, rounds = per_client_round_cost(table, row, dataset), rounds_for(table, row, dataset, phase)
            least = least_client_round_cost(table, row, dataset)
            if least < cost:  # charged by its draws: it stops where the budget does
                print(f"{dataset} {row}: {least:g} to {cost:g} passes per client round, at most {rounds} rounds, "
                      f"up to {budget:g} passes")
            else:
                print(f"{dataset} {row}: {cost:g} passes per client round, {rounds} rounds, "
                      f"{rounds * p.federation.per_round * cost:g} of {budget:g} passes")
    for run in pending:
        print(row_key(*run))


def main() -> None:
    p = protocol()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=list(PHASES), default="tune",
                        help="calibrate: a table's calibrate rows at max_multiple x the budget, to choose its budget")
    parser.add_argument("--table", default="head", help=f"one of {list(p.tables)}")
    parser.add_argument("--rows", nargs="*", help="rows of the table to run (default: all; e.g. leave out "
                        "fedavg-lora, ~20 min a run)")
    parser.add_argument("--datasets", nargs="*", default=p.datasets)
    parser.add_argument("--seeds", nargs="*", type=int, help="only the phase's runs on these seeds (default: all; "
                        "e.g. every row's seed 0 first)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per run")
    parser.add_argument("--dry-run", action="store_true", help="list the pending runs, each row's rounds and cost")
    parser.add_argument("--table-only", action="store_true", help="rewrite the report from the JSON, leaving out of "
                        "the JSON the rows of another protocol (git keeps them); run nothing")
    args = parser.parse_args()
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {"meta": {}, "rows": {}}
    if args.table_only:
        table["rows"] = {key: row for key, row in table["rows"].items() if is_current(p, row)}
        write_atomic_text(TABLE, json.dumps(table, indent=2))
        write_report(table)
        return
    check_names(p, args.table)
    rows = args.rows if args.rows is not None else list(p.tables[args.table].rows)
    check_names(p, args.table, rows, args.datasets)
    _, old = current_rows(p, table)
    if old:
        print(f"{old} stored rows belong to another protocol: ignored", flush=True)
    pending, notes = sitting(p, args, rows, table)
    for note in notes:
        print(note, flush=True)
    if args.dry_run:
        dry_run(args.table, args.phase, rows, args.datasets, pending)
        return
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding the datasets)")
        return
    table["meta"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                     "protocol": p.model_dump()}
    use_feature_store()  # the runs with zo.cache: features read the features warmed here
    tried: set[tuple] = set()
    while pending:  # successive halving lists a later seed's runs once the first seed's grid is in
        print(f"{len(pending)} runs to do, {args.jobs} at a time", flush=True)
        warm_features(pending, args.threads)
        record_rows(run_rows(_process, pending, row_key, args.jobs, args.threads), table, TABLE,
                    lambda: write_report(table), "curve")
        tried.update(pending)
        pending = [run for run in sitting(p, args, rows, table)[0] if run not in tried]  # a failed run: not again


def sitting(p: Protocol, args: argparse.Namespace, rows: list[str], table: dict) -> tuple[list[tuple], list[str]]:
    """The runs still to do for the command line's table, phase, rows, datasets and seeds, and notes on rows left
    out, from the stored rows of the current protocol."""
    kept, _ = current_rows(p, table)
    done = {row_key(*(r[k] for k in ("phase", "table", "row", "dataset", "alpha", "seed", "lr"))) for r in kept}
    pending, notes = pending_runs(p, args.table, args.phase, rows, args.datasets, done, choices(kept), kept)
    if args.seeds is not None:
        pending = [run for run in pending if run[5] in args.seeds]  # (phase, table, row, dataset, alpha, seed, lr)
    return pending, notes


if __name__ == "__main__":
    main()
