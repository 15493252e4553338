"""Frozen-prefix caching: when every trainable tensor lies in the top layers of a decoder-only model, run the
frozen bottom once per batch and only the top layers for each perturbed pass.

A ZO step evaluates the loss at x + eps u and x - eps u for the same batch. Layers below the first trainable
layer see the same weights and the same inputs in both passes, so their output is computed once (the capture
pass) and every perturbed pass starts from it. With the trainable tensors in the top k of L layers a step of q
queries costs (L - k) / L + 2 q k / L forward passes of the full model instead of 2 q: the compute a client is
charged for (`forward_equivalents`), and the reason a step can afford several queries.

The split works on transformers' decoder-only models whose backbone holds its blocks in `layers` and its final
norm in `norm` (Llama, Mistral, Qwen2, SmolLM2, ...): the capture pass records what the first trainable block
is called with (hidden states, attention mask, rotary embeddings, positions) and stops; a perturbed pass calls
the remaining blocks with exactly those arguments, so its output is the full forward's, bit for bit (`hidden`);
`last_hidden`, what a classifier reads, runs the top block at each row's last position alone where it can, within
rounding of the whole block (models/last_position.py).

A simulation that meets the same examples round after round may hand the cache a memo of their rows
(data/prefix_memo.py): the capture pass then assembles the batch from rows each computed from its example alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zofed.models.last_position import (
    attended_at_last_position,
    block_at_last_position,
    feeds_attention,
    finish_at_last_position,
    supports_last_position,
)
from zofed.models.selection import unwrap

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass once the first trainable block's inputs are known."""


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    lm = unwrap(model)
    return getattr(lm, lm.base_model_prefix)


def _blocks(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    """The backbone and its blocks, or None when the model has no `layers`/`norm` backbone to split."""
    try:
        backbone = _backbone(model)
    except AttributeError:
        return None
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(backbone, "norm"):
        return None
    return backbone, layers


def first_trainable_layer(model: torch.nn.Module, trainable_names: Sequence[str]) -> int | None:
    """The index of the lowest block holding a trainable tensor; None when the model cannot be split there
    (no `layers`/`norm` backbone, or a trainable tensor below the blocks, such as the embeddings)."""
    split = _blocks(model)
    if split is None:
        return None
    indices = []
    for name in trainable_names:
        match = _LAYER.search(name)
        if match:
            indices.append(int(match.group(1)))
        elif "embed" in name:  # below every block: nothing can be cached
            return None
    return min(indices) if indices else len(split[1])


@dataclass
class Prefix:
    """What the first trainable block is called with, for one batch."""

    args: tuple
    kwargs: dict[str, Any]


class Memo(Protocol):
    """Where a cache's capture pass reads remembered rows from (data/prefix_memo.py's PrefixMemo)."""

    def capture(self, cache: PrefixCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix: ...


class PrefixCache:
    """Splits one model's forward pass at block `start`. With `output_layer` every perturbed pass also runs the
    model's output layer in full (a causal LM's loss reads the logits of the whole vocabulary), and its cost counts
    that layer."""

    def __init__(self, model: torch.nn.Module, start: int, output_layer: bool = False,
                 memo: Memo | None = None, trainable: Sequence[tuple[str, torch.Tensor]] | None = None) -> None:
        self.backbone = _backbone(model)
        self.memo = memo  # remembered rows the capture pass reads instead of running the bottom (None: it runs)
        # the trainable tensors (name, tensor) of each block: a pass may reuse a block's output while they and the
        # blocks' below it hold the bits they had (`last_hidden` with `kept`); None (not told what trains): every
        # pass runs every block
        self.watched: dict[int, list[torch.Tensor]] | None = None if trainable is None else {}
        self.watched_attention: dict[int, list[torch.Tensor]] = {}  # those of them its attention reads
        for name, tensor in trainable or ():
            match = _LAYER.search(name)
            if match:
                self.watched.setdefault(int(match.group(1)), []).append(tensor)
                if feeds_attention(name):
                    self.watched_attention.setdefault(int(match.group(1)), []).append(tensor)
        self.layers = self.backbone.layers
        if not 0 <= start <= len(self.layers):
            raise ValueError(f"the model has {len(self.layers)} blocks; cannot start a cached pass at block {start}")
        self.start = start
        self.output_layer = unwrap(model).get_output_embeddings() if output_layer else None
        # The share of a full forward pass a perturbed pass runs: of the model's blocks, or, when it runs the output
        # layer too, of the weights of the blocks and that layer together (on SmolLM2-135M the vocabulary projection
        # holds 21% of them: a pass over the top 2 of its 30 blocks and the projection costs 0.26 of a full one).
        if self.output_layer is None:
            self.fraction = (len(self.layers) - start) / len(self.layers)
        else:
            sizes = [sum(p.numel() for p in layer.parameters()) for layer in self.layers]
            head = self.output_layer.weight.numel()
            self.fraction = (sum(sizes[start:]) + head) / (sum(sizes) + head)

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix:
        """What block `start` receives for this batch: from the memo's rows when the cache has one, else from
        running the frozen bottom once (`run_bottom`)."""
        if self.memo is not None:
            return self.memo.capture(self, input_ids, attention_mask)
        return self.run_bottom(input_ids, attention_mask)

    @property
    def target(self) -> torch.nn.Module:
        """The module whose inputs a capture keeps: block `start`, or the final norm when every block is frozen."""
        return self.layers[self.start] if self.start < len(self.layers) else self.backbone.norm

    def run_bottom(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix:
        """Run the blocks below `start` once (the frozen bottom) and keep what block `start` receives (the final
        norm, when every block is frozen)."""
        return self._call_of(self.target, input_ids, attention_mask)

    def with_hidden(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix:
        """The batch's prefix when what block `start` receives as hidden states is known (`hidden`, batch x
        positions x width, e.g. remembered rows): the rest of its call (attention mask, positions, rotary
        embeddings) is the first block's, which a pass over the embeddings alone gives, as the backbone calls
        every block with the same arguments (`shares_block_arguments`)."""
        if self.start == len(self.layers):  # the final norm reads the hidden states alone
            return Prefix((hidden,), {})
        if not self.shares_block_arguments():
            raise ValueError(f"this model calls block {self.start} with other arguments than block 0 (its "
                             "config.layer_types differ): a prefix cannot be rebuilt from the first block's call")
        first = self._call_of(self.layers[0], input_ids, attention_mask)
        if first.args:
            return Prefix((hidden, *first.args[1:]), first.kwargs)
        return Prefix((), {**first.kwargs, "hidden_states": hidden})

    def shares_block_arguments(self) -> bool:
        """Whether block `start` is called with the first block's arguments but the hidden states: so in a backbone
        whose blocks all attend alike; one mixing kinds (config.layer_types, e.g. sliding-window blocks) passes
        each kind its own mask."""
        kinds = getattr(getattr(self.backbone, "config", None), "layer_types", None)
        return not kinds or self.start >= len(self.layers) or kinds[0] == kinds[self.start]

    @torch.no_grad()
    def _call_of(self, target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix:
        """What `target` (a block or the final norm) is called with in a forward pass of this batch, which stops
        there."""
        seen: dict[str, Any] = {}

        def hook(module, args, kwargs):
            seen["args"], seen["kwargs"] = args, dict(kwargs)
            raise _Captured

        handle = target.register_forward_pre_hook(hook, with_kwargs=True)
        try:  # no KV cache: it would grow with every rerun of the top blocks
            self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
        if "args" not in seen:
            raise RuntimeError(f"the forward pass never reached its {type(target).__name__}: cannot cache the "
                               f"prefix of block {self.start}")
        return Prefix(seen["args"], seen["kwargs"])

    @torch.no_grad()
    def last_hidden(self, prefix: Prefix, attention_mask: torch.Tensor, kept: dict | None = None) -> torch.Tensor:
        """The backbone's last hidden state (after its final norm) at each row's last real position (rows x width;
        right-padded rows), running only blocks `start` and above, the top one at those positions alone where its
        kind allows (`block_at_last_position`), else whole. `kept` (an empty dict the first time, then the same one
        for the same prefix) keeps each block's output with the bits of its watched tensors: a later pass runs
        only the blocks from the lowest one whose tensors changed (none, when a step perturbed only what lies
        above the blocks: the final norm or the label head), and the top block's attention output while what its
        attention reads holds its bits (`_top_at_last_position`)."""
        last = attention_mask.sum(1) - 1
        kwargs = dict(prefix.kwargs)
        hidden, rest = (prefix.args[0], prefix.args[1:]) if prefix.args else (kwargs.pop("hidden_states"), ())
        blocks = list(self.layers[self.start:])
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        if not blocks:
            return self.backbone.norm(hidden[rows, last])
        alone = not rest and kwargs.get("position_embeddings") is not None and supports_last_position(blocks[-1])
        if self.watched is None:
            kept = None
        outs, bits = (kept.setdefault("outs", []), kept.setdefault("bits", [])) if kept is not None else ([], [])
        watched = self.watched or {}
        first = 0
        while first < len(outs) and all(torch.equal(a, b) for a, b in zip(
                bits[first], watched.get(self.start + first, []), strict=True)):
            first += 1
        del outs[first:], bits[first:]
        if first:
            hidden = outs[first - 1]
        for j in range(first, len(blocks)):
            if j == len(blocks) - 1 and alone:
                hidden = self._top_at_last_position(blocks[j], hidden, last, kwargs["position_embeddings"], kept)
            else:
                out = blocks[j](hidden, *rest, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
            if kept is not None:
                outs.append(hidden)
                bits.append([t.clone() for t in watched.get(self.start + j, [])])
        return self.backbone.norm(hidden if alone else hidden[rows, last])

    def _top_at_last_position(self, block: torch.nn.Module, hidden: torch.Tensor, last: torch.Tensor,
                              position_embeddings: tuple, kept: dict | None) -> torch.Tensor:
        """The top block at each row's last position; with `kept`, its attention's output is reused while the block
        reads the same input and the watched tensors its attention reads hold the same bits (a pass that perturbs
        only its post-attention norm or MLP runs those alone)."""
        if kept is None:
            return block_at_last_position(block, hidden, last, position_embeddings)
        reads = self.watched_attention.get(len(self.layers) - 1, [])
        was = kept.get("attended")
        if was is None or was[0] is not hidden or not all(
                torch.equal(a, b) for a, b in zip(was[1], reads, strict=True)):
            attended = attended_at_last_position(block, hidden, last, position_embeddings)
            kept["attended"] = was = (hidden, [t.clone() for t in reads], attended)
        return finish_at_last_position(block, was[2])

    @torch.no_grad()
    def hidden(self, prefix: Prefix) -> torch.Tensor:
        """The backbone's last hidden state (after its final norm), running only blocks `start` and above."""
        kwargs = dict(prefix.kwargs)
        hidden, rest = (prefix.args[0], prefix.args[1:]) if prefix.args else (kwargs.pop("hidden_states"), ())
        for layer in self.layers[self.start:]:
            out = layer(hidden, *rest, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.backbone.norm(hidden)


def tensor_pass_shares(model: torch.nn.Module, trainable_names: Sequence[str], output_layer: bool = False,
                       num_classes: int = 0) -> tuple[float, ...]:
    """Each trainable tensor's share of a full forward pass that a perturbed pass runs when a step moves that tensor
    and none below it: from its block up, as `PrefixCache.fraction` counts a pass starting there, or for a tensor
    above the blocks (the final norm, a label head, the output layer) what reads it: the vocabulary projection's
    share with `output_layer`, else the label head's (`head_fraction`). A pass runs whole blocks, so a block's
    post-attention tensors count the whole block. () when the model cannot be split or a tensor lies below the
    blocks (every pass runs from the bottom)."""
    if first_trainable_layer(model, trainable_names) is None:
        return ()
    layers = len(_blocks(model)[1])
    starts = []
    for name in trainable_names:
        match = _LAYER.search(name)
        starts.append(int(match.group(1)) if match else layers)
    fractions = {start: PrefixCache(model, start, output_layer).fraction for start in set(starts)}
    if layers in fractions and not output_layer:
        fractions[layers] = head_fraction(model, num_classes)
    return tuple(fractions[start] for start in starts)


def forward_equivalents(fraction: float, queries: int, estimator: str = "central") -> float:
    """One ZO step's compute in full forward passes: the capture pass over the frozen bottom, then passes over
    the top `fraction` of the blocks, two per query for the central estimate, one per query plus the shared
    centre for the forward one (the embeddings are not counted, nor a classification head's few label rows; a
    causal LM's vocabulary projection is, through `PrefixCache.fraction`)."""
    return (1.0 - fraction) + zo_passes(queries, estimator) * fraction


def zo_passes(queries: int, estimator: str) -> int:
    """The perturbed passes of one ZO step: two per query (central), or one per query plus the shared centre."""
    return 2 * queries if estimator == "central" else queries + 1


def head_fraction(model: torch.nn.Module, num_classes: int) -> float:
    """The share of a full forward pass that a prompt classifier's label head runs: the final norm and the label
    rows (hidden x (classes + 1) multiply-adds at one position) over one position's multiply-adds of the full pass
    (every block's weights plus the label rows). A per-position ratio: a step on cached features runs the head at
    one position per example, where the full pass runs every token of the prompt, so it overcounts such a step
    (by the prompt's length in tokens, at most). On SmolLM2-135M with 4 labels it is 2.7e-5. 0.0 for a model
    without blocks to split, which cannot cache features."""
    split = _blocks(model)
    if split is None:
        return 0.0
    backbone, layers = split
    hidden = backbone.norm.weight.numel()
    rows = hidden * num_classes
    return (hidden + rows) / (sum(p.numel() for p in layers.parameters()) + rows)


def backward_fraction(model: torch.nn.Module, trainable_names: Sequence[str], output_layer: bool = False,
                      num_classes: int = 0) -> float:
    """The share of a full forward pass that back-propagation runs through: from the lowest trainable tensor up to
    the output, counted as `PrefixCache.fraction` counts a pass (with `output_layer`, the vocabulary projection a
    causal LM's loss reads counts too). 1.0 when anything below the blocks trains (the embeddings), or the model
    cannot be split (an encoder); every block frozen and a classification loss: the label head's share
    (`head_fraction`)."""
    start = first_trainable_layer(model, trainable_names)
    if start is None:
        return 1.0
    split = _blocks(model)
    if split is not None and start == len(split[1]) and not output_layer:
        return head_fraction(model, num_classes)
    return PrefixCache(model, start, output_layer).fraction
