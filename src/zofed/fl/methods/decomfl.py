"""DeComFL: every client of a round uses the same step seeds, so the server merges the clients' scalars per seed
and regenerates only `steps` directions a round, however many clients there are."""

from __future__ import annotations

from zofed import streams
from zofed.fl.methods.base import Method, StepSeeds, private_seeds
from zofed.fl.plan import LocalTraining


class DeComFL(Method):
    name = "decomfl"
    summary = "MeZO local steps on seeds shared by the round's clients; scalars merged per seed on the server"

    sum_suffices = True

    def shares_seeds(self, shared_seeds_setting: bool) -> bool:
        return True

    def step_seeds(self, local: LocalTraining, client_id: int) -> StepSeeds:
        return private_seeds(local, streams.SHARED_OWNER)
