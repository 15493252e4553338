"""The instruction-tuning benchmark's protocol: its rows, their grids and shared settings, each row's cost in
forward passes, the configs its runs use, the keys its table stores them under, and the tuning's choice of each
row's point. benchmarks/instruction.py runs it; benchmarks/instruction_report.py writes its report."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from ranking_protocol import (  # benchmarks/ is the script's own directory, so first on sys.path
    METHOD_OPTIONS,
    stop_at_budget,
)

from zofed.fl.methods import get_method
from zofed.run.config import load_config
from zofed.run.federated_config import FederatedConfig, federation_plan
from zofed.run.setup import build_model, prefix_cache
from zofed.zo.prefix import tensor_pass_shares

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench" / "instruction"
DATA = "dolly-alpaca-10clients"
PER_ROUND, LOCAL_STEPS, BATCH, MAX_LENGTH, CURVE_EXAMPLES, TEST_SIZE = 3, 4, 4, 256, 40, 160
CLIENTS = 9  # the natural split: one client per training file
ZERO_SHOT = "zero-shot"
# row -> federation.method (None: no training)
ROWS: dict[str, str | None] = {ZERO_SHOT: None, "zofed": "zofed", "zo-seeds": "zo-seeds", "fedkseed": "fedkseed",
                               "decomfl": "decomfl", "fedavg-lora": "fedavg", "zofed-top2-cached": "zofed",
                               "zofed-start": "zofed"}
# zofed's engine lever (the learning-speed issue's prefix caching) on this task: LoRA on the top 2 of the 30 blocks
# only, so each step runs the frozen bottom once and then only the top blocks and the vocabulary projection (0.26 of
# a full pass, the projection being most of it) for each of 4 one-sided queries: 2.05 passes a step against 2 for one
# query on every block, so the same rounds as the zofed row, each step's direction averaged over 4 perturbations of
# 1/15 of the adapters
TOP_BLOCKS, TOP_QUERIES = 2, 4
# zofed-start: zofed whose relative server step is measured against each tensor's RMS at the start of the run, not
# its RMS now. Against the current RMS the floor a zero-started B is measured against collapsed in zofed's finals:
# 4 to 6 of the 60 B tensors ever passed an RMS of 1e-3, while the B that moved first stepped by its own RMS and
# reached 0.82 (seed 0) and 0.58 (seed 2) against A's 0.024 (docs/method.md, `zofed replay --trace`).
ROW_OPTIONS: dict[str, list[str]] = {
    "zofed-top2-cached": [f"trainable.lora_layers={list(range(-TOP_BLOCKS, 0))}", "zo.cache=prefix",
                          "federation.cached_examples=0", f"zo.queries={TOP_QUERIES}"],  # the bottom once a step
    "zofed-start": ["federation.server_optimizer.relative_to=start"]}
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
# zofed's: its adam server sets the step. Since the relative step's floor is fixed at the start (182be93) every
# LoRA B steps at its A's scale: rerun, zofed diverged at x10 (validation loss 12.17) while its curve subset's loss
# stayed flat at x1 (2.404 -> 2.403), so the grid first run, x1 to x100, is shifted down two points: x10 bounds it
# above, x0.1 and x0.3 below
SERVER_LR_GRID = [(1e-2, 0.1), (1e-2, 0.3), (1e-2, 1.0), (1e-2, 10.0)]
# zofed-start moves every B its draws reach, not the 4 to 6 plain zofed moved: on the server grid x30 diverged
# (validation loss 13.99) and its best point was the lowest, x1 (2.3510 against 2.3537 at x10), so its grid is the
# same four points shifted down one: x0.3 brackets the best point, and x100 was not run past a diverged x30
START_GRID = [(1e-2, 0.3), (1e-2, 1.0), (1e-2, 10.0), (1e-2, 30.0)]
GRIDS: dict[str, list[Point]] = {"zofed": SERVER_LR_GRID, "zo-seeds": CLIENT_LR_GRID,
                                 "fedkseed": CLIENT_LR_GRID, "decomfl": CLIENT_LR_GRID,
                                 "fedavg-lora": CLIENT_LR_GRID, "zofed-top2-cached": SERVER_LR_GRID,
                                 "zofed-start": START_GRID}
VALIDATION = 100  # training records held out to tune on (data.validation_examples): 200 took 6 min to score
TUNE, FINAL = "tune", "final"
FINAL_SEEDS = [0, 1, 2]  # the finals' seeds (tuning runs seed 0 alone)
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


@functools.cache
def _costs(row: str) -> tuple[float, float]:
    """The most and the least a client's round of this row costs, as its method counts them (equal unless its
    steps are charged by the tensors they drew: zofed's with a cached prefix)."""
    method = ROWS[row]
    if method is None:
        return 0.0, 0.0
    config = load_config(None, [*COMMON, *METHOD_OPTIONS.get(method, []), *ROW_OPTIONS.get(row, []),
                                f"federation.method={method}"], schema=FederatedConfig)
    fraction, shares = _split(row)
    plan = federation_plan(config, CLIENTS, fraction if config.zo.cache != "none" else 1.0, tensor_shares=shares)
    runs = get_method(plan.method)
    local = runs.round_plan(plan.round(0), plan.sampling)
    return runs.forward_passes(local), runs.least_passes(local, plan.tensor_shares)


def per_client_round_cost(row: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row, as its method counts them: the most, for
    a row charged by its draws (`least_client_round_cost`)."""
    return _costs(row)[0]


def least_client_round_cost(row: str) -> float:
    return _costs(row)[1]


@functools.cache
def _split(row: str) -> tuple[float, tuple[float, ...]]:
    """The share of a full forward pass one perturbed pass of a row runs, read off the model it trains (its blocks
    above the split and the vocabulary projection, against all of them; 1 where its zo.cache caches nothing: auto
    on LoRA in every block), and each trainable tensor's share from its block up (`tensor_pass_shares`)."""
    config = load_config(None, [*COMMON, *ROW_OPTIONS.get(row, []), f"federation.method={ROWS[row]}"],
                         schema=FederatedConfig)
    model, trainable, task = build_model(config, None, torch.device("cpu"))
    cache = prefix_cache(config, model, trainable, task)
    return (1.0 if cache is None else cache.fraction), tensor_pass_shares(model, trainable.names, output_layer=True)


def pass_fraction(row: str) -> float:
    return _split(row)[0]


def rounds_for(row: str, budget: float) -> int:
    """The rounds `budget` buys the row: all of them where every round costs the same, else the most a run
    could take before its budget stop (`budget_stop`)."""
    return max(1, int(budget // (PER_ROUND * least_client_round_cost(row))))


def budget_stop(row: str, budget: float) -> Callable[[dict], bool]:
    """Ends a run after the round past which another could spend more than `budget`."""
    return stop_at_budget(budget, PER_ROUND * per_client_round_cost(row))


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


# zofed's lever rows: zofed with one setting changed, tuned to price the lever; never the row the targets judge,
# which is zofed as `zofed run` ships it ("zofed"). A lever that wins on validation becomes zofed's default in its
# own commit, and the table is rerun (`winning_levers` says when one has).
LEVERS = ("zofed-top2-cached", "zofed-start")


def winning_levers(rows: list[dict], budget: float) -> dict[str, tuple[float, float]]:
    """The lever rows whose chosen point beat zofed's on the validation loss: row -> (its loss, zofed's)."""
    tuned, chosen = tune_runs(rows, budget), chosen_points(rows, budget)
    loss = {row: float(np.mean([r["validation_loss"] for r in tuned[row][point]])) for row, point in chosen.items()}
    if "zofed" not in loss:
        return {}
    return {row: (loss[row], loss["zofed"]) for row in LEVERS if row in loss and loss[row] < loss["zofed"]}


def final_rows() -> list[str]:
    """The rows whose finals the protocol runs: every row but zofed's levers, which their tuning runs price
    (`--rows` can still name one)."""
    return [row for row in ROWS if row not in LEVERS]
