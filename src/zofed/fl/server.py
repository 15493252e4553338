"""The server role: validate uplinks, rebuild the round's mean update from seeds and scalars, apply a server
optimizer, and produce the downlink.

The mean update of the seed-and-scalar methods is a linear combination of directions, so the server sums
every client's (seed, coefficient) terms, merges terms that share a seed, and regenerates each direction
once, streaming over tensors into one accumulator: memory does not grow with the number of clients, and
when clients share seeds (DeComFL) neither does the time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from zofed.fl.client import LocalTraining
from zofed.fl.protocol import ClientUpdate, MessageError, ServerBroadcast, decode, step_seeds
from zofed.zo.optim import MeZO, OptState
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.step import StepRecord


@dataclass
class RoundInbox:
    """Uplinks received in one round: accepted updates, and rejections with their reasons."""

    accepted: list[ClientUpdate] = field(default_factory=list)
    rejected: list[tuple[int | None, str]] = field(default_factory=list)  # (client id if known, reason)
    bytes_up: list[int] = field(default_factory=list)


def receive(inbox: RoundInbox, data: bytes, round_id: int, client_id: int, plan: LocalTraining,
            num_trainable: int) -> None:
    """Decode and check one uplink against what this round asked for; a bad one is recorded, never raised."""
    inbox.bytes_up.append(len(data))
    try:
        update = decode(data, expect_round=round_id, expect_client=client_id, max_bytes=64 * 2**20 + 8 * num_trainable)
        _check_against_plan(update, plan, num_trainable)
    except MessageError as err:
        inbox.rejected.append((client_id, f"{err.reason}: {err}"))
        return
    inbox.accepted.append(update)


def _check_against_plan(update: ClientUpdate, plan: LocalTraining, num_trainable: int) -> None:
    if update.dense is not None:
        if update.dense.size != num_trainable:
            raise MessageError("shape", f"dense update has {update.dense.size} values, the model {num_trainable}")
        return
    if update.grads.shape != (plan.local_steps, plan.queries):
        raise MessageError("shape", f"grads shape {update.grads.shape}, round asked for "
                                    f"{(plan.local_steps, plan.queries)}")
    if update.num_examples < 1:
        raise MessageError("bad_field", "num_examples must be at least 1")


def client_records(update: ClientUpdate) -> list[StepRecord]:
    """The client's local steps as records a local optimizer can replay."""
    seeds = step_seeds(update)
    return [StepRecord(step=t, seed=int(seeds[t]), grads=tuple(float(g) for g in update.grads[t]), loss=math.nan)
            for t in range(update.grads.shape[0])]


def rebuild_client_update(global_tensors: Sequence[torch.Tensor], update: ClientUpdate, plan: LocalTraining,
                          perturbation: Perturbation) -> list[torch.Tensor]:
    """One client's local update, replayed from its seeds and scalars (as the client computed it)."""
    if update.dense is not None:
        return unflatten(update.dense, global_tensors)
    tensors = [t.clone() for t in global_tensors]
    optimizer = MeZO()
    state = optimizer.init(tensors)
    for record in client_records(update):
        state = optimizer.apply(tensors, state, record.grad_terms(), [], plan.lr, perturbation)
    return [t - g for t, g in zip(tensors, global_tensors, strict=True)]


def mean_update(global_tensors: Sequence[torch.Tensor], updates: Sequence[ClientUpdate], plan: LocalTraining,
                perturbation: Perturbation) -> list[torch.Tensor]:
    """The example-weighted mean of the clients' local updates, streaming into one accumulator."""
    if not updates:
        raise ValueError("no accepted client update to aggregate")
    total = sum(u.num_examples for u in updates)
    mean = [torch.zeros_like(t) for t in global_tensors]
    terms: list[tuple[int, float]] = []
    for update in updates:
        weight = update.num_examples / total
        if update.dense is not None:
            for m, d in zip(mean, unflatten(update.dense, global_tensors), strict=True):
                m.add_(d, alpha=weight)
            continue
        for record in client_records(update):
            terms += [(seed, -plan.lr * g * weight) for seed, g in record.grad_terms()]
    if terms:
        add_directions_(mean, terms, perturbation)  # merges shared seeds: one regeneration per direction
    return mean


def unflatten(dense: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a flat float32 vector (dense uplink, weights downlink) into tensors shaped like `like`."""
    flat = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    out, start = [], 0
    for t in like:
        out.append(flat[start:start + t.numel()].view_as(t).clone())
        start += t.numel()
    return out


@dataclass(frozen=True)
class ServerOptimizer:
    """Applies the mean update as a pseudo-gradient: `sgd` (lr 1 is plain FedAvg of updates) or `adam`
    (FedAdam-style per-coordinate adaptive step on the pseudo-gradient)."""

    name: str = "sgd"
    lr: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-6

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        if self.name == "sgd":
            return OptState()
        if self.name == "adam":
            return OptState(buffers={"m": [torch.zeros_like(t) for t in tensors],
                                     "v": [torch.zeros_like(t) for t in tensors]})
        raise ValueError(f"unknown server optimizer {self.name!r}; choose sgd or adam")

    def apply(self, tensors: Sequence[torch.Tensor], state: OptState, delta: Sequence[torch.Tensor]) -> OptState:
        with torch.no_grad():
            if self.name == "sgd":
                for t, d in zip(tensors, delta, strict=True):
                    t.add_(d, alpha=self.lr)
                return replace(state, step=state.step + 1)
            for t, d, m, v in zip(tensors, delta, state.buffers["m"], state.buffers["v"], strict=True):
                m.mul_(self.beta1).add_(d, alpha=1 - self.beta1)
                v.mul_(self.beta2).addcmul_(d, d, value=1 - self.beta2)
                t.addcdiv_(m, v.sqrt().add_(self.tau), value=self.lr)
            return replace(state, step=state.step + 1)


def broadcast(round_id: int, tensors: Sequence[torch.Tensor], config: dict) -> ServerBroadcast:
    """The downlink of the next round: the new trainable weights (every server optimizer supports it)."""
    weights = torch.cat([t.reshape(-1) for t in tensors]).numpy().astype(np.float32)
    empty_u64, empty_f32 = np.zeros(0, np.uint64), np.zeros(0, np.float32)
    return ServerBroadcast(round_id, "weights", empty_u64, empty_u64, empty_f32, empty_f32, weights, config)
