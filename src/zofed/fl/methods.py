"""How each federated ZO method draws its local directions and what it reports.

A method fixes three things: where a client's step seeds come from, what its uplink carries, and therefore
how the server rebuilds the round's mean update.

| method   | step seeds                              | uplink                        | server rebuild cost        |
|----------|-----------------------------------------|-------------------------------|----------------------------|
| zo-seeds | private, from (run seed, round, client) | base seed + one scalar a step | clients x steps directions |
| decomfl  | shared by every client of the round     | base seed + one scalar a step | steps directions (merged)  |
| fedkseed | drawn from a fixed pool of K seeds      | seeds + one scalar a step     | at most K directions       |
| fedmezo  | private                                 | the dense update              | none (a weighted sum)      |
| zofed    | private; one block a step, drawn from   | base seed + one scalar a step | clients x steps blocks     |
|          | the client's own distribution           |                               |                            |

`zofed` is the default method: personalized block sampling (personal.py) on the clients, adaptive
momentum (server_opt.py) on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zofed.zo.noise import derive_seed

METHODS = ("zofed", "zo-seeds", "decomfl", "fedkseed", "fedmezo")
_SHARED = 2**32 - 1  # client-id slot used for seeds every client of a round shares


@dataclass(frozen=True)
class SeedPlan:
    """The step seeds of one client in one round, and how the uplink names them."""

    step_seeds: list[int]
    base_seed: int | None  # uplink names the seeds by this base (derive_seed(base, t)) ...
    explicit: bool  # ... or lists them one by one


def seed_plan(method: str, run_seed: int, round_id: int, client_id: int, steps: int, pool_size: int = 0,
              shared: bool = False) -> SeedPlan:
    """`shared`: the round's clients share their step seeds, as DeComFL's always do (zofed's option)."""
    if method not in METHODS:
        raise ValueError(f"unknown federated ZO method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "fedkseed":
        if pool_size < 1:
            raise ValueError("fedkseed needs a seed pool of at least 1 seed (method.pool_size)")
        pool = kseed_pool(run_seed, pool_size)
        picks = np.random.default_rng([run_seed, round_id, client_id, 7]).integers(0, pool_size, size=steps)
        return SeedPlan([int(pool[i]) for i in picks], None, True)
    owner = _SHARED if method == "decomfl" or shared else client_id
    base = derive_seed(run_seed, round_id, owner)
    return SeedPlan([derive_seed(base, t) for t in range(steps)], base, False)


def kseed_pool(run_seed: int, pool_size: int) -> np.ndarray:
    """FedKSeed's K candidate seeds, fixed for the whole run and known to every party."""
    return np.array([derive_seed(run_seed, 2**40 + j) for j in range(pool_size)], dtype=np.uint64)


def uploads_dense(method: str) -> bool:
    return method == "fedmezo"


def personalized(method: str) -> bool:
    """Clients draw each step's block from their own distribution (sent to them with the round)."""
    return method == "zofed"
