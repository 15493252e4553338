"""Perturbation distributions over a list of trainable tensors, applied in place chunk by chunk.

A perturbation of tensor i for seed s is `u_i = scale_i * p_i * mask_i * (z_i(s) + w * m_i / rms_i)`:
  - `z_i(s)` is seeded noise (see noise.py), regenerated, never stored;
  - `scale_i` is a per-tensor multiplier (personalized sampling shapes the distribution through it);
  - `p_i` optionally preconditions every coordinate (HiSo's global second moment);
  - `mask_i` optionally restricts the perturbation to some coordinates (sparse perturbation), or as floats also
    shapes it by a static per-coordinate scale (zo.precondition features: feature_scale.py);
  - `m_i` is an optional momentum buffer that tilts the direction (ZO-AdaMU-style shaping).
Everything in it is either a seed or small explicit state, so whoever holds the same state can rebuild
exactly the same directions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zofed.zo.noise import NoiseKind, NoiseSource, chunk_bounds


@dataclass
class Perturbation:
    kind: NoiseKind = "rademacher"
    scales: Sequence[float] | None = None  # one per tensor; None means all ones
    masks: Sequence[torch.Tensor | None] | None = None  # flat per tensor: a bool mask, or float noise weights
    momentum: Sequence[torch.Tensor] | None = None  # flat buffers that tilt the direction
    momentum_weight: float = 0.0
    momentum_rms: Sequence[float] | None = None  # normalizes each momentum buffer to unit RMS
    precondition: Sequence[torch.Tensor] | None = None  # flat per-coordinate multipliers per tensor

    def pool_key(self) -> tuple | None:
        """Terms under perturbations with equal keys may be added in one pass (their shared seeds then merge);
        None for a per-step perturbation (own scales or momentum), whose terms are added on their own. Masks are
        compared by identity: they are shared objects, too large to compare."""
        if self.scales is not None or self.momentum is not None:
            return None
        return (self.kind, None if self.masks is None else id(self.masks), self._precondition_id)

    def noise_key(self) -> tuple | None:
        """Perturbations with equal keys differ at most in their per-tensor scales, so a term under one is a term
        under the other with its coefficient times the scale ratio: an aggregator can sum coefficients per seed
        and tensor across clients and regenerate each seed's noise once. None with a momentum tilt."""
        if self.momentum is not None:
            return None
        return (self.kind, None if self.masks is None else id(self.masks), self._precondition_id)

    @cached_property
    def _precondition_id(self) -> tuple | None:
        """The precondition compared by the memory it views, not by its list: every client of a HiSo round splits
        the same downlink array (each call its own list of views of it), and their terms pool all the same."""
        if self.precondition is None:
            return None
        return tuple((t.data_ptr(), t.numel(), t.stride(0)) for t in self.precondition)

    def scale(self, i: int) -> float:
        return 1.0 if self.scales is None else float(self.scales[i])

    def moves(self, i: int) -> bool:
        """False when tensor i is left alone (scale 0): its noise need not be generated."""
        return self.scale(i) != 0.0

    def mask(self, i: int) -> torch.Tensor | None:
        return None if self.masks is None else self.masks[i]

    def direction(self, source: NoiseSource, seed: int, i: int, start: int, end: int, coeff: float) -> torch.Tensor:
        """`coeff * u_i` over elements [start, end) of tensor i (a scratch view, valid until reuse)."""
        c = coeff * self.scale(i)
        u = source.chunk(seed, i, start, end - start, c)
        if self.momentum is not None and self.momentum_weight != 0.0:
            rms = self.momentum_rms[i] if self.momentum_rms is not None else 1.0
            if rms > 0:
                u.add_(self.momentum[i][start:end], alpha=c * self.momentum_weight / rms)
        if self.precondition is not None:
            u.mul_(self.precondition[i][start:end])
        mask = self.mask(i)
        if mask is not None:
            u.mul_(mask[start:end])
        return u


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where the noise for these tensors is made: on their own device (the values are the same everywhere)."""
    return tensors[0].device if len(tensors) else torch.device("cpu")


def merge_terms(terms: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Sum coefficients that share a seed so each direction is generated once per chunk."""
    merged: dict[int, float] = {}
    for seed, coeff in terms:
        merged[seed] = merged.get(seed, 0.0) + float(coeff)
    return [(s, c) for s, c in merged.items() if c != 0.0]


@torch.no_grad()
def add_directions_(tensors: Sequence[torch.Tensor], terms: Sequence[tuple[int, float]],
                    perturbation: Perturbation, source: NoiseSource | None = None) -> None:
    """tensors[i] += sum_k coeff_k * u_i(seed_k), streaming over tensors and chunks."""
    terms = merge_terms(terms)
    source = source or NoiseSource(perturbation.kind, device=_device(tensors))
    for i, flat in enumerate(tensors):
        if not perturbation.moves(i):
            continue
        for _, start, end in chunk_bounds(flat.numel()):
            for seed, coeff in terms:
                flat[start:end].add_(perturbation.direction(source, seed, i, start, end, coeff))


ROWS_PER_PASS = 1 << 22  # noise elements made at once when many seeds touch one tensor (16 MB of float32)


@torch.no_grad()
def add_seed_rows_(tensors: Sequence[torch.Tensor], seeds: Sequence[int], coefficients: np.ndarray,
                   perturbation: Perturbation, source: NoiseSource | None = None) -> None:
    """tensors[i] += sum_k coefficients[k, i] * u_i(seeds[k]) for a perturbation without scales or momentum: what
    `add_directions_` does seed by seed with per-tensor scales `coefficients[k]`, with the same sums in the same
    order (bit for bit), but each tensor's noise for all its seeds made in one pass. A server that pools many
    clients' one-tensor steps then pays one noise call per tensor instead of one per step."""
    if perturbation.scales is not None or perturbation.momentum is not None:
        raise ValueError("add_seed_rows_ takes the per-tensor scales as coefficients: pass a perturbation without "
                         "scales or momentum")
    source = source or NoiseSource(perturbation.kind, device=_device(tensors))
    for i, flat in enumerate(tensors):
        active = np.flatnonzero(coefficients[:, i])
        if not active.size:
            continue
        precondition, mask = perturbation.precondition, perturbation.mask(i)
        for _, start, end in chunk_bounds(flat.numel()):
            step = max(1, ROWS_PER_PASS // (end - start))
            for first in range(0, active.size, step):
                group = active[first:first + step]
                rows = source.rows([seeds[k] for k in group], i, start, end - start, coefficients[group, i].tolist())
                if precondition is not None:
                    rows.mul_(precondition[i][start:end])
                if mask is not None:
                    rows.mul_(mask[start:end])
                for row in rows:
                    flat[start:end].add_(row)


@torch.no_grad()
def write_directions_(out: Sequence[torch.Tensor], base: Sequence[torch.Tensor], terms: Sequence[tuple[int, float]],
                      perturbation: Perturbation, source: NoiseSource | None = None) -> None:
    """out[i] = base[i] + sum_k coeff_k * u_i(seed_k): perturbs from a clean copy, so no rounding accumulates."""
    terms = merge_terms(terms)
    source = source or NoiseSource(perturbation.kind, device=_device(out))
    for i, (flat, clean) in enumerate(zip(out, base, strict=True)):
        for _, start, end in chunk_bounds(flat.numel()):
            flat[start:end].copy_(clean[start:end])
            if not perturbation.moves(i):
                continue
            for seed, coeff in terms:
                flat[start:end].add_(perturbation.direction(source, seed, i, start, end, coeff))


ChunkUpdate = Callable[[int, int, int, torch.Tensor, torch.Tensor], None]


@torch.no_grad()
def sweep_estimate(tensors: Sequence[torch.Tensor], restore: Sequence[tuple[int, float]],
                   grad_terms: Sequence[tuple[int, float]], perturbation: Perturbation,
                   update: ChunkUpdate, source: NoiseSource | None = None) -> None:
    """One pass that first applies `restore` terms, then hands each chunk's gradient estimate
    `sum_k g_k u(seed_k)` to `update(i, start, end, param_chunk, grad_chunk)`.

    Directions that appear in both lists (the last query's seed) are generated once.
    """
    restore_c = dict(merge_terms(restore))
    grad_c = dict(merge_terms(grad_terms))
    seeds = list(dict.fromkeys([*restore_c, *grad_c]))
    source = source or NoiseSource(perturbation.kind, device=_device(tensors))
    for i, flat in enumerate(tensors):
        for _, start, end in chunk_bounds(flat.numel()):
            grad = torch.zeros(end - start, dtype=flat.dtype, device=flat.device)
            for seed in seeds if perturbation.moves(i) else ():
                u = perturbation.direction(source, seed, i, start, end, 1.0)
                if seed in restore_c:
                    flat[start:end].add_(u, alpha=restore_c[seed])
                if seed in grad_c:
                    grad.add_(u, alpha=grad_c[seed])
            update(i, start, end, flat[start:end], grad)
