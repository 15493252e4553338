"""What each of zofed's two components is worth in the weights recipe, the one `zofed run` ships for prompt
classification, on the demo's federation (configs/federated_demo.yaml: the built-in tweets, 20 clients with
Dirichlet 0.5 label skew, 3 a round, 90 rounds, 300 test examples), seeds 0 to 2:

- `zofed`: the recipe as it ships (block sampling among its four tensors, plain averaging on the server);
- `no-sampling`: every step perturbs all four tensors (`federation.sampling.personalize=false`), at the client
  compute zofed spent: its steps cost more (each runs the top block), so it runs the rounds whose charge is nearest
  zofed's mean charge over the seeds (both charges are in the table);
- `adaptive-server`: zofed's own adaptive server (adam, one second moment for the update, relative steps, at its
  default lr 1e-2) instead of the recipe's plain averaging; not tuned.

Each variant's test accuracy at the end, and its paired difference from zofed over the seeds, in points, with its
standard error (n - 1). A run directory under runs/bench/recipe/ that holds the variant's run is resumed (a finished
one only tests again), so the table is rebuilt from what the runs hold. About 7 minutes a run on one thread.

Run: `.venv/bin/python benchmarks/recipe_ablation.py` (writes docs/results/recipe_ablation.json and .md);
`--table-only` rewrites the report from the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from zofed.atomic_files import write_atomic_text
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import load_config
from zofed.run.federated import plan_passes, prepare_run, run_federated
from zofed.run.federated_config import FederatedConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "federated_demo.yaml"
RUNS = ROOT / "runs" / "bench" / "recipe"
RESULTS = ROOT / "docs" / "results" / "recipe_ablation.json"
SEEDS = (0, 1, 2)
VARIANTS: dict[str, list[str]] = {
    "zofed": [],
    "no-sampling": ["federation.sampling.personalize=false"],
    "adaptive-server": ["federation.server_optimizer.name=adam"],
}


def run_variant(variant: str, seed: int, rounds: int | None = None) -> dict:
    """One run of a variant (resumed where its directory holds it); its row."""
    out = RUNS / f"{variant}_s{seed}"
    extra = [f"federation.rounds={rounds}"] if rounds is not None else []
    config = load_config(DEMO, [*VARIANTS[variant], *extra, f"train.seed={seed}", f"out_dir={out}"],
                         schema=FederatedConfig)
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None, show_progress=False)
    return {"variant": variant, "seed": seed, "rounds": results["rounds"],
            "forward_passes": round(results["forward_passes"], 1),
            "test_accuracy": round(results["test"]["accuracy"], 4), "test_examples": results["test_examples"],
            "server_optimizer": config.federation.server_optimizer.resolved(config.federation.method,
                                                                            config.federation.rounds)["name"]}


def equal_compute_rounds(zofed_rows: list[dict], per_round: float) -> int:
    """The rounds of a dense variant whose charge is nearest zofed's mean charge over its seeds."""
    mean = float(np.mean([r["forward_passes"] for r in zofed_rows]))
    return max(1, int(round(mean / per_round)))


def dense_round_cost() -> float:
    """The charge of one round of the no-sampling variant: every step dense, so every client its plan's cost
    (`plan_passes` of the run as prepared; no round runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(DEMO, [*VARIANTS["no-sampling"], f"out_dir={Path(tmp) / 'run'}"], schema=FederatedConfig)
        return plan_passes(prepare_run(config).server)


def paired(rows: list[dict], variant: str) -> tuple[float, float]:
    """Mean and standard error of variant - zofed over the seeds both ran, in points."""
    mine = {r["seed"]: r["test_accuracy"] for r in rows if r["variant"] == variant}
    base = {r["seed"]: r["test_accuracy"] for r in rows if r["variant"] == "zofed"}
    diffs = np.array([mine[s] - base[s] for s in sorted(mine.keys() & base.keys())]) * 100
    return float(diffs.mean()), float(diffs.std(ddof=1) / np.sqrt(len(diffs)))


def _protocol_text() -> str:
    """The module's description as markdown: each paragraph and list item on one line."""
    blocks: list[str] = []
    for line in __doc__.split("\n\nRun:")[0].splitlines():
        if not line.strip():
            blocks.append("")
        elif line.startswith("- ") or not blocks or not blocks[-1]:
            blocks.append(line)
        else:
            blocks[-1] += " " + line.strip()
    return "\n".join(blocks)


def write_report(table: dict) -> None:
    rows = table["rows"]
    lines = ["# zofed's components in the weights recipe (the demo's federation)", "", _protocol_text(), "",
             "| variant | server | seeds | test accuracy (mean ± std) | by seed | rounds | forward passes (mean) | "
             "difference from zofed, points (SE) |", "|---|---|---:|---|---|---:|---:|---|"]
    for variant in VARIANTS:
        rs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        if not rs:
            continue
        acc = np.array([r["test_accuracy"] for r in rs])
        spread = f"{acc.mean():.4f} ± {acc.std(ddof=1):.4f}" if len(rs) > 1 else f"{acc.mean():.4f}"
        diff = "-" if variant == "zofed" or len(rs) < 2 else "{:+.2f} ({:.2f})".format(*paired(rows, variant))
        lines.append(f"| {variant} | {rs[0]['server_optimizer']} | {len(rs)} | {spread} | "
                     f"{', '.join(f'{a:.4f}' for a in acc)} | {rs[0]['rounds']} | "
                     f"{np.mean([r['forward_passes'] for r in rs]):,.1f} | {diff} |")
    lines += ["", f"Machine: {table['meta']['machine']}, torch {table['meta']['torch']}."]
    write_atomic_text(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-only", action="store_true", help="rewrite the report from the JSON; run nothing")
    args = parser.parse_args()
    if args.table_only:
        write_report(json.loads(RESULTS.read_text()))
        return
    table = {"meta": {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
                      "torch": torch.__version__, "config": str(DEMO.relative_to(ROOT)), "seeds": list(SEEDS)},
             "rows": []}
    for variant in ("zofed", "adaptive-server"):
        table["rows"] += [run_variant(variant, seed) for seed in SEEDS]
    rounds = equal_compute_rounds([r for r in table["rows"] if r["variant"] == "zofed"], dense_round_cost())
    table["rows"] += [run_variant("no-sampling", seed, rounds) for seed in SEEDS]
    write_atomic_text(RESULTS, json.dumps(table, indent=2))
    write_report(table)


if __name__ == "__main__":
    main()
