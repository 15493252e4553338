"""Instruction tuning at equal client compute: SmolLM2-135M-Instruct on the federated Dolly/Alpaca split, ROUGE-L.

Protocol (the instruction-tuning issue):
- Data: `data.source=shared:dolly`, one client per training file (`federation.partition.scheme=natural`,
  `column=client`: 9 clients, client 3 is missing upstream), every client's records used for training
  (`test_fraction=0`: a per-client evaluation would generate for every client's held-out records, more than the
  whole rest of the run on a CPU); scored on the 160-example global test set.
- Model and trainable set: the packaged `smollm2-135m` (SmolLM2-135M-Instruct), prompts in its chat template
  (`task.prompt_format=auto`), `task.max_length` 256. Every row trains the same tensors, LoRA r 8 on q_proj and
  v_proj (`trainable.mode=lora`, the default), the ZO rows included: one trainable set, the one FedAvg needs.
  One more row prices zofed's engine lever on this task: `zofed-top2-cached` trains the same adapters on the top
  2 blocks only (`trainable.lora_layers`), runs the frozen bottom once a step (`zo.cache: prefix`) and averages 4
  queries a step over the top blocks (ROW_OPTIONS); `zofed-start` measures zofed's relative server step against
  each tensor's RMS at the start of the run (`relative_to=start`). These two are levers, priced by their tuning runs
  (their finals run when `--rows` names them); the targets judge the `zofed` row, zofed as `zofed run` ships it, and
  a lever that beats it on validation becomes zofed's default in its own commit before the table is rerun.
- Federation: 3 of the 9 clients a round, 4 local steps of batch 4.
- Budget (`--budget`): client compute in forward-pass equivalents of the full model (a backward counts as two
  forwards), summed over the federation, the same for every row; each method counts its own cost, so a row's
  rounds = budget // (3 clients x its per-client round cost): 8 passes for a ZO method (4 steps x 2 passes), 12
  for FedAvg (4 steps x a forward and a backward). The run's own count is checked against the plan; a row charged
  each step from the tensors it drew (zofed-top2-cached) runs until another round could pass the budget.
- Step sizes, tuned (`--phase tune`): every row runs each point of its grid (`GRIDS`: four points along the lever
  that sets its step, a client lr or a server lr) at the same budget on seed 0, scored by the loss on the responses
  of a validation split carved from the training data (`VALIDATION` records, held out of every client; no
  generation, and never the test set); each row's finals (`--phase final`, the default) run at the point with the
  lowest validation loss. Every server optimizer is its method's default (zofed: adam with one global second
  moment and relative steps; the baselines: plain averaging), its lr times the point's factor.
- Evaluation: ROUGE-L F1 (rouge-score, stemmed) of greedy generations, reported in points (x100). The curves:
  a fixed 40-example subset of the test set (drawn per seed, `data.eval_examples`), about 6 times a run, each
  answer at most `--curve-tokens` new tokens; the final test: all 160 examples, at most `--max-new-tokens`
  (`task.generate_eval` 160 covers both: a curve evaluation generates for its whole subset).
- zero-shot: the starting model (LoRA's B starts at zero, so the packaged model itself) on the whole test set,
  once: no seed changes it (greedy decoding, a fixed test set). Its value on each seed's subset is every run's
  round-0 curve point.
- Seeds (`--seeds`, default 0 1 2): the run seed (steps, client sampling, the curve subset); mean and standard
  deviation (n - 1) over them.
- Report: every sentence computed from the rows, including the issue's two targets (every federated row at or
  above zero-shot; zofed at least FedKSeed + 1 ROUGE-L point); figures of ROUGE-L against client compute,
  uplink bytes and rounds.

Rows run in their own processes (`--jobs`, `--threads` each), each in a run directory under
runs/bench/instruction/ that resumes from its checkpoint, and are stored as they finish in
<out>/instruction.json (default docs/results), the report <out>/instruction.md rewritten from the rows
(`--table-only` rewrites it alone). Skipped with a message when ../shared/data/dolly-alpaca-10clients is absent.
On 2 busy CPU cores: `--jobs 2 --threads 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from instruction_protocol import (  # benchmarks/ is the script's own directory, so first on sys.path
    COMMON,
    DATA,
    DEFAULT_BUDGET,
    FINAL,
    FINAL_SEEDS,
    GRIDS,
    ROOT,
    ROWS,
    RUNS,
    TUNE,
    VALIDATION,
    ZERO_SHOT,
    Point,
    budget_stop,
    chosen_points,
    final_rows,
    least_client_round_cost,
    make_config,
    per_client_round_cost,
    row_key,
)
from instruction_report import write_report
from ranking_protocol import check_charge
from rich.console import Console
from row_pool import record_rows, run_rows

from zofed.data.builtin import shared_data_dir
from zofed.run.checkpoint import find_checkpoint
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build


def zero_shot(evalset: tuple[int | None, int, int]) -> dict:
    config = make_config(ZERO_SHOT, 0, 0, evalset, RUNS / "unused")
    setup = build(config)
    t0 = time.perf_counter()
    test = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size)
    return {"row": ZERO_SHOT, "method": None, "test_rougeL": round(test["rougeL"], 4),
            "test_loss": round(test["loss"], 4), "test_examples": len(setup.test), "max_new_tokens": evalset[1],
            "final_eval_seconds": round(time.perf_counter() - t0, 1)}


def _run(row: str, seed: int, budget: float, evalset: tuple[int | None, int, int], point: Point,
         phase: str) -> tuple[FederatedConfig, dict, list[dict], float, Path]:
    """Run (or resume) one federated row; its config, results, metric records, wall seconds and directory."""
    out = RUNS / row_key(row, seed, budget, evalset, point, phase).replace("|", "_")
    config = make_config(row, seed, budget, evalset, out, point, phase)
    t0 = time.perf_counter()
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None,
                            show_progress=sys.stderr.isatty(), console=Console(stderr=True),
                            stop=budget_stop(row, budget))
    wall = time.perf_counter() - t0
    check_charge(row, results["forward_passes_per_client_round"], least_client_round_cost(row),
                 per_client_round_cost(row))
    return config, results, MetricsLog(out / "metrics.jsonl").read(), wall, out


def tune(row: str, seed: int, budget: float, point: Point) -> dict:
    """One grid point: the row at `point`, scored by the response loss on the validation split."""
    config, results, records, wall, out = _run(row, seed, budget, (None, 0, 0), point, TUNE)
    curve = [[r.get("forward_passes", 0.0), r["round"], r["eval_loss"]] for r in records
             if r["event"] in ("eval", "round") and "eval_loss" in r]  # [passes, round, validation-subset loss]
    return {"phase": TUNE, "row": row, "method": ROWS[row], "seed": seed, "lr": point[0],
            "server_factor": point[1], "budget": budget,
            "rounds": results["rounds"], "forward_passes": results["forward_passes"],
            "validation_loss": round(results["test"]["loss"], 5), "validation_examples": results["test_examples"],
            "curve": curve, "wall_seconds": round(wall, 1), "run_dir": str(out.relative_to(ROOT))}


def federate(row: str, seed: int, budget: float, evalset: tuple[int | None, int, int], point: Point) -> dict:
    """One federated row: the rounds (curve answers at most `curve` tokens long), then the final test at full
    length (a resumed run that had finished its rounds only tests again)."""
    tokens, curve_tokens = evalset[1:]
    config, results, records, wall, out = _run(row, seed, budget, evalset, point, FINAL)
    start = next(r for r in records if r["event"] == "eval" and r.get("round") == 0)
    rounds = [r for r in records if r["event"] == "round"]
    curve, uplink = [[0.0, 0.0, 0, start["eval_rougeL"], start["eval_loss"]]], 0.0
    for r in rounds:  # [passes, cumulative uplink bytes per client, round, subset rougeL, subset loss]
        uplink += r["bytes_up_per_client"]
        if "eval_rougeL" in r:
            curve.append([r["forward_passes"], uplink, r["round"], r["eval_rougeL"], r["eval_loss"]])
    curve_seconds = [r["eval_seconds"] for r in rounds if "eval_seconds" in r]
    return {"row": row, "method": ROWS[row], "seed": seed, "lr": point[0], "server_factor": point[1], "budget": budget,
            "rounds": results["rounds"], "forward_passes": results["forward_passes"],
            "forward_passes_per_client_round": results["forward_passes_per_client_round"],  # _run checked it
            "trainable_parameters": results["trainable_parameters"],
            "test_rougeL": round(results["test"]["rougeL"], 4), "test_loss": round(results["test"]["loss"], 4),
            "test_examples": results["test_examples"], "max_new_tokens": tokens, "curve_tokens": curve_tokens,
            "bytes_up_per_client_round": results["bytes_up_per_client_round"],
            "bytes_down_per_client_round": results["bytes_down_per_client_round"], "curve": curve,
            "seconds_per_round": round(float(np.mean([r["round_seconds"] for r in rounds])), 1),
            # model, data (tokenizing) and the round-0 evaluation; the rest of this sitting's wall time
            "setup_seconds": round(wall - results["seconds_this_sitting"] - results["test_seconds"], 1),
            "curve_eval_seconds": round(float(np.mean(curve_seconds)), 1) if curve_seconds else None,
            "final_eval_seconds": round(results["test_seconds"], 1), "run_dir": str(out.relative_to(ROOT))}


def _process(row: str, seed: int, budget: float, evalset: tuple[int | None, int, int], point: Point | None,
             phase: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    if phase == TUNE:
        result = tune(row, seed, budget, point)
    else:
        result = zero_shot(evalset) if ROWS[row] is None else federate(row, seed, budget, evalset, point)
    return {**result, "torch_threads": threads}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", choices=list(ROWS),
                        help="default: every row (tune); every row but zofed's levers (final)")
    parser.add_argument("--phase", choices=[TUNE, FINAL], default=FINAL,
                        help="tune: every row's grid on the validation split; final: the chosen points on the test set")
    parser.add_argument("--seeds", type=int, nargs="*", help="default: 0 1 2 (final), 0 (tune)")
    parser.add_argument("--points", type=int, nargs="*", help="tune only these points of each row's grid (1 to 4)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help="client compute, forward-pass equivalents summed over the federation")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--test-examples", type=int, help="cap on the final test (default: all 160; smoke runs)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length of the final test")
    parser.add_argument("--curve-tokens", type=int, default=64, help="answer length of the curves' evaluations")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="where the table and report go")
    parser.add_argument("--table-only", action="store_true", help="rewrite the report from the table, run nothing")
    args = parser.parse_args()
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.phase == TUNE else FINAL_SEEDS)
    path = args.out / "instruction.json"
    table = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    if args.table_only:
        write_report(table, args.out)
        return
    base = shared_data_dir()
    if base is None or not (base / DATA).is_dir():
        print(f"skipped: ../shared/data/{DATA} not found (set ZOFED_SHARED_DATA to a folder holding {DATA}/)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    table["meta"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                     "common": COMMON, "grids": GRIDS, "validation_examples": VALIDATION}
    evalset = (args.test_examples, args.max_new_tokens, args.curve_tokens)
    chosen = chosen_points(list(table["rows"].values()), args.budget)
    if args.rows is None:
        args.rows = list(ROWS) if args.phase == TUNE else final_rows()
        left = [row for row in ROWS if row not in args.rows]
        if left:
            print(f"finals skip {', '.join(left)}: zofed's levers, priced by their tuning runs (name one in --rows "
                  "to run it)", flush=True)
    untuned = [row for row in args.rows if args.phase == FINAL and ROWS[row] is not None and row not in chosen]
    if untuned:
        raise SystemExit(f"{', '.join(untuned)} never tuned at budget {args.budget:g}: run --phase tune first")
    pending, keys = [], set()
    for row in args.rows:
        if args.phase == TUNE and ROWS[row] is None:
            continue  # nothing to tune
        if args.phase == TUNE:
            points = [p for i, p in enumerate(GRIDS[row], 1) if args.points is None or i in args.points]
        else:
            points = [chosen.get(row)]  # None for zero-shot, which has no step to tune
        for seed in args.seeds:
            for point in points:
                key = row_key(row, seed, args.budget, evalset, point, args.phase)
                if key not in table["rows"] and key not in keys:  # one zero-shot row serves every seed
                    keys.add(key)
                    pending.append((row, seed, args.budget, evalset, point, args.phase))
    print(f"{len(pending)} runs to do, {args.jobs} at a time", flush=True)
    record_rows(run_rows(_process, pending, row_key, args.jobs, args.threads), table, path,
                lambda: write_report(table, args.out), "curve")


if __name__ == "__main__":
    main()
