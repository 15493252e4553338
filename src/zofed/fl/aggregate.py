"""Aggregators: how the round's accepted client updates become one pseudo-gradient for the server optimizer.

An aggregator is an `init`/`update` pair with explicit state (optax's habit; a dict of named tensors, saved with
the server's checkpoint), chosen by one config field (`federation.aggregator`). Each client's update reaches it
as a `Contribution`: its example weight and either its dense update or its directions (perturbations with
(seed, coefficient) terms), so an aggregator that only needs the weighted sum never rebuilds one client's update
densely, and one that needs each client's update (a median, a clipped mean) can rebuild it with
`Contribution.rebuild`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zofed.fl.methods.base import Directions
from zofed.zo.perturb import add_directions_


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

    Terms under equal perturbations (`Perturbation.pool_key`: every step of a method whose steps all perturb
    alike) are pooled across clients and added in one pass, which merges terms that share a seed: a direction is
    regenerated once however many clients used it, and memory never grows with the number of clients."""

    name: str = "mean"

    def init(self) -> dict[str, Any]:
        return {}

    def update(self, like: Sequence[torch.Tensor], contributions: Sequence[Contribution],
               state: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if not contributions:
            raise ValueError("no accepted client update to aggregate")
        total = sum(c.num_examples for c in contributions)
        mean = [torch.zeros_like(t) for t in like]
        pooled: dict[Any, Directions] = {}  # pool key (or a fresh one for a per-step perturbation) -> terms
        for c in contributions:
            weight = c.num_examples / total
            if c.dense is not None:
                for m, d in zip(mean, c.dense, strict=True):
                    m.add_(d, alpha=weight)
                continue
            for pert, terms in c.directions:
                key = pert.pool_key() or object()
                pooled.setdefault(key, (pert, []))[1].extend((s, coeff * weight) for s, coeff in terms)
        for pert, terms in pooled.values():  # in first-use order
            add_directions_(mean, terms, pert)
        return mean, state


AGGREGATORS: dict[str, Callable[[], Any]] = {"mean": WeightedMean}


def make_aggregator(name: str) -> Any:
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name]()
