"""Greedy generation from a causal LM, and ROUGE-L against reference responses.

Instruction tuning is judged by what the model writes, not only by its loss on the reference: the federated
instruction-tuning literature (FedKSeed on Dolly-15K) generates greedily and scores ROUGE-L. Decoding is
transformers' own `generate` (greedy, a KV cache, per-row stopping), so the text is what the exported model
would write with plain transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch

Progress = Callable[[int], None]  # called with the number of prompts generated so far


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask with the padding on the left: every row's last prompt token sits in the last
    column, where a decoder-only model's next token is read."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        if row:
            ids[k, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[k, width - len(row):] = 1
    return ids, mask


def _cut_at_eos(row: list[int], eos_id: int | None) -> list[int]:
    """The tokens before the first end-of-sequence; rows that stopped early are padded after it."""
    if eos_id is not None and eos_id in row:
        return row[: row.index(eos_id)]
    return row


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, pad_id: int, eos_id: int | None,
                 max_new_tokens: int = 128, batch_size: int = 16, progress: Progress | None = None) -> list[list[int]]:
    """Greedy continuations of tokenized prompts, without the prompt and the end-of-sequence token, in the order
    of `prompts`. Works on a peft-wrapped model too (its `generate` runs the LoRA layers)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token to generate from")
    # Rows of similar length share a batch, so little compute goes to padding; the results are put back in order.
    order = np.argsort([len(p) for p in prompts], kind="stable")
    results: list[list[int]] = [[] for _ in prompts]
    device = _device(model)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, mask = left_pad([prompts[i] for i in chunk], pad_id)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             num_beams=1, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id)
        for k, i in enumerate(chunk):
            results[i] = _cut_at_eos(out[k, ids.shape[1]:].tolist(), eos_id)
        if progress is not None:
            progress(min(start + batch_size, len(order)))
    return results


def generate_texts(model: torch.nn.Module, tokenizer, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int = 128, batch_size: int = 16, progress: Progress | None = None) -> list[str]:
    """Greedy continuations decoded to text (special tokens dropped), in the order of `prompts`."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = generate_ids(model, prompts, pad_id=pad_id, eos_id=tokenizer.eos_token_id, max_new_tokens=max_new_tokens,
                        batch_size=batch_size, progress=progress)
    return [tokenizer.decode(r, skip_special_tokens=True).strip() for r in rows]


@contextmanager
def progress_bar(total: int, description: str = "generating", show: bool = True) -> Iterator[Progress | None]:
    """A rich progress bar over `total` prompts; yields the callback for `generate_*` (None when not shown)."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)


@contextmanager
def showing_generation(task, show: Callable[[str], None]) -> Iterator[None]:
    """While open, a generative task's evaluations (a task with `on_generated`) report the answers they have
    generated so far through `show`, e.g. a run's progress bar; other tasks are left alone."""
    if not hasattr(task, "on_generated"):
        yield
        return
    task.on_generated = lambda done, total: show(f"evaluating: {done}/{total} answers generated")
    try:
        yield
    finally:
        task.on_generated = None


@lru_cache(maxsize=1)
def _scorer():
    # Imported here: rouge-score pulls in nltk and absl, which only generation-based evaluation needs.
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The mean per-example ROUGE-L F1 (longest common subsequence of stemmed words) of predictions against
    references; 0.0 for no examples."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        return 0.0
    scorer = _scorer()
    return float(np.mean([scorer.score(ref, pred)["rougeL"].fmeasure
                          for pred, ref in zip(predictions, references, strict=True)]))
