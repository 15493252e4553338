"""Benchmark: centralized ZO fine-tuning of SmolLM2-135M on SST-2, against its zero-shot accuracy.

Data: SST-2 from ../shared/data/sst2 (train 6,920 / test 1,821); skipped with a message when that folder is
absent. Zero-shot and final accuracies are on the full test split; the curve is on a fixed 300-example test
subset. The run directory lives under runs/bench/, and an interrupted benchmark resumes from its checkpoint.

Run: `make bench-centralized` (writes docs/results/centralized_sst2.json and .md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import shared_data_dir
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import load_config
from zofed.run.finetune import finetune
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "sst2_centralized.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override")
    parser.add_argument("--tag", default="", help="suffix for the run directory and result key")
    args = parser.parse_args()
    if shared_data_dir() is None or not (shared_data_dir() / "sst2").is_dir():
        print("skipped: ../shared/data/sst2 not found (set ZOFED_SHARED_DATA to a folder holding sst2/)")
        return
    tag = args.tag or "default"
    config = load_config(args.config, [f"out_dir={ROOT / 'runs' / 'bench' / f'centralized_sst2-{tag}'}",
                                       *args.overrides])
    t0 = time.perf_counter()
    setup = build(config)
    resume = find_checkpoint(Path(config.out_dir) / "checkpoint") is not None
    zero_shot_file = Path(config.out_dir) / "zero_shot.json"
    if zero_shot_file.is_file():
        zero_shot = json.loads(zero_shot_file.read_text())
    else:
        zero_shot = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size, body=setup.body)
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        write_atomic_text(zero_shot_file, json.dumps(zero_shot))
    print(f"zero-shot test accuracy {zero_shot['accuracy']:.4f} on {len(setup.test)} examples", flush=True)
    results = finetune(config, resume=resume, show_progress=sys.stderr.isatty(), setup=setup)
    records = MetricsLog(Path(config.out_dir) / "metrics.jsonl").read()
    curve = [(r["step"], round(r["eval_accuracy"], 4)) for r in records if r["event"] == "eval"]
    row = {
        "tag": tag, "model": config.model.name, "data": "SST-2 (../shared/data/sst2), full test split",
        "test_examples": len(setup.test), "zero_shot_accuracy": round(zero_shot["accuracy"], 4),
        "final_accuracy": round(results["test"]["accuracy"], 4), "template": config.task.template,
        "verbalizer": config.task.verbalizer, "trainable": config.trainable.model_dump(),
        "trainable_parameters": results["trainable_parameters"], "optimizer": config.optimizer.model_dump(),
        "zo": config.zo.model_dump(), "steps": config.train.steps, "batch_size": config.train.batch_size,
        "seed": config.train.seed, "forward_passes": results.get("forward_passes"),
        "train_seconds_this_sitting": round(results.get("train_seconds", 0.0), 1),
        "wall_seconds_this_sitting": round(time.perf_counter() - t0, 1), "curve_300_test_subset": curve,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "centralized_sst2.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    table[tag] = row
    write_atomic_text(path, json.dumps(table, indent=2))
    lines = ["# Centralized ZO fine-tuning, SmolLM2-135M on SST-2", "",
             "Full SST-2 test split (1,821 examples). Reproduce: `make bench-centralized`.", "",
             "| run | trainable | optimizer | lr | eps | steps | batch | seed | zero-shot | after ZO "
             "| forward passes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.values():
        lines.append(f"| {r['tag']} | {r['trainable']['mode']} ({r['trainable_parameters']:,}) | "
                     f"{r['optimizer']['name']} ({r['optimizer']['schedule']}) | {r['optimizer']['lr']} | "
                     f"{r['zo']['eps']} | {r['steps']} | {r['batch_size']} | {r['seed']} | "
                     f"{r['zero_shot_accuracy']:.4f} | **{r['final_accuracy']:.4f}** | {r['forward_passes']} |")
    write_atomic_text(RESULTS / "centralized_sst2.md", "\n".join(lines) + "\n")
    print(json.dumps({k: row[k] for k in ("tag", "zero_shot_accuracy", "final_accuracy", "steps")}))


if __name__ == "__main__":
    main()
