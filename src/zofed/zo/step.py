"""One zeroth-order step: the two-point central estimate with q queries, then the optimizer's update.

For each query j with direction u_j (regenerated from seed_j):
    g_j = (L(theta + eps u_j) - L(theta - eps u_j)) / (2 eps)
and the step's gradient estimate is (1/q) sum_j g_j u_j. The parameters move +eps, -2eps, and the
optimizer's pass restores the last +eps while applying the update, so a step costs 2q forward passes plus
2q + 1 streaming passes over the trainable tensors, and never allocates a gradient.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zofed.zo.noise import NoiseSource, derive_seed
from zofed.zo.optim import OptState
from zofed.zo.perturb import Perturbation, add_directions_, write_directions_


@dataclass(frozen=True)
class StepRecord:
    """What a step needs to be replayed: the seed it drew its directions from and one scalar per query."""

    step: int
    seed: int
    grads: tuple[float, ...]
    loss: float  # mean of the perturbed losses: a free, slightly noisy training-loss reading

    def query_seeds(self) -> list[int]:
        return [query_seed(self.seed, j) for j in range(len(self.grads))]

    def grad_terms(self) -> list[tuple[int, float]]:
        q = len(self.grads)
        return [(s, g / q) for s, g in zip(self.query_seeds(), self.grads, strict=True)]


FLOAT16_MAX = 65504.0


def _wire_scalar(value: float, bits: int) -> float:
    """A scalar as it travels: float32, or float16 with bits 16 (saturated at its largest finite value rather than
    sent as infinity). The step uses the rounded value, so a replay from the wire is exact."""
    if bits == 16:
        return float(np.float16(min(max(value, -FLOAT16_MAX), FLOAT16_MAX)))
    return struct.unpack("<f", struct.pack("<f", value))[0]


@functools.lru_cache(maxsize=1 << 16)
def query_seed(step_seed: int, query: int) -> int:
    """Cached: a server rebuilding a round whose clients share step seeds derives each query's seed once."""
    return derive_seed(step_seed, query)


class NonFiniteLossError(FloatingPointError):
    """A perturbed loss was NaN or infinite: the parameters were restored and nothing was updated."""


ESTIMATORS = ("central", "forward")


@torch.no_grad()
def zo_step(tensors: Sequence[torch.Tensor], loss_fn: Callable[[], float], optimizer, state: OptState, *,
            seed: int, eps: float, lr: float, queries: int = 1, perturbation: Perturbation | None = None,
            clean: Sequence[torch.Tensor] | None = None, estimator: str = "central",
            scalar_bits: int = 32) -> tuple[OptState, StepRecord]:
    """Estimate the gradient of `loss_fn` at the current `tensors` and apply `optimizer` in place.

    `estimator="central"` takes (L(x + eps u) - L(x - eps u)) / (2 eps) per query: 2 q loss evaluations.
    `"forward"` takes (L(x + eps u) - L(x)) / eps per query around one shared centre pass: q + 1 evaluations,
    a biased but cheaper estimate when q is large (the uplink is the same: one scalar per query).

    With `clean` (a copy of the trainable tensors, the master weights) the perturbed points are written
    from the copy and the optimizer updates the copy, which is then copied back: the update is then
    bit-identical to a replay of the step's record (what a server computes), at the cost of one extra
    copy of the trainable tensors. Without it, perturb and restore happen in place and leave fp32 rounding
    of about one ulp per step in the parameters (inference-level memory).

    `scalar_bits` is the precision each query's scalar travels with (32 or 16): the step rounds to it first.
    """
    if eps <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if queries < 1:
        raise ValueError(f"queries must be at least 1, got {queries}")
    if scalar_bits not in (32, 16):
        raise ValueError(f"scalars travel with 32 or 16 bits, not {scalar_bits}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown ZO estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    pert = optimizer.perturbation(clean if clean is not None else tensors, state, perturbation or Perturbation())
    if estimator == "forward":
        return _forward_step(tensors, clean, loss_fn, optimizer, state, pert, seed, eps, lr, queries, scalar_bits)
    if clean is not None:
        return _exact_step(tensors, clean, loss_fn, optimizer, state, pert, seed, eps, lr, queries, scalar_bits)
    grads, losses = [], []
    seeds = [query_seed(seed, j) for j in range(queries)]
    # No word cache here: it would hold 1/32 of the trainable bytes through every forward pass, above what
    # inference holds; hashing again costs a little time. The noise is made on the tensors' own device.
    source = NoiseSource(pert.kind, device=tensors[0].device)
    for j, s in enumerate(seeds):
        add_directions_(tensors, [(s, eps)], pert, source)
        loss_plus = float(loss_fn())
        add_directions_(tensors, [(s, -2 * eps)], pert, source)
        loss_minus = float(loss_fn())
        if not (math.isfinite(loss_plus) and math.isfinite(loss_minus)):
            add_directions_(tensors, [(s, eps)], pert, source)
            raise NonFiniteLossError(f"non-finite loss at query {j}: +eps {loss_plus}, -eps {loss_minus}")
        grads.append(_wire_scalar((loss_plus - loss_minus) / (2 * eps), scalar_bits))
        losses.extend((loss_plus, loss_minus))
        if j < queries - 1:
            add_directions_(tensors, [(s, eps)], pert, source)
    record = StepRecord(step=state.step, seed=seed, grads=tuple(grads), loss=sum(losses) / len(losses))
    state = optimizer.apply(tensors, state, record.grad_terms(), [(seeds[-1], eps)], lr, pert, source)
    return state, record


def _exact_step(tensors, clean, loss_fn, optimizer, state, pert, seed, eps, lr, queries, bits):
    grads, losses = [], []
    seeds = [query_seed(seed, j) for j in range(queries)]
    source = _clean_source(pert, clean, seeds)
    for j, s in enumerate(seeds):
        write_directions_(tensors, clean, [(s, eps)], pert, source)
        loss_plus = float(loss_fn())
        write_directions_(tensors, clean, [(s, -eps)], pert, source)
        loss_minus = float(loss_fn())
        if not (math.isfinite(loss_plus) and math.isfinite(loss_minus)):
            _copy_(tensors, clean)
            raise NonFiniteLossError(f"non-finite loss at query {j}: +eps {loss_plus}, -eps {loss_minus}")
        grads.append(_wire_scalar((loss_plus - loss_minus) / (2 * eps), bits))
        losses.extend((loss_plus, loss_minus))
    record = StepRecord(step=state.step, seed=seed, grads=tuple(grads), loss=sum(losses) / len(losses))
    state = optimizer.apply(clean, state, record.grad_terms(), [], lr, pert, source)
    _copy_(tensors, clean)
    return state, record


def _forward_step(tensors, clean, loss_fn, optimizer, state, pert, seed, eps, lr, queries, bits):
    """One-sided queries around one centre pass; from the clean copy when given (exact replay), else in place."""
    centre = float(loss_fn())
    if not math.isfinite(centre):
        raise NonFiniteLossError(f"non-finite loss at the centre point: {centre}")
    grads = []
    seeds = [query_seed(seed, j) for j in range(queries)]
    # in place, no word cache (as in zo_step)
    source = NoiseSource(pert.kind, device=tensors[0].device) if clean is None else _clean_source(pert, clean, seeds)
    for j, s in enumerate(seeds):
        if clean is not None:
            write_directions_(tensors, clean, [(s, eps)], pert, source)
        else:
            add_directions_(tensors, [(s, eps)], pert, source)
        loss_plus = float(loss_fn())
        if not math.isfinite(loss_plus):
            if clean is not None:
                _copy_(tensors, clean)
            else:
                add_directions_(tensors, [(s, -eps)], pert, source)
            raise NonFiniteLossError(f"non-finite loss at query {j}: +eps {loss_plus}")
        grads.append(_wire_scalar((loss_plus - centre) / eps, bits))
        if clean is None and j < queries - 1:
            add_directions_(tensors, [(s, -eps)], pert, source)
    record = StepRecord(step=state.step, seed=seed, grads=tuple(grads), loss=centre)
    if clean is not None:
        state = optimizer.apply(clean, state, record.grad_terms(), [], lr, pert, source)
        _copy_(tensors, clean)
    else:
        state = optimizer.apply(tensors, state, record.grad_terms(), [(seeds[-1], -eps)], lr, pert, source)
    return state, record


KEPT_NOISE_VALUES = 1 << 22  # trainable values x queries up to which a step keeps all its noise (16 MiB)


def _clean_source(pert: Perturbation, clean: Sequence[torch.Tensor], seeds: Sequence[int]) -> NoiseSource:
    """The noise source of a step from a clean copy, which reads each query's noise twice (to perturb, then to
    update). Small steps make all their queries' noise up front, one pass per tensor, and keep it; larger ones
    keep a single query's words (1/32 of the copy, cheap beside it), or none."""
    moving = [i for i, t in enumerate(clean) if pert.moves(i)]
    small = pert.kind == "rademacher" and len(seeds) * sum(clean[i].numel() for i in moving) <= KEPT_NOISE_VALUES
    source = NoiseSource(pert.kind, cache_words=len(seeds) == 1 and not small, device=clean[0].device)
    if small:
        for i in moving:
            source.prefetch(seeds, i, clean[i].numel())
    return source


def _copy_(out: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for o, s in zip(out, src, strict=True):
        o.copy_(s)


@torch.no_grad()
def replay_steps(tensors: Sequence[torch.Tensor], records: Sequence[StepRecord], optimizer, state: OptState,
                 lrs: Sequence[float], perturbation: Perturbation | None = None) -> OptState:
    """Re-apply recorded steps without any forward pass (how a server rebuilds a client's update)."""
    for record, lr in zip(records, lrs, strict=True):
        pert = optimizer.perturbation(tensors, state, perturbation or Perturbation())
        state = optimizer.apply(tensors, state, record.grad_terms(), [], lr, pert)
    return state
