"""Clients that lie, for measuring what the server's defenses are worth (`attack:` in a federated config).

A seeded share of the clients attacks in every round it is sampled; the rest are honest. The attack lives in the
client role, so it reaches the server through the same encoding on every backend, and the server learns nothing
from a flag: it sees only the uplink.

- `sign-flip`: the client's scalars (or dense update) negated: its update points uphill.
- `scale`: multiplied by `attack.scale` (100 by default): one client as loud as a hundred.
- `random`: replaced by Gaussian draws of the same RMS: plausible in size, carrying nothing.
- `label-flip`: the client trains on wrong labels (class c read as c + 1, modulo the classes): an honest-looking
  update towards a wrong model.
- `stale`: the client re-sends its uplink from the last round it took part in (honest the first time): the
  server's round check rejects it.
- `seed-grind`: the client keeps its honest scalars but picks each step's seed itself: of `GRIND_TRIES` seeds of
  its own, the one whose direction, moved by that step's scalars as the server would move it, best pushes up a
  target (the first `GRIND_TARGET` values of the first trainable tensor). Scalars of honest size move the model
  where the attacker chose, so clipping bounds nothing; the server's seed check (server.py) refuses the uplink.
  A dense uplink names no seeds: it is sent as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from zofed import streams
from zofed.data.tasks import Encoded
from zofed.fl.protocol import ClientUpdate
from zofed.zo.noise import NoiseSource
from zofed.zo.step import query_seed

AttackKind = Literal["none", "sign-flip", "scale", "random", "label-flip", "stale", "seed-grind"]
GRIND_TRIES = 16  # seeds a grinding client tries for each step
GRIND_TARGET = 64  # the values of the first trainable tensor it pushes up


@dataclass(frozen=True)
class Attack:
    """Which clients attack, and how."""

    kind: AttackKind
    clients: frozenset[int]
    scale: float = 100.0
    seed: int = 0

    @classmethod
    def chosen(cls, kind: AttackKind, fraction: float, num_clients: int, seed: int,
               scale: float = 100.0) -> Attack | None:
        """`fraction` of `num_clients` (rounded up), drawn from the run seed's attackers stream; None: no attack."""
        if kind == "none" or fraction == 0:
            return None
        count = min(num_clients, math.ceil(fraction * num_clients - 1e-9))
        picked = streams.attackers(seed).choice(num_clients, size=count, replace=False)
        return cls(kind, frozenset(int(c) for c in picked), scale, seed)

    def data(self, train: Encoded, num_classes: int) -> Encoded:
        """The training data an attacking client reads (label-flip: every label moved to the next class)."""
        if self.kind != "label-flip":
            return train
        if train.labels is None:
            raise ValueError("attack.kind label-flip needs labelled data; a causal-lm task has none")
        return replace(train, labels=(train.labels + 1) % num_classes)

    def tamper(self, update: ClientUpdate, round_id: int, client_id: int) -> ClientUpdate:
        """The uplink an attacking client sends in place of its honest `update` (stale is the role's: it needs
        the client's past uplinks)."""
        values = update.numbers
        if self.kind == "sign-flip":
            lie = -values
        elif self.kind == "scale":
            lie = values * np.float32(self.scale)
        elif self.kind == "random":
            rms = float(np.sqrt(np.mean(np.square(values, dtype=np.float64)))) if values.size else 0.0
            lie = streams.attack_noise(self.seed, round_id, client_id).normal(0.0, rms, size=values.shape)
        elif self.kind == "seed-grind":
            return grind_seeds(update, streams.attack_noise(self.seed, round_id, client_id))
        else:
            return update
        return update.with_numbers(lie)


def grind_seeds(update: ClientUpdate, rng: np.random.Generator) -> ClientUpdate:
    """The uplink with each step's seed replaced by the best of GRIND_TRIES drawn from `rng`: the one along which
    the server's replay of that step's scalars (-g_j u_j per query j) adds the most to the target values. Listed
    seeds; Rademacher directions, the attacker's guess of the run's noise."""
    if update.dense is not None:
        return update
    source = NoiseSource("rademacher")
    candidates = rng.integers(0, 2**64, size=(update.grads.shape[0], GRIND_TRIES), dtype=np.uint64)
    picked = [max(row.tolist(), key=lambda seed, g=grads: target_push(source, seed, g))
              for row, grads in zip(candidates, update.grads.tolist(), strict=True)]
    return replace(update, seeds=np.array(picked, np.uint64), base_seed=None)


def target_push(source: NoiseSource, seed: int, grads: list[float]) -> float:
    """How far the server's replay of one step on `seed` moves the target values up (in units of lr / queries)."""
    return sum(-g * float(source.chunk(query_seed(seed, j), 0, 0, GRIND_TARGET).sum()) for j, g in enumerate(grads))
