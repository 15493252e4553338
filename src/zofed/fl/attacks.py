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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from zofed import streams
from zofed.data.tasks import Encoded
from zofed.fl.protocol import ClientUpdate

AttackKind = Literal["none", "sign-flip", "scale", "random", "label-flip", "stale"]


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
        else:
            return update
        return update.with_numbers(lie)
