"""Benchmark: how concentrated the squared gradient of a trainable set is, coordinate by coordinate.

On the ranking benchmark's top4 set (SmolLM2-135M's top 4 blocks' RMSNorm gains and the final norm, AG News, its
prompt and label words), the back-propagated gradient of the training loss at the starting model, averaged over
`--examples` training examples of the tune seed's split (a seeded draw, batches of 16). Per tensor: its share of
the set's squared gradient, the share its 1 and 5 largest coordinates hold, and the share held by the coordinates
reading its 5 and 8 largest input features as `zo.precondition: channels` measures them (random tokens, no data:
zo/feature_scale.py). A ZO step's noise is spread over every coordinate it perturbs, so where a few coordinates hold
nearly all of the squared gradient, the rest of the noise is what limits the step.

Run: `.venv/bin/python benchmarks/gradient_concentration.py` (about a minute on one thread; writes
docs/results/gradient_concentration.json and .md). Skipped with a message when ../shared/data is absent.
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
from ranking_protocol import RESULTS, protocol, run_overrides  # benchmarks/ is the script's own directory

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import shared_data_dir
from zofed.run.config import load_config
from zofed.run.federated_config import FederatedConfig
from zofed.run.setup import build
from zofed.zo.feature_scale import feature_rms

BATCH = 16


def measure(examples: int, seed: int) -> list[dict]:
    config = load_config(None, run_overrides(protocol(), "tune", "top4", "zofed", "agnews", 0.1, seed, 1e-2,
                                             Path("runs/unused")), schema=FederatedConfig)
    setup = build(config)
    model, task, names, params = setup.model, setup.task, setup.trainable.names, setup.trainable.params
    for p in params:
        p.requires_grad_(True)
    chosen = np.random.default_rng(seed).choice(len(setup.train), examples, replace=False)
    grads = [torch.zeros_like(p) for p in params]
    for start in range(0, examples, BATCH):
        part = chosen[start:start + BATCH]
        loss = task.loss_tensor(model, task.collate(setup.train, part))
        for g, d in zip(grads, torch.autograd.grad(loss, params), strict=True):
            g += d.detach() * len(part) / examples
    sizes = feature_rms(model, names)
    energy = [g.reshape(-1).double().square() for g in grads]
    total = float(sum(e.sum() for e in energy))
    rows = []
    for name, e in zip(names, energy, strict=True):
        ordered = torch.sort(e, descending=True).values
        by_size = torch.argsort(sizes[name], descending=True)
        rows.append({"tensor": name, "coordinates": e.numel(), "share_of_set": round(float(e.sum()) / total, 4),
                     "top1": round(float(ordered[:1].sum() / e.sum()), 4),
                     "top5": round(float(ordered[:5].sum() / e.sum()), 4),
                     "largest5_features": round(float(e[by_size[:5]].sum() / e.sum()), 4),
                     "largest8_features": round(float(e[by_size[:8]].sum() / e.sum()), 4)})
    return rows


def markdown(report: dict) -> str:
    rows = report["rows"]
    covered = sum(r["share_of_set"] * r["largest8_features"] for r in rows)
    lines = ["# Gradient concentration on the top-4 norm gains (AG News)", "",
             f"Back-propagated gradient of the training loss at the starting model, {report['examples']} training "
             f"examples (tune seed {report['seed']}). Shares of each tensor's squared gradient. "
             f"{report['torch_threads']} torch thread(s), 1-minute load {report['load_start']:.2f}.", "",
             "| tensor | coordinates | share of the set | largest 1 | largest 5 | 5 largest features | "
             "8 largest features |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tensor']} | {r['coordinates']} | {r['share_of_set']:.3f} | {r['top1']:.2f} | {r['top5']:.2f} | "
              f"{r['largest5_features']:.2f} | {r['largest8_features']:.2f} |" for r in rows]
    lines += ["", f"The coordinates reading each tensor's 8 largest features (`zo.precondition: channels`, "
              f"{8 * len(rows)} of {sum(r['coordinates'] for r in rows)}) hold {covered:.1%} of the set's squared "
              "gradient.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding the datasets)")
        sys.exit(0)
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    rows = measure(args.examples, args.seed)
    report = {"examples": args.examples, "seed": args.seed, "torch_threads": 1, "load_start": load_start,
              "machine": platform.machine(), "rows": rows}
    write_atomic_text(args.out / "gradient_concentration.json", json.dumps(report, indent=2) + "\n")
    write_atomic_text(args.out / "gradient_concentration.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
