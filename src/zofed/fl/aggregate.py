"""Aggregators: how the round's accepted client updates become one pseudo-gradient for the server optimizer.

An aggregator is an `init`/`update` pair with explicit state (optax's habit; a dict of named tensors, saved with
the server's checkpoint), chosen by one config field (`federation.aggregator`). Each client's update reaches it
as a `Contribution`: its example weight and either its dense update or its directions (perturbations with
(seed, coefficient) terms), so an aggregator that only needs the weighted sum never rebuilds one client's update
densely, and one that needs each client's update (a median, a clipped mean) can rebuild it with
`Contribution.rebuild`. An aggregator that only needs the weighted sum may also offer `update_pooled`: the server
then hands it the round already summed per (seed, tensor) on arrays (`PooledTerms`, pooled.py), when the method
can (`Method.pooled_terms`), and skips building a `Contribution` per client. Both paths stay: the general one
serves dense uplinks, tilted or stateful steps and every robust aggregator; the pooled one skips per-client
bookkeeping (benchmarks/paths.py times both). tests/test_pooled_aggregation.py keeps their means bit-identical.

Against clients that lie, `trimmed-mean` and `median` look at each client's update coordinate by coordinate,
`seed-median` (rounds whose clients share their step seeds) at each client's coefficient on each seed's noise, and
`clip_update` bounds what one uplink can carry before any aggregator (or the method's `observe`) reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from zofed.fl.pooled import PooledTerms
from zofed.fl.protocol import ClientUpdate
from zofed.fl.updates import Directions
from zofed.zo.perturb import Perturbation, add_directions_, add_seed_rows_
from zofed.zo.reduce import l2_norm


@dataclass(frozen=True)
class Contribution:
    """One accepted client update as the aggregator sees it."""

    client_id: int
    num_examples: int
    dense: list[torch.Tensor] | None  # the update itself (dense uplinks) ...
    directions: list[Directions]  # ... or its groups of (perturbation, [(seed, coefficient)])

    def rebuild(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This client's update as dense tensors shaped like `like`."""
        if self.dense is not None:
            return [d.clone() for d in self.dense]
        out = [torch.zeros_like(t) for t in like]
        for pert, terms in self.directions:
            add_directions_(out, terms, pert)
        return out


@dataclass(frozen=True)
class WeightedMean:
    """The example-weighted mean of the clients' updates, streamed into one accumulator.

    Terms under perturbations that differ at most in their per-tensor scales (`Perturbation.noise_key`: zofed's
    one-block steps, or every step of a method whose steps all perturb alike) are pooled across clients as one
    coefficient per (seed, tensor), so a seed's noise is regenerated once per tensor however many clients used it:
    when a round's clients share their seeds, the rebuild costs seeds x trainable values, not clients x steps.
    Without shared seeds nothing merges and each term is added on its own, in the same order and with the same
    floating-point products as one client at a time. Either way each tensor's noise for all its seeds is made in
    one call (`add_seed_rows_`), so thousands of one-tensor steps cost one noise call per tensor. Memory never
    grows with the number of clients beyond one coefficient row per distinct seed."""

    name: str = "mean"

    def init(self) -> dict[str, Any]:
        return {}

    def update(self, like: Sequence[torch.Tensor], contributions: Sequence[Contribution],
               state: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if not contributions:
            raise ValueError("no accepted client update to aggregate")
        total = sum(c.num_examples for c in contributions)
        if total < 1:  # the server refuses an uplink of no examples: this is a caller's mistake, not a client's
            raise ValueError(f"the weighted mean needs examples behind its updates; these {len(contributions)} "
                             "contributions have no examples in all")
        mean = [torch.zeros_like(t) for t in like]
        ones = np.ones(len(like))
        # noise key -> (the perturbation without scales, seed -> coefficient per tensor), in first-use order
        pooled: dict[tuple, tuple[Perturbation, dict[int, np.ndarray]]] = {}
        tilted: list[Directions] = []  # a momentum tilt adds a term of its own besides the noise: not pooled
        for c in contributions:
            weight = c.num_examples / total
            if c.dense is not None:
                for m, d in zip(mean, c.dense, strict=True):
                    m.add_(d, alpha=weight)
                continue
            for pert, terms in c.directions:
                key = pert.noise_key()
                if key is None:
                    tilted.append((pert, [(s, coeff * weight) for s, coeff in terms]))
                    continue
                scales = ones if pert.scales is None else np.asarray(pert.scales, dtype=np.float64)
                rows = pooled.setdefault(key, (replace(pert, scales=None), {}))[1]
                for seed, coeff in terms:
                    row = rows.get(seed)
                    if row is None:
                        rows[seed] = (coeff * weight) * scales
                    else:
                        row += (coeff * weight) * scales
        for pert, rows in pooled.values():
            add_seed_rows_(mean, list(rows), np.stack(list(rows.values())), pert)
        for pert, terms in tilted:
            add_directions_(mean, terms, pert)
        return mean, state

    def update_pooled(self, like: Sequence[torch.Tensor], terms: PooledTerms,
                      state: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """`update` for a round pooled on arrays by the method: the same rows, so the same mean bit for bit."""
        mean = [torch.zeros_like(t) for t in like]
        add_seed_rows_(mean, terms.seeds, terms.coefficients, terms.perturbation)
        return mean, state


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate, the mean of the clients' values once the `trim` share of the largest and of the smallest
    are dropped (rounded up, at least one value kept). Every client counts once, whatever number of examples it
    claims: that number is the client's own word. Each client's update is rebuilt densely, so a round holds
    clients x trainable values: the price of looking at every update on its own."""

    trim: float = 0.1
    name: str = "trimmed-mean"

    def dropped(self, clients: int) -> int:
        """Values dropped at each end of a coordinate's sorted values."""
        return min(math.ceil(self.trim * clients - 1e-9), (clients - 1) // 2)

    def init(self) -> dict[str, Any]:
        return {}

    def update(self, like: Sequence[torch.Tensor], contributions: Sequence[Contribution],
               state: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if not contributions:
            raise ValueError("no accepted client update to aggregate")
        rebuilt = [c.rebuild(like) for c in contributions]
        n, drop = len(rebuilt), self.dropped(len(rebuilt))
        kept = [torch.stack([r[i] for r in rebuilt]).sort(dim=0).values[drop:n - drop] for i in range(len(like))]
        return [values.mean(dim=0) for values in kept], state


@dataclass(frozen=True)
class CoordinateMedian(TrimmedMean):
    """Per coordinate, the median of the clients' values (the mean of the middle two for an even count)."""

    name: str = "median"

    def dropped(self, clients: int) -> int:
        return (clients - 1) // 2


@dataclass(frozen=True)
class SeedMedian:
    """For rounds whose clients share their step seeds (DeComFL, HiSo, zofed with shared seeds): per (seed, tensor),
    the median over the round's clients of the coefficient each put on that seed's noise, and each seed's noise
    regenerated once, as in the mean. A client whose steps on a seed did not move a tensor puts 0 on it. Every
    client counts once. Nothing is rebuilt densely per client: the server holds clients x seeds x tensors numbers,
    not clients x trainable values, and a liar moves each seed's coefficient at most to the edge of the honest ones.
    (With zofed's personal blocks, a tensor that fewer than half of the clients moved on a seed gets 0 there.)"""

    name: str = "seed-median"

    def init(self) -> dict[str, Any]:
        return {}

    def update(self, like: Sequence[torch.Tensor], contributions: Sequence[Contribution],
               state: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if not contributions:
            raise ValueError("no accepted client update to aggregate")
        n, ones = len(contributions), np.ones(len(like))
        # noise key -> (the perturbation without scales, seed -> clients x tensors coefficients), in first-use order
        pooled: dict[tuple, tuple[Perturbation, dict[int, np.ndarray]]] = {}
        for i, c in enumerate(contributions):
            if c.dense is not None:
                raise ValueError(f"seed-median takes seed-and-scalar updates that pool per seed; client "
                                 f"{c.client_id}'s is dense (a first-order method or a stateful local optimizer): "
                                 f"use median")
            for pert, terms in c.directions:
                key = pert.noise_key()
                if key is None:
                    raise ValueError("seed-median cannot pool steps tilted towards the server's momentum "
                                     "(federation.sampling.tilt)")
                scales = ones if pert.scales is None else np.asarray(pert.scales, dtype=np.float64)
                rows = pooled.setdefault(key, (replace(pert, scales=None), {}))[1]
                for seed, coeff in terms:
                    rows.setdefault(seed, np.zeros((n, len(like))))[i] += coeff * scales
        used = [{seed for _, terms in c.directions for seed, _ in terms} for c in contributions]
        if any(seeds != used[0] for seeds in used):
            raise ValueError("seed-median needs the round's clients to share their step seeds (decomfl, hiso, or "
                             "zofed with federation.sampling.shared_seeds); these clients used seeds of their own")
        median = [torch.zeros_like(t) for t in like]
        for pert, rows in pooled.values():
            add_seed_rows_(median, list(rows), np.median(np.stack(list(rows.values())), axis=1), pert)
        return median, state


def clip_update(update: ClientUpdate, bound: float) -> tuple[ClientUpdate, bool]:
    """The uplink with its numbers scaled down to an L2 norm of at most `bound` (the scalars of a seed-and-scalar
    uplink, the update of a dense one), and whether it had to be: one client then moves the round at most so far."""
    values = update.numbers
    norm = l2_norm(values)  # a fixed order (zo/reduce.py): a client under local DP and the server agree
    if norm <= bound:
        return update, False
    return update.with_numbers(values * np.float32(bound / norm)), True


# name -> factory of the aggregator from the federation's aggregation settings
AGGREGATORS: dict[str, Callable[..., Any]] = {
    "mean": lambda trim: WeightedMean(),
    "trimmed-mean": lambda trim: TrimmedMean(trim=trim),
    "median": lambda trim: CoordinateMedian(),
    "seed-median": lambda trim: SeedMedian(),
}


def make_aggregator(name: str, trim: float = 0.1) -> Any:
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name](trim)
