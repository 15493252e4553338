"""The two names a method shares with the layers under it.

A method (methods/) draws each client's step seeds and rebuilds each client's update as directions. The client
loop (client.py) runs the seeds, and the aggregators (aggregate.py) read the directions; neither needs the method
itself, so the types live here, below all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from zofed.zo.perturb import Perturbation


@dataclass(frozen=True)
class StepSeeds:
    """The step seeds of one client in one round, and how the uplink names them."""

    seeds: list[int]
    base_seed: int | None  # the uplink names the seeds by this base (derive_seed(base, t)) ...
    explicit: bool  # ... or lists them one by one


# One group of a client's rebuilt update: a perturbation and the (seed, coefficient) terms that move along it.
Directions = tuple[Perturbation, list[tuple[int, float]]]
