"""The ranking benchmark's protocol (benchmarks/ranking.py): the federation, the trainable sets, the rows and
what each costs, the tuning grid, and each row's chosen grid point."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zofed.fl.methods import ServerDefault, get_method
from zofed.run.config import load_config
from zofed.run.federated_config import FederatedConfig, federation_plan

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
    "zofed": ("zofed", True),  # zofed's defaults (one-sided queries, as it has 4 a step) with the engine lever
    "zofed-central": ("zofed", True),  # central two-point queries (zofed's default until forward won)
    "zofed-q8": ("zofed", True),  # 8 one-sided queries a step: less noise per step, fewer steps for the budget
    "zofed-q48": ("zofed", True),  # 48 a step: on the head a step still costs one pass, and 4 steps fit in 1 KB
    "zofed-uncached": ("zofed", False),  # the method alone, at the baselines' one query a step
    "zofed-shared": ("zofed", True),  # the round's clients share step seeds (ROW_OPTIONS): the server's cheap case
    "zofed-zo-adam": ("zofed", True),  # local ZO-Adam on the clients, replayed exactly by the server
    "zofed-tensor": ("zofed", True),  # one server second moment per tensor (zofed's default until global won)
    "zofed-uncached-tensor": ("zofed", False),
    "zofed-cosine-tensor": ("zofed", True),  # the server lr falls along a cosine to zero over the run
    "zofed-cosine": ("zofed", True),  # zofed's defaults with that cosine (its late rounds drifted down at constant lr)
    "zofed-avg": ("zofed", True),  # zofed's defaults, releasing the mean of the second half's server iterates
    "zofed-beta1-0.5": ("zofed", True),  # a server momentum that forgets in 2 rounds, not 10
    "zofed-beta1-ramp": ("zofed", True),  # server beta1 rising from 0.5 to 0.9 over the run
    "zofed-features": ("zofed", True),  # noise scaled by 1 / RMS of each coordinate's input feature
    "zofed-shaped": ("zofed", True),  # zofed's defaults (one-sided queries) with that feature-shaped noise
    "zofed-adjusted": ("zofed", True),  # zofed's defaults, each client's loss logit-adjusted by its own label prior
    "zofed-q48-adjusted": ("zofed", True),  # both head levers: 48 queries a step and the logit adjustment
    # the label head on cached features: 16 examples through the model a client round (2 passes), then 24 steps of 8
    # queries on them (192 scalars, under 1 KB), logit-adjusted; twice the rounds of zofed-q48 and 6x the steps
    "zofed-features-cached": ("zofed", True),
    # and each coordinate's noise scaled by 1 / RMS of the hidden feature it reads (zo.precondition=features)
    "zofed-shaped-features-cached": ("zofed", True),
    # zofed-features-cached with one tensor per class's row (trainable.label_head_per_class): zofed's block
    # sampling, a single block on the one-tensor head, then chooses each step's class row from the client's own pi
    "zofed-perclass-features-cached": ("zofed", True),
    # the demo's first head settings: 8 examples a client round (one pass), 12 steps of 8 queries
    # on them, plain averaging on the server and the mean of the second half's iterates released; twice the rounds
    "zofed-averaged-cached": ("zofed", True),
    # and each coordinate's noise scaled by 1 / RMS of the hidden feature it reads (zo.precondition=features): on
    # the head, zofed's block sampling has one block, so this is where its noise can differ from plain MeZO's
    "zofed-shaped-averaged-cached": ("zofed", True),
    # and central two-point queries: on the head a perturbed pass runs only the output rows, so the one-sided
    # estimate zofed takes with several queries saves no pass there
    "zofed-central-averaged-cached": ("zofed", True),
    # and one tensor per class's row, as zofed-perclass-features-cached
    "zofed-perclass-averaged-cached": ("zofed", True),
    # with 24 local steps a round instead of 12 (a step on cached features costs no pass): zofed's head recipe
    # (run/recipes.py), what `zofed run` and the demo run now
    "zofed-averaged-steps24-cached": ("zofed", True),
    "zofed-averaged-steps48-cached": ("zofed", True),  # and 48
    # zofed-features-cached's 192 scalars spent on more steps of fewer queries: on cached features a step costs no
    # pass, so the uplink, not compute, caps steps x queries
    "zofed-features-steps48-q4-cached": ("zofed", True),
    "zofed-features-steps96-q2-cached": ("zofed", True),
    "zofed-features-steps48-cached": ("zofed", True),  # and twice the scalars (48 steps of 8 queries, 1.7 KB up)
    # twice the scalars in the same bytes: each sent as float16 (federation.scalar_bits=16), 384 under 1 KB
    "zofed-averaged-steps48-half-cached": ("zofed", True),  # the head recipe with 48 steps
    "zofed-features-steps96-q4-half-cached": ("zofed", True),
    "zofed-features-steps192-q2-half-cached": ("zofed", True),
    # zofed-shaped-features-cached releasing the mean of the second half's server iterates, as the averaged rows do
    "zofed-shaped-features-avg-cached": ("zofed", True),
    # local ZO-Adam (a fresh state each round, replayed exactly by the server) on the head recipes: per-coordinate
    # steps over a round's many cached steps, with plain averaging and with zofed's adaptive server
    "zofed-zo-adam-averaged-steps24-cached": ("zofed", True),
    "zofed-zo-adam-features-cached": ("zofed", True),
    "hiso": ("hiso", False),
    "fedkseed": ("fedkseed", False),
    "decomfl": ("decomfl", False),
    "zo-seeds": ("zo-seeds", False),
    "fedmezo": ("fedmezo", False),
    "hiso-cached": ("hiso", True),
    "hiso-adjusted": ("hiso", False),  # HiSo with zofed's client lever against label skew (logit adjustment)
    "hiso-features-cached": ("hiso", True),  # HiSo with every engine lever of zofed-features-cached
    "hiso-averaged-cached": ("hiso", True),  # and of zofed-averaged-cached (HiSo's server already averages)
    "hiso-averaged-steps24-cached": ("hiso", True),  # and of zofed's head recipe (24 steps a round)
    "fedkseed-cached": ("fedkseed", True),
    "decomfl-cached": ("decomfl", True),
    "fedavg-lora": ("fedavg", False),  # first-order: LoRA, its own trainable set (the accuracy ceiling)
}
HEADLINE = ["zofed", "hiso", "fedkseed", "decomfl", "zo-seeds", "fedmezo", "fedavg-lora"]
# fedavg uploads LoRA's dense update (1.8 MB a client round): no uplink log of it in every run directory
METHOD_OPTIONS = {"fedkseed": ["federation.pool_size=64"], "fedavg": ["federation.log_uplinks=false"]}
TENSORWISE = "federation.server_optimizer.granularity=tensor"
# The ablations were measured with central queries, zofed's estimator before forward won; they keep it.
CENTRAL = "zo.estimator=central"
FEATURES_CACHED = ["federation.feature_cache=16", "federation.local_steps=24", "zo.queries=8",
                   "federation.logit_adjust=1.0"]
# one pass a client round, tail averaging: what first reached the demo's target on the tweets (docs/method.md)
TAIL_AVERAGE = "federation.average_from=0.5"  # release the mean of the second half's server iterates
FEATURES_AVERAGED = ["federation.feature_cache=8", "federation.local_steps=12", "zo.queries=8",
                     "federation.logit_adjust=1.0", TAIL_AVERAGE]
SHAPED = "zo.precondition=features"
ZO_ADAM = "optimizer.name=zo-adam"  # the clients' local optimizer, after COMMON's mezo
HALF = "federation.scalar_bits=16"  # scalars travel as float16
PER_CLASS = ["trainable.label_head=true", "trainable.label_head_per_class=true"]  # the head, split (on any set)
ROW_OPTIONS = {"zofed-central": [CENTRAL], "zofed-q8": ["zo.queries=8"], "zofed-q48": ["zo.queries=48"],
               "zofed-cosine": ["federation.server_optimizer.decay=cosine"],
               "zofed-avg": [TAIL_AVERAGE],
               "zofed-shared": [CENTRAL, "federation.sampling.shared_seeds=true"],
               "zofed-zo-adam": [CENTRAL, ZO_ADAM],
               "zofed-tensor": [CENTRAL, TENSORWISE], "zofed-uncached-tensor": [TENSORWISE],
               "zofed-cosine-tensor": [CENTRAL, TENSORWISE, "federation.server_optimizer.decay=cosine"],
               "zofed-beta1-0.5": [CENTRAL, "federation.server_optimizer.beta1=0.5"],
               "zofed-beta1-ramp": [CENTRAL, "federation.server_optimizer.beta1_start=0.5"],
               "zofed-features": [CENTRAL, SHAPED],
               "zofed-shaped": [SHAPED],
               "zofed-adjusted": ["federation.logit_adjust=1.0"], "hiso-adjusted": ["federation.logit_adjust=1.0"],
               "zofed-q48-adjusted": ["zo.queries=48", "federation.logit_adjust=1.0"],
               "zofed-features-cached": FEATURES_CACHED, "hiso-features-cached": FEATURES_CACHED,
               "zofed-shaped-features-cached": [*FEATURES_CACHED, SHAPED],
               "zofed-perclass-features-cached": [*FEATURES_CACHED, *PER_CLASS],
               "zofed-perclass-averaged-cached": [*FEATURES_AVERAGED, *PER_CLASS],
               "zofed-averaged-steps24-cached": [*FEATURES_AVERAGED, "federation.local_steps=24"],
               "zofed-averaged-steps48-cached": [*FEATURES_AVERAGED, "federation.local_steps=48"],
               "hiso-averaged-steps24-cached": [*FEATURES_AVERAGED, "federation.local_steps=24"],
               "zofed-features-steps48-q4-cached": [*FEATURES_CACHED, "federation.local_steps=48", "zo.queries=4"],
               "zofed-features-steps96-q2-cached": [*FEATURES_CACHED, "federation.local_steps=96", "zo.queries=2"],
               "zofed-features-steps48-cached": [*FEATURES_CACHED, "federation.local_steps=48"],
               "zofed-averaged-steps48-half-cached": [*FEATURES_AVERAGED, "federation.local_steps=48", HALF],
               "zofed-features-steps96-q4-half-cached": [*FEATURES_CACHED, "federation.local_steps=96",
                                                         "zo.queries=4", HALF],
               "zofed-features-steps192-q2-half-cached": [*FEATURES_CACHED, "federation.local_steps=192",
                                                          "zo.queries=2", HALF],
               "zofed-shaped-features-avg-cached": [*FEATURES_CACHED, SHAPED, TAIL_AVERAGE],
               "zofed-zo-adam-averaged-steps24-cached": [*FEATURES_AVERAGED, "federation.local_steps=24", ZO_ADAM],
               "zofed-zo-adam-features-cached": [*FEATURES_CACHED, ZO_ADAM],

               "zofed-averaged-cached": FEATURES_AVERAGED, "hiso-averaged-cached": FEATURES_AVERAGED,
               "zofed-shaped-averaged-cached": [*FEATURES_AVERAGED, SHAPED],
               "zofed-central-averaged-cached": [*FEATURES_AVERAGED, CENTRAL]}
# Rows whose server optimizer is not their method's default; the tuning grid's server factor scales its lr.
PLAIN_AVERAGING = ServerDefault("sgd", 1.0)
ROW_SERVER = {row: PLAIN_AVERAGING for row in ["zofed-averaged-cached", "zofed-shaped-averaged-cached",
                                               "zofed-central-averaged-cached", "zofed-perclass-averaged-cached",
                                               "zofed-averaged-steps24-cached", "zofed-averaged-steps48-cached",
                                               "zofed-averaged-steps48-half-cached",
                                               "zofed-zo-adam-averaged-steps24-cached"]}


def server_default(row: str) -> ServerDefault:
    """The server optimizer a row runs, before the tuning grid's factor on its lr."""
    return ROW_SERVER.get(row, get_method(ROWS[row][0]).server_default)


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
# reach 1e-2 because the plain-averaging baselines step by the client lr and did best at the former top, 3e-3;
# they reach down to 1e-4 because on the label head the same baselines did best at the former bottom, 3e-4.
# The server factors reach below the default because a normalized (Adam) server step is set by the server lr
# alone, as the plain-averaging baselines' step is by the client lr their own grid already spans both ways.
CLIENT_LRS = {"zo": [1e-4, 3e-4, 1e-3, 3e-3, 1e-2], "first_order": [3e-4, 1e-3, 3e-3]}
SERVER_FACTORS = [0.3, 1.0, 3.0]
COMMON = ["model.name=smollm2-135m", "optimizer.name=mezo", "zo.eps=1e-3", f"train.batch_size={BATCH}",
          "task.max_length=64", "train.eval_batch_size=32", f"federation.partition.num_clients={CLIENTS}",
          f"federation.clients_per_round={PER_ROUND}", f"federation.local_steps={LOCAL_STEPS}",
          "federation.partition.scheme=dirichlet-mix", "federation.partition.test_fraction=0.1",
          f"data.validation_examples={VALIDATION}", "data.eval_examples=300"]


def per_client_round_cost(row: str, trainable: str) -> float:
    """Forward-pass equivalents one client spends in a round of this row, as its method counts them."""
    overrides, fraction = row_overrides(row, trainable)
    config = load_config(None, [*COMMON, *overrides, f"federation.method={ROWS[row][0]}"], schema=FederatedConfig)
    plan = federation_plan(config, CLIENTS, fraction)  # the plan a run of this row follows
    return get_method(ROWS[row][0]).forward_passes(get_method(plan.method).round_plan(plan.round(0), plan.sampling))


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


def choices(table: dict) -> dict[str, dict]:
    """Per (dataset, trainable set, budget, row): the grid point with the best validation accuracy among the
    tuning rows, averaged over the seeds that point was tuned on (one seed carries about 2.4 points of standard
    error on 400 validation examples, as large as the margins being ranked)."""
    scores: dict[str, dict[tuple[float, float], list[float]]] = {}
    for r in table["rows"].values():
        if r["phase"] == "tune":
            key = setting_key(r["dataset"], r["trainable"], r["budget"], r["row"])
            scores.setdefault(key, {}).setdefault((r["lr"], r["server_factor"]), []).append(r["final_accuracy"])
    chosen = {}
    for key, points in scores.items():
        # the most seeds first: a point tuned on more seeds is not beaten by a lucky single seed
        (lr, factor), accs = max(points.items(), key=lambda kv: (len(kv[1]), float(np.mean(kv[1]))))
        chosen[key] = {"lr": lr, "server_factor": factor, "validation_accuracy": float(np.mean(accs)),
                       "seeds": len(accs), "tried": sorted(f"({a:g}, {b:g})" for a, b in points)}
    return chosen


def setting_key(dataset: str, trainable: str, budget: float, row: str) -> str:
    return f"{dataset}|{trainable}|{budget:g}|{row}"
