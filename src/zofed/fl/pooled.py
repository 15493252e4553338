"""A round's seed-and-scalar uplinks as arrays: the server's fast path when every client's steps pool.

The general path (aggregate.py's `Contribution`) turns each uplink into Python objects (step records, one
perturbation per step, (seed, coefficient) terms) and pools them term by term, a fraction of a millisecond per
client: at a thousand clients that share their seeds, this bookkeeping, not the noise, is the round's cost. Here
the round is handled as columns instead:

    RoundSteps     the accepted uplinks stacked: seeds (clients, steps), scalars (clients, steps, queries), weights
    StepBlocks     the method's answer for all of them at once (`Method.step_blocks`): the block each step moved
                   and its scale, under one perturbation without per-step scales
    PooledTerms    sum over clients, steps and queries of -lr g/q * weight * scale, one coefficient per
                   (seed, tensor): what `WeightedMean.update_pooled` regenerates once per seed and tensor

Exactness: each coefficient is the general path's float64 product, taken in its order, and they are summed per
(seed, block) by np.bincount, which adds in input order: client, step, query order, the general path's loop. The
seeds are listed in first-use order, as the general path's dict keeps them. So the aggregated update is the
general path's bit for bit, with private or shared seeds (tests/test_pooled_aggregation.py checks both).
The general path stays for the rounds this one cannot take (aggregate.py); benchmarks/paths.py times the two on
one round (docs/results/paths.json).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zofed.fl.protocol import ClientUpdate, step_seeds
from zofed.zo.perturb import Perturbation
from zofed.zo.step import query_seed


@dataclass(frozen=True)
class RoundSteps:
    """A round's accepted seed-and-scalar uplinks, one row per client in the order they were accepted."""

    client_ids: np.ndarray  # int64 (clients,)
    num_examples: np.ndarray  # int64 (clients,)
    seeds: np.ndarray  # uint64 (clients, steps): each step's seed (read-only: may be one row broadcast)
    grads: np.ndarray  # float32 (clients, steps, queries)
    states: list[np.ndarray]  # what each client's downlink carried besides the weights
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # a method's derived columns

    @classmethod
    def of(cls, updates: Sequence[ClientUpdate], sent: Mapping[int, np.ndarray]) -> RoundSteps:
        # one concatenation and one index per distinct base seed: np.stack of a thousand small arrays costs more.
        # `receive` gave every accepted uplink the round's (steps, queries) scalars; this only guards the stacking.
        arrays = [u.grads for u in updates]
        grads = np.concatenate(arrays)
        if grads.shape[0] != len(arrays) * arrays[0].shape[0]:
            raise ValueError("a round's uplinks must all carry the round's (steps, queries) scalars")
        grads = grads.reshape(len(arrays), *arrays[0].shape)
        bases = [u.base_seed for u in updates]
        if bases[0] is not None and bases.count(bases[0]) == len(bases):  # shared seeds: one row, not copied
            seeds = np.broadcast_to(step_seeds(updates[0]), (len(updates), grads.shape[1]))
        elif None in bases:  # explicit seeds (fedkseed)
            seeds = np.stack([step_seeds(u) for u in updates])
        else:  # clients that share a base seed share its step seeds: derive them once
            _, first, inverse = np.unique(np.array(bases, dtype=np.uint64), return_index=True, return_inverse=True)
            seeds = np.stack([step_seeds(updates[i]) for i in first.tolist()])[inverse.reshape(-1)]
        empty = np.zeros(0, np.float32)
        return cls(np.fromiter((u.client_id for u in updates), np.int64, len(updates)),
                   np.fromiter((u.num_examples for u in updates), np.int64, len(updates)),
                   seeds, grads, [sent.get(u.client_id, empty) for u in updates])

    @property
    def weights(self) -> np.ndarray:
        """Each client's example weight, num_examples / total (the same division as the general path's)."""
        return self.num_examples / int(self.num_examples.sum())


@dataclass(frozen=True)
class StepBlocks:
    """Where every step of a round moved: step (c, t) adds coeff * scales[c, t] * u_i(seed) to each tensor i
    with layout[i] == blocks[c, t], u being `perturbation`'s noise (no per-step scales, no momentum)."""

    perturbation: Perturbation
    layout: np.ndarray  # int (tensors,): each tensor's block
    blocks: np.ndarray  # int (clients, steps)
    scales: np.ndarray  # float64 (clients, steps)

    @classmethod
    def every_tensor(cls, perturbation: Perturbation, num_tensors: int, steps: RoundSteps) -> StepBlocks:
        """Steps that all move every tensor alike: one block, scale 1 (MeZO's steps, DeComFL's, HiSo's)."""
        shape = steps.seeds.shape
        return cls(perturbation, np.zeros(num_tensors, dtype=np.int64), np.zeros(shape, dtype=np.int64),
                   np.ones(shape))


@dataclass(frozen=True)
class PooledTerms:
    """The round's weighted sum of client updates: sum_k coefficients[k, i] * u_i(seeds[k]) on tensor i."""

    perturbation: Perturbation  # without scales or momentum, as `add_seed_rows_` takes it
    seeds: list[int]  # in first-use order
    coefficients: np.ndarray  # float64 (seeds, tensors)


def pool_steps(steps: RoundSteps, where: StepBlocks, lr: float) -> PooledTerms:
    """Sum every client's -lr (g / q) * weight * scale per (seed, block), then spread each block's sum over its
    tensors: the general path's pooled rows, in the same order and with the same float64 operations."""
    queries = steps.grads.shape[2]
    # query j of a step draws its direction from query_seed(step seed, j): derived once per distinct step seed
    unique_steps, inverse = np.unique(steps.seeds, return_inverse=True)
    per_step = np.array([[query_seed(s, j) for j in range(queries)] for s in unique_steps.tolist()],
                        dtype=np.uint64).reshape(-1, queries)
    term_seeds = per_step[inverse.reshape(-1)].reshape(-1)  # client, step, query order
    coeffs = (-lr * (steps.grads.astype(np.float64) / queries)) * steps.weights[:, None, None] \
        * where.scales[:, :, None]
    seeds, first, rows = np.unique(term_seeds, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # first-use order, as the general path's dict lists its seeds
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    num_blocks = int(where.layout.max()) + 1
    cells = rank[rows.reshape(-1)] * num_blocks + np.repeat(where.blocks.reshape(-1), queries)
    sums = np.bincount(cells, weights=coeffs.reshape(-1), minlength=seeds.size * num_blocks)
    per_block = sums.reshape(seeds.size, num_blocks)  # row r: the r-th seed in first-use order
    return PooledTerms(where.perturbation, seeds[order].tolist(), per_block[:, where.layout])
