"""Benchmark: the cost rule (src/zofed/fl/cost.py) against measured times, in full forward passes.

On SmolLM2-135M with a 4-label prompt classifier, one batch of real tweets (batch x seq_len tokens, default
8 x 64), in one process, each row is the median time of several repeats after a warm-up, divided by the median
time of a full forward pass of the same model (the unit: every block and the label rows at the last position;
for the LoRA row, with its adapters) timed in turn with it, repeat by repeat, so that a busy machine's load falls
on both alike:

  zo_top4_pass        one perturbed pass over the top 4 of 30 blocks, the prefix below them cached
  fo_lora_step        a first-order step of LoRA (r 8, q and v of every block): forward + backward
  fo_top4_norms_step  a first-order step on the top 4 blocks' norms: forward + backward
  zo_head_query       a central ZO query on cached features of the label head (8 examples): perturb, two head
                      passes, restore, as zo_step runs it
  fo_head_step        a first-order step on cached features of the label head: forward + backward through the
                      final norm and the head
  zo_weights_*        a perturbed pass of the weights recipe (the label head, the top block's two norm gains, the
                      final norm; the prefix below the top block cached) after a step moved one of its tensors:
                      the top block's input norm (the block runs again, at the last position), its post-attention
                      norm (its attention output is reused), the final norm or the head (no block runs)

Beside each measured ratio stands the rule's value for the same work. The head rows' rule is a per-position share
of multiply-adds, which leaves out the fixed cost of each call. The machine's 1-minute load average is recorded at
the start and the end.

Run: `make bench-cost-model` (writes docs/results/cost_model.json and docs/results/cost_model.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import load_builtin
from zofed.data.task_factory import make_task
from zofed.data.tasks import Encoded, TaskConfig
from zofed.fl.cost import first_order_step, head_step
from zofed.models.registry import load_model
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.zo.optim import make_optimizer
from zofed.zo.prefix import PrefixCache, backward_fraction, first_trainable_layer, head_fraction, tensor_pass_shares
from zofed.zo.step import zo_step

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MODEL = "smollm2-135m"
LABELS = ["negative", "neutral", "positive", "mixed"]
TOP = 4  # blocks of the "top 4" rows


def paired_seconds(fn: Callable[[], object], unit: Callable[[], object], repeats: int,
                   warmup: int) -> tuple[float, float]:
    """Median times of `fn` and of a full forward pass `unit`, timed in turn within each repeat (after `warmup`
    rounds of both), so that a load that comes and goes on a busy machine falls on both alike."""
    for _ in range(warmup):
        fn()
        unit()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn_or_unit, kept in ((fn, times[0]), (unit, times[1])):
            t0 = time.perf_counter()
            fn_or_unit()
            kept.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def build(trainable: TrainableConfig, batch_size: int, seq_len: int):
    """A fresh model (LoRA wraps it in place) with its trainable selection (the label head when `trainable` asks for
    it), the task and one batch of real tweets, every row exactly `seq_len` tokens."""
    loaded = load_model(MODEL, kind="causal-lm")
    task = make_task(TaskConfig(verbalizer=LABELS, max_length=seq_len), loaded.tokenizer, len(LABELS))
    model, params = select_trainable(loaded.model, trainable, task.label_token_ids)
    model.eval()
    train, _ = load_builtin("tweets")
    stream = loaded.tokenizer(" ".join(f["text"] for f in train.fields[:2000]), add_special_tokens=False)["input_ids"]
    rows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(batch_size)]
    labels = np.arange(batch_size, dtype=np.int64) % len(LABELS)
    batch = task.collate(Encoded(rows, labels), list(range(batch_size)))
    return model, params, task, batch


def backprop_step(params, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A forward and a backward of `loss_fn`, gradients cleared each time (the optimizer's update is left out: it
    touches the trainable tensors only)."""
    def step() -> None:
        for p in params.params:
            p.grad = None
        loss_fn().backward()
    return step


Row = Callable[[str, str, Callable[[], object], float, Callable[[], object]], None]


def full_forward(model, task, batch) -> Callable[[], object]:
    """The unit: a full forward pass of the batch, every block and the label rows at the last position."""
    return torch.no_grad()(lambda: task.logits(model, batch))


def head_rows(row: Row, batch_size: int, seq_len: int) -> dict[str, float]:
    """The rows on the label head: a perturbed pass over the top blocks, and ZO and first-order steps on cached
    features; returns the shares the rule counts them with."""
    model, params, task, batch = build(TrainableConfig(mode="none", label_head=True), batch_size, seq_len)
    unit = full_forward(model, task, batch)
    blocks = len(PrefixCache(model, 0).layers)
    shares = {"head_fraction": head_fraction(model, len(LABELS)), "blocks": blocks}

    top = PrefixCache(model, blocks - TOP)  # a perturbed pass over the top blocks from a cached prefix
    prefix = top.capture(batch.input_ids, batch.attention_mask)
    row("zo_top4_pass", f"ZO perturbed pass over the top {TOP} of {blocks} blocks, prefix cached",
        torch.no_grad()(lambda: task.logits_from_hidden(model, top.hidden(prefix), batch)), top.fraction, unit)

    whole = PrefixCache(model, first_trainable_layer(model, params.names))  # the batch's last hidden states
    encoded = Encoded([list(r) for r in batch.input_ids.tolist()], batch.labels.numpy())
    features = task.last_features(whole, encoded, np.arange(batch_size))
    labels = batch.labels
    tensors, clean = params.tensors(), [t.clone() for t in params.tensors()]
    optimizer = make_optimizer("mezo")
    state = optimizer.init(clean)
    seeds = iter(range(10**6))

    def zo_query() -> None:  # lr 0: the head stays where it is
        zo_step(tensors, lambda: task.feature_loss(model, whole, features, labels), optimizer, state,
                seed=next(seeds), eps=1e-3, lr=0.0, queries=1, clean=clean, estimator="central")

    row("zo_head_query", f"ZO query on cached features of the label head ({batch_size} examples, central: two "
        "head passes)", zo_query, head_step(shares["head_fraction"], False, 1, "central"), unit)
    for p in params.params:
        p.requires_grad_(True)
    fo_head = backprop_step(params, lambda: F.cross_entropy(task.feature_logits(model, whole, features), labels))
    row("fo_head_step", f"first-order step on cached features of the label head ({batch_size} examples)",
        fo_head, head_step(shares["head_fraction"], True, 1, "central"), unit)
    return shares


def weights_rows(row: Row, batch_size: int, seq_len: int) -> float:
    """The weights recipe's perturbed passes, each after a step moved one tensor (a sign flip of 1e-3 each call,
    so the kept outputs above that tensor are stale as in a run), each beside the share the rule charges such a pass
    (`tensor_pass_shares`: the top block for its norms, the label head's share above it); returns the recipe's
    pass fraction."""
    model, params, task, batch = build(TrainableConfig(mode="none", label_head=True, top_norms=1), batch_size,
                                       seq_len)
    unit = full_forward(model, task, batch)
    start = first_trainable_layer(model, params.names)
    cache = PrefixCache(model, start, trainable=params.named())
    loss = task.cached_loss(model, cache, batch)  # keeps block outputs from pass to pass, as a round's steps do
    tensors = dict(params.named())
    charged = dict(zip(params.names, tensor_pass_shares(model, params.names, num_classes=len(LABELS)), strict=True))

    def after_moving(name: str) -> Callable[[], float]:
        signs = [1e-3]

        @torch.no_grad()
        def run() -> float:
            tensors[name].add_(signs[0])
            signs[0] = -signs[0]
            return loss()
        return run

    for suffix, name, what in [
            ("input_norm", f"model.layers.{start}.input_layernorm.weight", "the top block's input norm moved"),
            ("post_attention_norm", f"model.layers.{start}.post_attention_layernorm.weight",
             "the top block's post-attention norm moved"),
            ("final_norm", "model.norm.weight", "the final norm moved"),
            ("head", "label_head", "the label head moved")]:
        row(f"zo_weights_{suffix}", f"weights recipe: a perturbed pass after {what}", after_moving(name),
            charged[name], unit)
    return cache.fraction


def backprop_row(row: Row, name: str, what: str, config: TrainableConfig, batch_size: int,
                 seq_len: int) -> float:
    """A first-order step (forward + backward) of a fresh model's `config` selection; returns its backward share."""
    model, params, task, batch = build(config, batch_size, seq_len)
    for p in params.params:
        p.requires_grad_(True)
    fraction = backward_fraction(model, params.names, task.full_vocabulary, len(LABELS))
    row(name, what, backprop_step(params, lambda: task.loss_tensor(model, batch)), first_order_step(fraction),
        full_forward(model, task, batch))
    return fraction


def measure(batch_size: int, seq_len: int, repeats: int, warmup: int) -> tuple[list[dict], dict]:
    rows: list[dict] = []

    def row(name: str, what: str, fn: Callable[[], object], rule: float, unit: Callable[[], object]) -> None:
        seconds, unit_seconds = paired_seconds(fn, unit, repeats, warmup)
        rows.append({"row": name, "what": what, "seconds": seconds, "full_forward_seconds": unit_seconds,
                     "measured": seconds / unit_seconds, "rule": rule})

    shares = head_rows(row, batch_size, seq_len)
    shares["weights_pass_fraction"] = weights_rows(row, batch_size, seq_len)
    top = "|".join(str(b) for b in range(shares["blocks"] - TOP, shares["blocks"]))
    shares["lora_backward_fraction"] = backprop_row(
        row, "fo_lora_step", "first-order step of LoRA (r 8, q and v of every block): forward + backward",
        TrainableConfig(mode="lora", lora_r=8), batch_size, seq_len)
    shares["top4_norms_backward_fraction"] = backprop_row(
        row, "fo_top4_norms_step", f"first-order step on the top {TOP} blocks' norms: forward + backward",
        TrainableConfig(mode="patterns", patterns=[rf"layers\.({top})\..*norm\.weight$"]), batch_size, seq_len)
    return rows, shares


def markdown(report: dict) -> str:
    lines = [
        "# The cost rule against measured times",
        "",
        f"{report['model']}, {len(LABELS)} labels, batch {report['batch_size']} x {report['seq_len']} tokens, "
        f"one process, {report['threads']} thread(s), torch {report['torch']}, {report['machine']}; median of "
        f"{report['repeats']} repeats after {report['warmup']} warm-up(s). Load average (1 min): "
        f"{report['load_start']:.2f} at the start, {report['load_end']:.2f} at the end.",
        "",
        "Each time is divided by the time of a full forward pass of the same model (the unit), timed in turn with it "
        "repeat by repeat; the rule is src/zofed/fl/cost.py's count for the same work (the label head's share: "
        f"{report['shares']['head_fraction']:.3g} of a full pass, per position, "
        "which counts multiply-adds only).",
        "",
        "| row | work | seconds | full forward (s) | measured / full forward | rule |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['row']} | {r['what']} | {r['seconds']:.4g} | {r['full_forward_seconds']:.3f} | "
                     f"{r['measured']:.4g} | {r['rule']:.4g} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    """The processor's model name (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()[0]
    rows, shares = measure(args.batch_size, args.seq_len, args.repeats, args.warmup)
    report = {"model": MODEL, "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": args.threads,
              "repeats": args.repeats, "warmup": args.warmup, "torch": torch.__version__,
              "machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
              "load_start": load_start, "load_end": os.getloadavg()[0], "shares": shares, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic_text(args.out / "cost_model.json", json.dumps(report, indent=2) + "\n")
    write_atomic_text(args.out / "cost_model.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
