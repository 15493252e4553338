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
  2 blocks only (`trainable.lora_layers`), runs the frozen bottom once a step (`zo.prefix_cache`) and averages 4
  queries a step over the top blocks (ROW_OPTIONS).
- Federation: 3 of the 9 clients a round, 4 local steps of batch 4.
- Budget (`--budget`): client compute in forward-pass equivalents of the full model (a backward counts as two
  forwards), summed over the federation, the same for every row; each method counts its own cost, so a row's
  rounds = budget // (3 clients x its per-client round cost): 8 passes for a ZO method (4 steps x 2 passes), 12
  for FedAvg (4 steps x a forward and a backward). The run's own count is checked against the plan.
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
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from curve_plot import draw_seed_band, label_and_save
from ranking_protocol import METHOD_OPTIONS  # benchmarks/ is the script's own directory, so first on sys.path
from rich.console import Console
from row_pool import record_rows, run_rows

from zofed.data.builtin import shared_data_dir
from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan
from zofed.run.checkpoint import find_checkpoint, write_atomic_text
from zofed.run.config import load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build, build_model, prefix_cache

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench" / "instruction"
DATA = "dolly-alpaca-10clients"
PER_ROUND, LOCAL_STEPS, BATCH, MAX_LENGTH, CURVE_EXAMPLES, TEST_SIZE = 3, 4, 4, 256, 40, 160
CLIENTS = 9  # the natural split: one client per training file
ZERO_SHOT = "zero-shot"
# row -> federation.method (None: no training)
ROWS: dict[str, str | None] = {ZERO_SHOT: None, "zofed": "zofed", "zo-seeds": "zo-seeds", "fedkseed": "fedkseed",
                               "decomfl": "decomfl", "fedavg-lora": "fedavg", "zofed-top2-cached": "zofed"}
# zofed's engine lever (the learning-speed issue's prefix caching) on this task: LoRA on the top 2 of the 30 blocks
# only, so each step runs the frozen bottom once and then only the top blocks and the vocabulary projection (0.26 of
# a full pass, the projection being most of it) for each of 4 one-sided queries: 2.05 passes a step against 2 for one
# query on every block, so the same rounds as the zofed row, each step's direction averaged over 4 perturbations of
# 1/15 of the adapters
TOP_BLOCKS, TOP_QUERIES = 2, 4
ROW_OPTIONS: dict[str, list[str]] = {
    "zofed-top2-cached": [f"trainable.lora_layers={list(range(-TOP_BLOCKS, 0))}", "zo.prefix_cache=true",
                          f"zo.queries={TOP_QUERIES}"]}
# The (client lr, server lr factor) points each row is tuned on: four along the lever that sets its step. The client
# lr is optimizer.lr for the ZO rows (MeZO steps on LoRA), federation.first_order_lr for FedAvg (AdamW); the factor
# multiplies the method's default server lr. The plain-averaging rows step by their client lr. zofed's server
# normalizes the round's update (adam, relative steps), so its step is set by the server lr alone: at client lr 1e-3
# and 1e-2 under the default server lr its validation subset's loss moved by 6e-5 and 5e-5 over the run. FedKSeed
# at client lr 1e-2 ended at a validation loss of 21.3 (2.35 at the start): the plain rows' grid tops out there.
# Every ZO row's loss went from barely moving (-0.003) to diverging within the decade between its second and fourth
# points, so each grid has a half-decade point there (the third), FedAvg's too, for the same grid everywhere.
Point = tuple[float, float]
CLIENT_LR_GRID = [(1e-4, 1.0), (1e-3, 1.0), (3e-3, 1.0), (1e-2, 1.0)]  # the plain ZO rows' MeZO lr, FedAvg's AdamW lr
SERVER_LR_GRID = [(1e-2, 1.0), (1e-2, 10.0), (1e-2, 30.0), (1e-2, 100.0)]  # zofed's: its adam server sets the step
GRIDS: dict[str, list[Point]] = {"zofed": SERVER_LR_GRID, "zo-seeds": CLIENT_LR_GRID,
                                 "fedkseed": CLIENT_LR_GRID, "decomfl": CLIENT_LR_GRID,
                                 "fedavg-lora": CLIENT_LR_GRID, "zofed-top2-cached": SERVER_LR_GRID}
VALIDATION = 100  # training records held out to tune on (data.validation_examples): 200 took 6 min to score
TUNE, FINAL = "tune", "final"
COMMON = ["model.name=smollm2-135m", "data.source=shared:dolly", "task.type=causal-lm", f"task.max_length={MAX_LENGTH}",
          f"task.generate_eval={TEST_SIZE}", "trainable.mode=lora", f"train.batch_size={BATCH}",
          "train.eval_batch_size=16", f"data.eval_examples={CURVE_EXAMPLES}", "federation.partition.scheme=natural",
          "federation.partition.column=client", "federation.partition.test_fraction=0",
          f"federation.clients_per_round={PER_ROUND}", f"federation.local_steps={LOCAL_STEPS}", "optimizer.name=mezo",
          "zo.eps=1e-3"]
# 15 ZO rounds, 10 FedAvg rounds: the 6 rows x 3 seeds in about 4 hours on 2 cores that other jobs share
# (`--jobs 2 --threads 1`; a ZO round took ~95 s there, a FedAvg round ~100 s; a final test, 160 answers of up
# to 128 tokens, ~4 min as docs/federated.md measured)
DEFAULT_BUDGET = 360


def per_client_round_cost(row: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row, as its method counts them."""
    method = ROWS[row]
    if method is None:
        return 0.0
    config = load_config(None, [*COMMON, *METHOD_OPTIONS.get(method, []), *ROW_OPTIONS.get(row, []),
                                f"federation.method={method}"], schema=FederatedConfig)
    plan = FederationPlan.from_config(config, CLIENTS, pass_fraction(row) if config.zo.prefix_cache else 1.0)
    return get_method(method).forward_passes(plan.round(0))


@functools.cache
def pass_fraction(row: str) -> float:
    """The share of a full forward pass one perturbed pass of a prefix-cached row runs, read off the model it
    trains (its blocks above the split and the vocabulary projection, against all of them)."""
    config = load_config(None, [*COMMON, *ROW_OPTIONS[row], f"federation.method={ROWS[row]}"],
                         schema=FederatedConfig)
    model, trainable, task = build_model(config, None, torch.device("cpu"))
    return prefix_cache(config, model, trainable, task).fraction


def rounds_for(row: str, budget: float) -> int:
    return max(1, int(budget // (PER_ROUND * per_client_round_cost(row))))


def _point_key(point: Point) -> str:
    lr, factor = point
    return f"{lr:g}" if factor == 1.0 else f"{lr:g}|x{factor:g}"


def row_key(row: str, seed: int, budget: float, evalset: tuple[int | None, int, int], point: Point | None = None,
            phase: str = FINAL) -> str:
    """A row's key in the table (and its run directory): what makes its numbers, the tuned point included."""
    if phase == TUNE:
        return f"{TUNE}|{row}|{seed}|{_point_key(point)}|{budget:g}|val{VALIDATION}"
    test, tokens, curve = evalset
    scored = f"test{test or TEST_SIZE}|new{tokens}"
    if ROWS[row] is None:
        return f"{row}|{scored}"  # no seed, lr or budget changes the starting model's answers
    return f"{row}|{seed}|{_point_key(point)}|{budget:g}|{scored}|curve{curve}"


def make_config(row: str, seed: int, budget: float, evalset: tuple[int | None, int, int], out: Path,
                point: Point | None = None, phase: str = FINAL) -> FederatedConfig:
    test, tokens, curve = evalset
    method = ROWS[row]
    overrides = [*COMMON, f"train.seed={seed}", f"out_dir={out}", *([f"data.test_examples={test}"] if test else [])]
    if method is None:  # the zero-shot row only evaluates: one training record spares tokenizing 20,000
        return load_config(None, [*overrides, f"task.max_new_tokens={tokens}", "data.train_examples=1"],
                           schema=FederatedConfig)
    if phase == TUNE:  # the loss on held-out training records, every evaluation: no generation, no test data
        overrides += [f"data.validation_examples={VALIDATION}", "data.evaluate_on=validation",
                      "task.generate_eval=0"]
    else:
        overrides += [f"task.max_new_tokens={tokens}", f"task.curve_max_new_tokens={curve}"]
    rounds = rounds_for(row, budget)
    lr, factor = point
    server = get_method(method).server_default
    lr_key = "federation.first_order_lr" if get_method(method).first_order else "optimizer.lr"
    every = rounds if phase == TUNE else max(1, rounds // 5)  # a tune run is judged at its end alone
    return load_config(None, [*overrides, *METHOD_OPTIONS.get(method, []), *ROW_OPTIONS.get(row, []),
                              f"federation.method={method}",
                              f"{lr_key}={lr}", f"federation.server_optimizer.name={server.name}",
                              f"federation.server_optimizer.lr={server.lr * factor}", f"federation.rounds={rounds}",
                              f"federation.eval_every={every}"],
                       schema=FederatedConfig)


def point_of(row: dict) -> Point:
    return row["lr"], row.get("server_factor", 1.0)


def tune_runs(rows: list[dict], budget: float) -> dict[str, dict[Point, list[dict]]]:
    """The tune phase's runs at `budget`: row -> point -> its runs (one per seed)."""
    grid: dict[str, dict[Point, list[dict]]] = {}
    for r in rows:
        if r.get("phase") == TUNE and r["budget"] == budget:
            grid.setdefault(r["row"], {}).setdefault(point_of(r), []).append(r)
    return grid


def chosen_points(rows: list[dict], budget: float) -> dict[str, Point]:
    """Each tuned row's point with the lowest mean validation loss (over its seeds) at `budget`."""
    return {row: min(by_point, key=lambda p: float(np.mean([r["validation_loss"] for r in by_point[p]])))
            for row, by_point in tune_runs(rows, budget).items()}


def zofed_variant(rows: list[dict], budget: float) -> str:
    """The zofed row the targets judge: of zofed's tuned variants, the one whose chosen point has the lowest
    validation loss (the test set never picks it); plain zofed before any is tuned."""
    tuned = tune_runs(rows, budget)
    best = {row: float(np.mean([r["validation_loss"] for r in tuned[row][point]]))
            for row, point in chosen_points(rows, budget).items() if ROWS[row] == "zofed"}
    return min(best, key=best.get) if best else "zofed"


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
                            show_progress=sys.stderr.isatty(), console=Console(stderr=True))
    wall = time.perf_counter() - t0
    expected = per_client_round_cost(row)
    if abs(results["forward_passes_per_client_round"] - expected) > 1e-9:  # the row's cost model must be the run's
        raise RuntimeError(f"{row}: the run counted {results['forward_passes_per_client_round']} passes a client "
                           f"round, the benchmark planned {expected}")
    return config, results, MetricsLog(out / "metrics.jsonl").read(), wall, out


def tune(row: str, seed: int, budget: float, point: Point) -> dict:
    """One grid point: the row at `point`, scored by the response loss on the validation split."""
    config, results, records, wall, out = _run(row, seed, budget, (None, 0, 0), point, TUNE)
    curve = [[r.get("forward_passes", 0.0), r["round"], r["eval_loss"]] for r in records
             if r["event"] in ("eval", "round") and "eval_loss" in r]  # [passes, round, validation-subset loss]
    return {"phase": TUNE, "row": row, "method": ROWS[row], "seed": seed, "lr": point[0],
            "server_factor": point[1], "budget": budget,
            "rounds": config.federation.rounds, "forward_passes": results["forward_passes"],
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
            "rounds": config.federation.rounds, "forward_passes": results["forward_passes"],
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


# --- the report, from the rows ------------------------------------------------------------------------------------


def points(values) -> np.ndarray:
    return np.asarray(values, dtype=float) * 100


def mean_std(values) -> tuple[float, float]:
    v = points(values)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def settings(rows: list[dict]) -> dict[tuple, dict]:
    """The rows one table compares, by (budget, test examples, final tokens, curve tokens): each row's finals at
    the point its tuning chose at that budget, and the zero-shot row scored the same way."""
    groups: dict[tuple, dict] = {}
    chosen = {budget: chosen_points(rows, budget) for budget in {r["budget"] for r in rows if r.get("phase") == TUNE}}
    for r in rows:
        if (r.get("phase") != TUNE and r["row"] != ZERO_SHOT
                and point_of(r) == chosen.get(r["budget"], {}).get(r["row"])):
            key = (r["budget"], r["test_examples"], r["max_new_tokens"], r["curve_tokens"])
            groups.setdefault(key, {}).setdefault(r["row"], []).append(r)
    for (_, test, tokens, _), group in groups.items():
        group[ZERO_SHOT] = [r for r in rows if r["row"] == ZERO_SHOT and (r["test_examples"], r["max_new_tokens"])
                            == (test, tokens)]
    return {k: {name: g[name] for name in ROWS if g.get(name)} for k, g in sorted(groups.items())}


def target_lines(by_row: dict[str, list[dict]], zofed: str = "zofed") -> list[str]:
    """The issue's two targets, checked from the rows (means over seeds, ROUGE-L points); `zofed` names the zofed
    variant judged (`zofed_variant`)."""
    means = {name: mean_std([r["test_rougeL"] for r in rs])[0] for name, rs in by_row.items()}
    federated = [n for n in by_row if n != ZERO_SHOT]
    lines = ["Targets:", ""]
    if ZERO_SHOT in means and federated:
        below = [n for n in federated if means[n] < means[ZERO_SHOT]]
        verdict = "met" if not below else f"missed by {', '.join(below)}"
        lines.append(f"- Every federated row at or above zero-shot ({means[ZERO_SHOT]:.2f}): {verdict}. "
                     + "; ".join(f"{n} {means[n] - means[ZERO_SHOT]:+.2f}" for n in federated) + ".")
    else:
        lines.append("- Every federated row at or above zero-shot: not checked yet (needs the zero-shot row and a "
                     "federated one).")
    if zofed in means and "fedkseed" in means:
        gap = means[zofed] - means["fedkseed"]
        verdict = f"met, {gap - 1:.2f} points above the bar" if gap >= 1 else f"missed by {1 - gap:.2f} points"
        line = (f"- zofed at least FedKSeed + 1 point at equal client compute: {zofed} {means[zofed]:.2f}, FedKSeed "
                f"{means['fedkseed']:.2f}, difference {gap:+.2f}: {verdict}")
        mine = {r["seed"]: r["test_rougeL"] for r in by_row[zofed]}
        theirs = {r["seed"]: r["test_rougeL"] for r in by_row["fedkseed"]}
        seeds = sorted(mine.keys() & theirs.keys())
        if len(seeds) >= 2:
            diff = points([mine[s] - theirs[s] for s in seeds])
            line += (f"; paired over seeds {seeds}: {diff.mean():+.2f} (standard error "
                     f"{diff.std(ddof=1) / np.sqrt(len(diff)):.2f})")
        passes = {by_row[n][0]["forward_passes"] for n in (zofed, "fedkseed")}
        lines.append(line + (f"; both spent {passes.pop():,.0f} forward passes." if len(passes) == 1 else
                             "; the two spent different compute (see the table)."))
    else:
        lines.append(f"- zofed at least FedKSeed + 1 point: not checked yet (needs the rows of {zofed}, zofed's "
                     "variant with the lowest validation loss, and of FedKSeed).")
    return lines


def plot_curves(by_row: dict[str, list[dict]], title: str, path: Path) -> None:
    """Subset ROUGE-L against client compute, cumulative uplink bytes per client and rounds: per row the mean over
    its seeds, the seeds' range as a band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for name, rs in by_row.items():
        if name == ZERO_SHOT:
            continue
        curves = np.array([r["curve"] for r in rs if len(r["curve"]) == len(rs[0]["curve"])], dtype=float)
        draw_seed_band(axes, name, curves, curves[:, :, 3] * 100)
    axes[1].set_xscale("symlog", linthresh=10)  # seeds and scalars (tens of bytes) against dense LoRA updates (MB)
    label_and_save(fig, axes, "ROUGE-L (test subset, points)", title, path, ", symlog")


def _point_label(point: Point) -> str:
    lr, factor = point
    return f"lr {lr:g}" + ("" if factor == 1.0 else f", server x{factor:g}")


def tuning_lines(rows: list[dict]) -> list[str]:
    """Per budget, each row's validation loss at every point of its grid, the chosen one in bold."""
    lines = []
    width = max(len(g) for g in GRIDS.values())
    for budget in sorted({r["budget"] for r in rows if r.get("phase") == TUNE}):
        grid, chosen = tune_runs(rows, budget), chosen_points(rows, budget)
        lines += [f"Tuning at budget {budget:,.0f}: the response loss on {VALIDATION} validation records held out of "
                  "the training data at the end of the run (seed 0; the lowest is chosen, in bold). The ZO rows' lr "
                  "is `optimizer.lr` (MeZO steps), FedAvg's `federation.first_order_lr` (AdamW); server xF multiplies "
                  "the method's default server lr.", "",
                  "| row | " + " | ".join(f"point {i + 1}" for i in range(width)) + " |", "|" + "---|" * (width + 1)]
        for name in ROWS:
            if name not in GRIDS or name not in grid:
                continue
            cells = []
            for point in GRIDS[name]:
                runs = grid[name].get(point)
                value = "not run" if not runs else f"{np.mean([r['validation_loss'] for r in runs]):.4f}"
                cells.append(f"**{_point_label(point)}: {value}**" if point == chosen[name]
                             else f"{_point_label(point)}: {value}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        untuned = [name for name in GRIDS if name not in grid]
        if untuned:
            lines += ["", f"Not tuned yet: {', '.join(untuned)}."]
        lines += ["", *descent_lines(grid, chosen, budget), ""]
    return lines or ["No row has been tuned yet (`--phase tune`): finals are shown only at a tuned point.", ""]


def descent_lines(grid: dict[str, dict[Point, list[dict]]], chosen: dict[str, Point], budget: float) -> list[str]:
    """How far each row's chosen point moved the validation loss (the tune run's evaluation subset, its first point
    against its last), the ZO rows' best against FedAvg's, and the ZO grid points above the chosen one that ended
    above their start (a step too long): what a larger budget, or a finer grid, would have to change."""
    def drop(run: dict) -> float:
        return run["curve"][-1][2] - run["curve"][0][2]

    moved = {name: float(np.mean([drop(r) for r in grid[name][point]])) for name, point in chosen.items()
             if all(len(r.get("curve", [])) >= 2 for r in grid[name][point])}
    if not moved:
        return []
    lines = ["How far each chosen point moved the validation loss (its evaluation subset, start → end of the run): "
             + "; ".join(f"{name} {value:+.4f}" for name, value in moved.items()) + "."]
    zo = {name: value for name, value in moved.items() if not get_method(ROWS[name]).first_order}
    if zo and "fedavg-lora" in moved and min(zo.values()) < 0 < -moved["fedavg-lora"]:
        best = min(zo, key=zo.get)
        ratio = moved["fedavg-lora"] / zo[best]
        lines[0] += (f" The ZO rows' largest drop ({best}) is {ratio:.0f} times smaller than FedAvg-LoRA's at the "
                     f"same compute: at that rate a ZO row would need about {ratio * budget:,.0f} passes to move the "
                     "loss as far as FedAvg-LoRA did in "
                     f"{budget:,.0f} (a linear extrapolation, not a measurement).")
    overshoot = []
    for name, point in chosen.items():
        if name not in zo:
            continue
        above = [p for p in GRIDS[name] if p[0] * p[1] > point[0] * point[1] and p in grid[name]]
        starts = {p: float(np.mean([r["curve"][0][2] for r in grid[name][p]])) for p in above}
        ends = {p: float(np.mean([r["curve"][-1][2] for r in grid[name][p]])) for p in above}
        overshoot += [f"{name} at {_point_label(p)} ({starts[p]:.3f} → {ends[p]:.2f})" for p in above
                      if ends[p] > starts[p]]
    if overshoot:
        lines[0] += (" Grid points above the chosen one that ended above their start, a step too long: "
                     + ", ".join(overshoot) + ". Between the chosen point and the first of these the loss goes from "
                     "barely moving to diverging.")
    return lines


def write_report(table: dict, out: Path) -> None:
    rows = list(table["rows"].values())
    lines = ["# Instruction tuning at equal client compute: SmolLM2-135M-Instruct on federated Dolly/Alpaca", "",
             "Protocol: `data.source=shared:dolly`, one client per training file (9 clients, natural partition by "
             f"`client`, all records used for training), {PER_ROUND} clients a round, {LOCAL_STEPS} local steps of "
             f"batch {BATCH}, `task.max_length` {MAX_LENGTH}, SmolLM2's chat template. Every row trains LoRA r 8 on "
             "q_proj and v_proj of every block (the ZO rows too: one trainable set for all), but zofed-top2-cached: "
             f"zofed with the same adapters on the top {TOP_BLOCKS} blocks only, the frozen bottom run once a step "
             f"(`zo.prefix_cache`) and {TOP_QUERIES} one-sided queries a step over the top blocks and the vocabulary "
             f"projection ({pass_fraction('zofed-top2-cached'):.3f} of a full pass each) "
             f"({PER_ROUND * per_client_round_cost('zofed-top2-cached'):.1f} passes a round). The same client "
             "compute for every "
             "row: a budget in forward-pass equivalents of the full model summed over the federation (a backward "
             "counts as two forwards), so a ZO round costs "
             f"{PER_ROUND * per_client_round_cost('zofed'):g} passes and a FedAvg round "
             f"{PER_ROUND * per_client_round_cost('fedavg-lora'):g}, and each row runs budget // its round cost "
             "rounds. ROUGE-L F1 (rouge-score, stemmed) of greedy answers, in points; the final test on the "
             f"{TEST_SIZE}-example global test set, the curves on a fixed {CURVE_EXAMPLES}-example subset of it "
             "(drawn per seed) with shorter answers (the curve tokens below). zero-shot is the starting model (LoRA's "
             "B is zero) on the whole test set, evaluated once: no seed changes it; each run's round-0 point is its "
             "value on the seed's subset. Standard deviations over seeds use n - 1. Server optimizers are each "
             "method's default. Reproduce: `.venv/bin/python benchmarks/instruction.py --phase tune --jobs 2 "
             "--threads 1`, then the same without `--phase`.", "",
             *[f"Zero-shot, the starting model: ROUGE-L {100 * r['test_rougeL']:.2f}, test loss "
               f"{r['test_loss']:.3f} on {r['test_examples']} examples, answers up to {r['max_new_tokens']} tokens, "
               f"scored in {r['final_eval_seconds']:.0f} s." for r in rows if r["row"] == ZERO_SHOT], "",
             *tuning_lines(rows)]
    groups = settings(rows)
    finals = [r for r in rows if r.get("phase") != TUNE]
    shown = sum(len(rs) for g in groups.values() for rs in g.values())
    if shown < len(finals):
        lines += [f"{len(finals) - shown} final rows of the table (at an lr their tuning did not choose, or with no "
                  "federated row scored the same way) are not shown.", ""]
    for (budget, test, tokens, curve_tokens), by_row in groups.items():
        lines += [f"## Budget {budget:,.0f} forward passes; test {test} examples, answers up to {tokens} tokens "
                  f"(curves: {curve_tokens})", "",
                  "| row | seeds | test ROUGE-L (mean ± std) | test loss | subset ROUGE-L round 0 → end | subset loss "
                  "round 0 → end | rounds | forward passes | uplink bytes / client / round | s / round (train) |",
                  "|" + "---|" * 10]
        for name, rs in by_row.items():
            score, spread = mean_std([r["test_rougeL"] for r in rs])
            loss = np.mean([r["test_loss"] for r in rs])
            if name == ZERO_SHOT:
                lines.append(f"| {name} | - | {score:.2f} | {loss:.3f} | - | - | 0 | 0 | 0 | - |")
                continue
            start, end = (float(np.mean(points([r["curve"][i][3] for r in rs]))) for i in (0, -1))
            loss_start, loss_end = (float(np.mean([r["curve"][i][4] for r in rs])) for i in (0, -1))
            lines.append(f"| {name} | {len(rs)} | {score:.2f} ± {spread:.2f} | {loss:.3f} | {start:.2f} → {end:.2f} "
                         f"| {loss_start:.3f} → {loss_end:.3f} "
                         f"| {rs[0]['rounds']} | {rs[0]['forward_passes']:,.0f} "
                         f"| {rs[0]['bytes_up_per_client_round']:,.0f} "
                         f"| {np.mean([r['seconds_per_round'] for r in rs]):.0f} |")
        name = f"instruction_b{budget:g}" + ("" if (test, tokens, curve_tokens) == (TEST_SIZE, 128, 64)
                                             else f"_t{test}_n{tokens}_c{curve_tokens}") + ".png"
        plot_curves(by_row, f"Dolly/Alpaca, 9 clients, budget {budget:,.0f} passes (test subset of "
                    f"{min(CURVE_EXAMPLES, test)}, answers up to {curve_tokens} tokens)", out / name)
        runs = [r for name, rs in by_row.items() if name != ZERO_SHOT for r in rs]
        curve_seconds = [r["curve_eval_seconds"] for r in runs if r["curve_eval_seconds"] is not None]
        lines += ["", f"Seconds, means over the runs ({table['meta'].get('machine', '?')}, torch threads "
                  f"{sorted({r['torch_threads'] for r in runs})}): setup with the round-0 evaluation "
                  f"{np.mean([r['setup_seconds'] for r in runs]):.0f}, a curve evaluation "
                  f"{np.mean(curve_seconds) if curve_seconds else float('nan'):.0f}, the final test "
                  f"{np.mean([r['final_eval_seconds'] for r in runs]):.0f}.", "",
                  *target_lines(by_row, zofed_variant(rows, budget)), "", f"![ROUGE-L curves]({name})", ""]
    write_atomic_text(out / "instruction.md", "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
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
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.phase == TUNE else [0, 1, 2])
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
