"""HiSo: DeComFL's scalar-only uplink with every perturbation preconditioned by a global second moment.

All clients of a round share their step seeds (as in DeComFL) and perturb along z * p, where z is the seeded
noise and p = 1 / sqrt(K) per coordinate, K being the federation's running second moment of the gradient
estimates. The server keeps K, sends p with each round's downlink (one float per trainable value, counted in the
downlink bytes), rebuilds each client's steps along the same p, and updates K from the round's aggregated
update:

    g_hat = -delta / (lr * local_steps)        (the round's mean gradient estimate per local step)
    K <- beta K + (1 - beta) g_hat^2,   K starts at 1
    p = K^-1/2 / rms(K^-1/2)                   (normalized: E|z p|^2 = E|z|^2, so MeZO's lr carries over)

Coordinates whose estimates are large and noisy are probed less, quiet ones more: the estimator's variance
follows the curvature-like scale of each coordinate while the uplink stays one scalar a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zofed import streams
from zofed.fl.methods.base import Method, ServerView, StepSeeds, private_seeds
from zofed.fl.plan import LocalTraining
from zofed.fl.pooled import RoundSteps, StepBlocks
from zofed.fl.protocol import ClientUpdate
from zofed.zo.perturb import Perturbation
from zofed.zo.reduce import rms

BETA = 0.9  # memory of the second moment, in rounds
FLOOR = 1e-12  # keeps K^-1/2 finite for a coordinate no estimate has touched


@dataclass
class SecondMoment:
    """The server's K, one flat tensor per trainable tensor, and the preconditioner sent this round."""

    k: list[torch.Tensor]
    round_id: int = -1
    sent: np.ndarray | None = None

    def precondition(self) -> np.ndarray:
        """p = K^-1/2 normalized to unit root mean square, flat float32 (what the downlink carries)."""
        inv = torch.cat([t.clamp_min(FLOOR).rsqrt() for t in self.k]).double()
        return (inv / rms(inv)).float().cpu().numpy()  # a fixed-order RMS: the same p at any thread count

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f"k.{i}": t.contiguous() for i, t in enumerate(self.k)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.k = [tensors[f"k.{i}"].clone() for i in range(len(self.k))]


class HiSo(Method):
    name = "hiso"
    summary = ("MeZO local steps on shared seeds along perturbations preconditioned by a global second moment; "
               "one scalar a step uploaded, the preconditioner sent down")

    sum_suffices = True

    def shares_seeds(self, shared_seeds_setting: bool) -> bool:
        return True

    def step_seeds(self, local: LocalTraining, client_id: int) -> StepSeeds:
        return private_seeds(local, streams.SHARED_OWNER)

    def perturbations(self, local: LocalTraining, like: Sequence[torch.Tensor],
                      masks: Sequence[torch.Tensor | None] | None, seeds: Sequence[int],
                      server_state: np.ndarray) -> list[Perturbation]:
        numel = sum(t.numel() for t in like)
        if server_state.shape != (numel,) or not np.isfinite(server_state).all():
            raise ValueError(f"a hiso downlink carries one finite preconditioner value per trainable value "
                             f"({numel}), got {server_state.shape}")
        # Views of the array, kept nowhere: the method object serves every run of the process. The server pools
        # the terms of clients sent the same array, whose views share its memory (Perturbation.pool_key).
        flat = torch.from_numpy(np.ascontiguousarray(server_state, dtype=np.float32)).to(like[0].device)
        parts = list(torch.split(flat, [t.numel() for t in like]))
        base = Perturbation(kind=local.noise, masks=masks, precondition=parts)
        return [base] * len(seeds)

    def step_blocks(self, local: LocalTraining, like: Sequence[torch.Tensor],
                    masks: Sequence[torch.Tensor | None] | None, steps: RoundSteps) -> StepBlocks | None:
        """Every client of a round was sent the same preconditioner: one perturbation for all their steps."""
        if any(state is not steps.states[0] for state in steps.states):
            return None  # not the round's one array: rebuilt client by client
        pert = self.perturbations(local, like, masks, [0], steps.states[0])[0]
        return StepBlocks.every_tensor(pert, len(like), steps)

    def init_state(self, server: ServerView) -> SecondMoment:
        return SecondMoment([torch.ones(t.numel(), dtype=torch.float32, device=t.device) for t in server.tensors])

    def server_state(self, server: ServerView, local: LocalTraining, client_id: int) -> np.ndarray:
        state: SecondMoment = server.method_state
        if state.sent is None or state.round_id != local.round_id:  # one array for the whole round
            state.round_id, state.sent = local.round_id, state.precondition()
        return state.sent

    def observe(self, server: ServerView, local: LocalTraining, accepted: Sequence[ClientUpdate],
                sent: dict[int, np.ndarray], delta: Sequence[torch.Tensor]) -> dict[str, Any]:
        state: SecondMoment = server.method_state
        for k, d in zip(state.k, delta, strict=True):
            g_hat = d.reshape(-1) / (-local.lr * local.local_steps)
            k.mul_(BETA).addcmul_(g_hat, g_hat, value=1 - BETA)
        return {}
