"""FedKSeed: every step's seed is drawn from a pool of K candidate seeds fixed for the whole run.

The uplink lists the picked seeds with their scalars; the server's rebuild merges them per pool seed, so it
regenerates at most K directions a round.
"""

from __future__ import annotations

import numpy as np

from zofed import streams
from zofed.fl.methods.base import Method, StepSeeds
from zofed.fl.plan import LocalTraining
from zofed.zo.noise import derive_seed


def kseed_pool(run_seed: int, pool_size: int) -> np.ndarray:
    """FedKSeed's K candidate seeds, fixed for the whole run and known to every party."""
    return np.array([derive_seed(run_seed, streams.KSEED_POOL + j) for j in range(pool_size)], dtype=np.uint64)


class FedKSeed(Method):
    name = "fedkseed"
    summary = "MeZO local steps on seeds picked from a fixed pool of K; picked seeds and scalars uploaded"

    def step_seeds(self, local: LocalTraining, client_id: int) -> StepSeeds:
        if local.pool_size < 1:
            raise ValueError("fedkseed needs a seed pool of at least 1 seed (federation.pool_size)")
        pool = kseed_pool(local.run_seed, local.pool_size)
        picks = streams.kseed_picks(local.run_seed, local.round_id, client_id).integers(
            0, local.pool_size, size=local.local_steps)
        return StepSeeds([int(pool[i]) for i in picks], None, True)
