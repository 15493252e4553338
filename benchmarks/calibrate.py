"""Calibration: how far centralized MeZO gets per forward pass, before any federated budget is set.

A federated benchmark can only rank methods at a budget where learning happens, so this measures, for SmolLM2 on
the pooled training data of each dataset, validation accuracy against client compute (forward-pass equivalents
of the full model: a cached frozen prefix counts its share of the blocks, zo/prefix.py) for a few trainable
sets and learning rates. Validation is a seeded 500-example split carved from the training data: no test
example is seen. The budget of the federated benchmark is then sized so that the best of these gains at least
5 points over zero-shot on every dataset.

Rows (dataset, setting, lr, seed) are appended to docs/results/calibration.json as they finish, so the matrix fills
over sittings; an interrupted row resumes from its checkpoint. Run: `.venv/bin/python benchmarks/calibrate.py`
(`--jobs 2 --threads 1` runs two rows at once). Skipped with a message when ../shared/data is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
from row_pool import record_rows, run_rows  # benchmarks/ is the script's own directory, so first on sys.path

from zofed.atomic_files import write_atomic_text
from zofed.data.body_features import STORE_VARIABLE
from zofed.data.builtin import load_shared, shared_data_dir
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import FinetuneConfig, load_config
from zofed.run.finetune import finetune
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build
from zofed.zo.feature_scale import SETUP_PASSES
from zofed.zo.prefix import forward_equivalents

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
VALIDATION = 400  # examples carved from the training data
TASKS = {
    "sst2": ["task.template='Review: {text} Sentiment:'", "task.verbalizer=[' negative', ' positive']"],
    "agnews": ["task.template='Article: {text} Topic:'",
               "task.verbalizer=[' World', ' Sports', ' Business', ' Technology']"],
    "mr": ["task.template='Review: {text} Sentiment:'", "task.verbalizer=[' negative', ' positive']"],
    "sst5": ["task.template='Review: {text} Sentiment:'",
             "task.verbalizer=[' terrible', ' bad', ' okay', ' good', ' great']"],
}
SETTINGS = {
    # every RMSNorm gain of the model (61 tensors, 35,136 values), one query a step: the benchmark's ZO set
    "dense-gains": ["trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']", "zo.queries=1"],
    # the gains of the top 4 of 30 blocks and the final norm (5,184 values) with the frozen prefix cached, four
    # queries a step: (1 - 4/30) + 2 * 4 * 4/30 = 1.93 forward equivalents a step
    "top4-cached-q4": ["trainable.mode=patterns",
                       "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', '^model\\.norm\\.weight$']",
                       "zo.cache=prefix", "zo.queries=4"],
    # the same with one-sided queries around a shared centre: (1 - 4/30) + 5 * 4/30 = 1.53 a step
    "top4-cached-q4-forward": ["trainable.mode=patterns",
                               "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', "
                               "'^model\\.norm\\.weight$']",
                               "zo.cache=prefix", "zo.queries=4", "zo.estimator=forward"],
    # the same with each coordinate's noise scaled by 1 / RMS of its input feature (zo/feature_scale.py)
    "top4-cached-q4-features": ["trainable.mode=patterns",
                                "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', "
                                "'^model\\.norm\\.weight$']",
                                "zo.cache=prefix", "zo.queries=4", "zo.precondition=features"],
    # the label head alone (the verbalizer's output rows, 3 x 576 values on AG News' 4 classes: 2,304) with the
    # whole backbone cached: a perturbed pass runs only the final projection, so 16 queries cost 1 pass a step
    "head-cached-q16": ["trainable.mode=none", "trainable.label_head=true", "zo.cache=features",
                        "zo.queries=16"],
    # the same with each column's noise scaled by 1 / RMS of the hidden feature it reads (zo/feature_scale.py): the
    # few massive channels no longer cap the lr the other 570-odd columns get
    "head-cached-q16-features": ["trainable.mode=none", "trainable.label_head=true", "zo.cache=features",
                                 "zo.queries=16", "zo.precondition=features"],
    # the label head with three times the queries: still one pass a step, and 48 scalars a step still fit a
    # client's round of 4 steps in 1 KB of uplink; the gradient estimate's variance falls with the queries
    "head-cached-q48": ["trainable.mode=none", "trainable.label_head=true", "zo.cache=features",
                        "zo.queries=48"],
    # the label head and the top-4 gains, cached, 4 queries: 1.93 passes a step
    "head-top4-cached-q4": ["trainable.mode=patterns", "trainable.label_head=true",
                            "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', "
                            "'^model\\.norm\\.weight$']",
                            "zo.cache=prefix", "zo.queries=4"],
    # the label head and the top-4 gains, cached, 4 one-sided queries around a shared centre: 1.53 passes a step
    "head-top4-cached-q4-forward": ["trainable.mode=patterns", "trainable.label_head=true",
                                    "trainable.patterns=['layers\\.(26|27|28|29)\\..*norm\\.weight$', "
                                    "'^model\\.norm\\.weight$']",
                                    "zo.cache=prefix", "zo.queries=4", "zo.estimator=forward"],
    # the gains of the top 8 blocks and the final norm (9,792 values), cached, 4 one-sided queries:
    # (1 - 8/30) + 5 * 8/30 = 2.07 passes a step
    "top8-cached-q4-forward": ["trainable.mode=patterns",
                               "trainable.patterns=['layers\\.(2[2-9])\\..*norm\\.weight$', "
                               "'^model\\.norm\\.weight$']",
                               "zo.cache=prefix", "zo.queries=4", "zo.estimator=forward"],
}
LRS = {"dense-gains": [3e-4], "top4-cached-q4": [3e-4, 1e-3], "top4-cached-q4-forward": [1e-3],
       "top4-cached-q4-features": [1e-3, 3e-3], "head-cached-q16": [1e-4, 3e-4],
       "head-cached-q16-features": [1e-3, 3e-3], "head-cached-q48": [1e-3],
       "head-top4-cached-q4": [1e-3], "head-top4-cached-q4-forward": [1e-3],
       "top8-cached-q4-forward": [1e-3]}
COMMON = ["model.name=smollm2-135m", "optimizer.name=mezo", "zo.eps=1e-3", "train.batch_size=8", "task.max_length=64",
          "train.eval_batch_size=32", f"data.eval_examples={VALIDATION}"]


def row_key(dataset: str, setting: str, lr: float, seed: int, budget: int) -> str:
    return f"{dataset}|{setting}|{lr:g}|{seed}|{budget}"


# remembered body features, one file per model (not committed), shared with benchmarks/ranking.py: with zo.cache:
# features each example runs through the model once, and the curves equal recomputing them
# (tests/test_feature_cache.py)
FEATURE_STORE = ROOT / "runs" / "feature-store"


def use_feature_store() -> None:
    """Keep the body features the runs of this process (and of those it starts) remember in FEATURE_STORE, unless
    the environment already names a store."""
    os.environ.setdefault(STORE_VARIABLE, str(FEATURE_STORE))


def _config(dataset: str, setting: str, lr: float, seed: int, out: Path) -> FinetuneConfig:
    return load_config(None, [*COMMON, *TASKS[dataset], *SETTINGS[setting], f"optimizer.lr={lr}",
                              f"data.source=shared:{dataset}", f"train.seed={seed}", f"out_dir={out}"])


def run_row(dataset: str, setting: str, lr: float, seed: int, budget: int, points: int = 4) -> dict:
    out = ROOT / "runs" / "bench" / "calibrate" / f"{dataset}-{setting}-lr{lr:g}-s{seed}-b{budget}"
    config = _config(dataset, setting, lr, seed, out)
    setup = build(config)
    train, _ = load_shared(dataset, seed=seed)
    fit, validation = train.train_test_split(VALIDATION / len(train), seed + 100)
    setup.train, setup.test = setup.task.encode(fit), setup.task.encode(validation)
    # known once the model is split
    step_cost = forward_equivalents(setup.pass_fraction, config.zo.queries, config.zo.resolved_estimator(None))
    # the feature-shaped noise is measured with a few passes before training: they come out of the budget
    setup_passes = SETUP_PASSES if config.zo.precondition == "features" else 0
    steps = int((budget - setup_passes) // step_cost)
    every = max(1, int(round(budget / points / step_cost)))  # `points` evaluations along the curve
    config = config.model_copy(update={"train": config.train.model_copy(update={
        "steps": steps, "eval_every": every, "checkpoint_every": every})})
    setup.config = config
    results = finetune(config, resume=find_checkpoint(out / "checkpoint") is not None,
                       show_progress=sys.stderr.isatty(), setup=setup)
    curve = [[r["forward_passes"] + setup_passes, round(r["eval_accuracy"], 4)]
             for r in MetricsLog(out / "metrics.jsonl").read() if r["event"] == "eval"]
    return {"dataset": dataset, "setting": setting, "lr": lr, "seed": seed, "budget": budget, "steps": steps,
            "forward_passes_per_step": round(step_cost, 4), "setup_passes": setup_passes,
            "trainable_parameters": setup.trainable.numel(),
            "validation_examples": len(validation), "train_examples": len(fit), "curve": curve,
            "zero_shot": curve[0][1], "final": results["test"]["accuracy"],
            "train_seconds": round(results["train_seconds"], 1), "run_dir": str(out.relative_to(ROOT))}


def _row_process(dataset: str, setting: str, lr: float, seed: int, budget: int, threads: int, points: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_row(dataset, setting, lr, seed, budget, points=points), "torch_threads": threads}


def reached(curve: list[list[float]], target: float) -> float | None:
    """The first forward-pass count at which the curve reaches `target` (None: never)."""
    return next((fp for fp, acc in curve if acc >= target), None)


def write_report(rows: list[dict]) -> None:
    from matplotlib.figure import Figure

    lines = ["# Calibration: centralized MeZO per forward pass", "",
             f"SmolLM2-135M, pooled training data less a seeded {VALIDATION}-example validation split (the curves and "
             "the last column are on that split; no test example is used), batch 8, 64 tokens, eps 1e-3, MeZO. "
             "Forward passes are full-model equivalents (a cached frozen prefix counts its share of the blocks). "
             "Reproduce: `.venv/bin/python benchmarks/calibrate.py`.", "",
             "| dataset | setting | lr | seed | trainable | passes / step | budget | zero-shot | best on the curve "
             "| passes to +5 points | final |", "|" + "---|" * 11]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["setting"], r["lr"], r["seed"])):
        best = max(acc for _, acc in r["curve"])
        hit = reached(r["curve"], r["zero_shot"] + 0.05)
        lines.append(f"| {r['dataset']} | {r['setting']} | {r['lr']:g} | {r['seed']} | {r['trainable_parameters']:,} "
                     f"| {r['forward_passes_per_step']:.2f} | {r['budget']} | {r['zero_shot']:.4f} | {best:.4f} "
                     f"| {f'{hit:.0f}' if hit is not None else 'not reached'} | {r['final']:.4f} |")
    lines += ["", "## What the rows say", ""]
    for dataset in sorted({r["dataset"] for r in rows}):
        same = [r for r in rows if r["dataset"] == dataset]
        best = max(same, key=lambda r: max(acc for _, acc in r["curve"]))
        gain = 100 * (max(acc for _, acc in best["curve"]) - best["zero_shot"])
        hit = reached(best["curve"], best["zero_shot"] + 0.05)
        lines.append(f"- {dataset}: the best row ({best['setting']}, lr {best['lr']:g}) gains {gain:+.1f} points over "
                     f"zero-shot within {best['budget']} forward passes"
                     + (f", and first reaches +5 points at {hit:.0f}." if hit is not None else "; +5 is not reached."))
    fig = Figure(figsize=(5 * max(1, len({r["dataset"] for r in rows})), 4))
    datasets = sorted({r["dataset"] for r in rows})
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        for r in [r for r in rows if r["dataset"] == dataset]:
            fp, acc = zip(*r["curve"], strict=True)
            ax.plot(fp, acc, marker="o", ms=3, label=f"{r['setting']} lr {r['lr']:g} (seed {r['seed']})")
        ax.set(title=dataset, xlabel="forward passes (full-model equivalents)", ylabel="validation accuracy")
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(RESULTS / "calibration.png", dpi=110)
    lines += ["", "![calibration](calibration.png)", ""]
    write_atomic_text(RESULTS / "calibration.md", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="*", default=["sst2", "agnews"], choices=list(TASKS))
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--budget", type=int, default=800, help="forward-pass equivalents per run")
    parser.add_argument("--points", type=int, default=4, help="evaluations along each curve (each costs a pass "
                        f"over the {VALIDATION} validation examples)")
    parser.add_argument("--only", nargs="*", metavar="SETTING:LR",
                        help="run just these (setting, lr) pairs, e.g. dense-gains:3e-4 top4-cached-q4:1e-3")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--table-only", action="store_true", help="rewrite the page from the JSON; run nothing")
    args = parser.parse_args()
    use_feature_store()
    path = RESULTS / "calibration.json"
    table = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    if args.table_only:
        write_report(list(table["rows"].values()))
        return
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding sst2/ and agnews/)")
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    table["meta"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                     "settings": SETTINGS, "common": COMMON}
    pairs = [(p.split(":")[0], float(p.split(":")[1])) for p in args.only] if args.only else [
        (s, lr) for s in args.settings for lr in LRS[s]]
    pending = [(d, s, lr, seed, args.budget) for d in args.datasets for s, lr in pairs
               for seed in args.seeds if row_key(d, s, lr, seed, args.budget) not in table["rows"]]
    print(f"{len(pending)} rows to run, {args.jobs} at a time", flush=True)
    record_rows(run_rows(_row_process, pending, row_key, args.jobs, args.threads, args.points), table, path,
                lambda: write_report(list(table["rows"].values())), "curve")


if __name__ == "__main__":
    main()
