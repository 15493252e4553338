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
    seeds = [query_seed(seed, j) for j in range(queries)]
    points = _InPlace(tensors, pert) if clean is None else _FromClean(tensors, clean, pert, seeds)
    centre = None
    if estimator == "forward":
        centre = float(loss_fn())
        if not math.isfinite(centre):
            raise NonFiniteLossError(f"non-finite loss at the centre point: {centre}")
    grads, losses = [], []
    for j, s in enumerate(seeds):
        offsets = (eps, -eps) if centre is None else (eps,)
        values = [points.loss_at(s, offset, loss_fn) for offset in offsets]
        if not all(math.isfinite(v) for v in values):
            points.restore()
            read = ", ".join(f"{sign}eps {v}" for sign, v in zip("+-", values, strict=False))
            raise NonFiniteLossError(f"non-finite loss at query {j}: {read}")
        grad = (values[0] - values[1]) / (2 * eps) if centre is None else (values[0] - centre) / eps
        grads.append(_wire_scalar(grad, scalar_bits))
        losses.extend(values)
    record = StepRecord(step=state.step, seed=seed, grads=tuple(grads),
                        loss=sum(losses) / len(losses) if centre is None else centre)
    return points.update(optimizer, state, record.grad_terms(), lr), record


class _InPlace:
    """Perturbed points reached by adding directions to the tensors in place (inference-level memory): moving
    from +eps u to -eps u of the same seed is one pass, and the optimizer's pass takes the last offset back."""

    def __init__(self, tensors: Sequence[torch.Tensor], pert: Perturbation) -> None:
        # No word cache here: it would hold 1/32 of the trainable bytes through every forward pass, above what
        # inference holds; hashing again costs a little time. The noise is made on the tensors' own device.
        self.tensors, self.pert = tensors, pert
        self.source = NoiseSource(pert.kind, device=tensors[0].device)
        self.at: tuple[int, float] | None = None  # the (seed, offset) the tensors sit at

    def loss_at(self, seed: int, offset: float, loss_fn: Callable[[], float]) -> float:
        if self.at is not None and self.at[0] == seed:
            add_directions_(self.tensors, [(seed, offset - self.at[1])], self.pert, self.source)
        else:
            self.restore()
            add_directions_(self.tensors, [(seed, offset)], self.pert, self.source)
        self.at = (seed, offset)
        return float(loss_fn())

    def restore(self) -> None:
        if self.at is not None:
            add_directions_(self.tensors, [(self.at[0], -self.at[1])], self.pert, self.source)
            self.at = None

    def update(self, optimizer, state: OptState, terms: list[tuple[int, float]], lr: float) -> OptState:
        back = [] if self.at is None else [(self.at[0], -self.at[1])]
        return optimizer.apply(self.tensors, state, terms, back, lr, self.pert, self.source)


class _FromClean:
    """Perturbed points written from a clean copy (the master weights), which the optimizer then updates and
    copies back: the update is bit-identical to a replay of the step's record, for one more copy of the tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor], clean: Sequence[torch.Tensor], pert: Perturbation,
                 seeds: Sequence[int]) -> None:
        self.tensors, self.clean, self.pert = tensors, clean, pert
        self.source = _clean_source(pert, clean, seeds)

    def loss_at(self, seed: int, offset: float, loss_fn: Callable[[], float]) -> float:
        write_directions_(self.tensors, self.clean, [(seed, offset)], self.pert, self.source)
        return float(loss_fn())

    def restore(self) -> None:
        _copy_(self.tensors, self.clean)

    def update(self, optimizer, state: OptState, terms: list[tuple[int, float]], lr: float) -> OptState:
        state = optimizer.apply(self.clean, state, terms, [], lr, self.pert, self.source)
        _copy_(self.tensors, self.clean)
        return state


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
