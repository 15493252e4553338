"""The server's building blocks: validate uplinks, rebuild the round's mean update from seeds and scalars,
and write the downlink (roles.py puts them together into a round; server_opt.py applies the update).

The mean update of the seed-and-scalar methods is a linear combination of directions, so the server sums
every client's (seed, coefficient) terms, merges terms that share a seed, and regenerates each direction
once, streaming over tensors into one accumulator: memory does not grow with the number of clients, and
when clients share seeds (DeComFL) neither does the time. zofed's personalized steps each carry their own
block and scale, so they are added step by step, regenerating one block per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.client import LocalTraining
from zofed.fl.methods import personalized
from zofed.fl.personal import MomentumTilt, draw_block, probe_energy, step_perturbation, tensor_blocks
from zofed.fl.protocol import ClientUpdate, MessageError, ServerBroadcast, decode, step_seeds
from zofed.zo.optim import MeZO
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


def step_perturbations(update: ClientUpdate, plan: LocalTraining, perturbation: Perturbation,
                       block_pi: np.ndarray | None = None, tilt: MomentumTilt | None = None,
                       layout: np.ndarray | None = None) -> list[tuple[Perturbation, int | None]]:
    """The perturbation each of the client's steps used, and the block it drew (personalized methods).
    `layout` maps each tensor to its block (`tensor_blocks` of the plan's `blocks`)."""
    if not personalized(plan.method):
        return [(perturbation, None)] * update.grads.shape[0]
    if block_pi is None:
        raise ValueError(f"rebuilding a {plan.method} update needs the client's block distribution")
    return [step_perturbation(int(s), block_pi, perturbation.kind, perturbation.masks, tilt, layout)
            for s in step_seeds(update)]


def rebuild_client_update(global_tensors: Sequence[torch.Tensor], update: ClientUpdate, plan: LocalTraining,
                          perturbation: Perturbation, block_pi: np.ndarray | None = None,
                          tilt: MomentumTilt | None = None) -> list[torch.Tensor]:
    """One client's local update, replayed from its seeds and scalars (as the client computed it)."""
    if update.dense is not None:
        return unflatten(update.dense, global_tensors)
    tensors = [t.clone() for t in global_tensors]
    optimizer = MeZO()
    state = optimizer.init(tensors)
    layout = tensor_blocks(global_tensors, plan.blocks) if personalized(plan.method) else None
    steps = step_perturbations(update, plan, perturbation, block_pi, tilt, layout)
    for record, (pert, _) in zip(client_records(update), steps, strict=True):
        state = optimizer.apply(tensors, state, record.grad_terms(), [], plan.lr, pert)
    return [t - g for t, g in zip(tensors, global_tensors, strict=True)]


def mean_update(global_tensors: Sequence[torch.Tensor], updates: Sequence[ClientUpdate], plan: LocalTraining,
                perturbation: Perturbation, block_pis: Mapping[int, np.ndarray] | None = None,
                tilt: MomentumTilt | None = None) -> list[torch.Tensor]:
    """The example-weighted mean of the clients' local updates, streaming into one accumulator.
    `block_pis` maps client id to the block distribution it was sent, `tilt` is the momentum every client
    of the round was sent (personalized methods)."""
    if not updates:
        raise ValueError("no accepted client update to aggregate")
    total = sum(u.num_examples for u in updates)
    mean = [torch.zeros_like(t) for t in global_tensors]
    terms: list[tuple[int, float]] = []
    layout = tensor_blocks(global_tensors, plan.blocks) if personalized(plan.method) else None
    for update in updates:
        weight = update.num_examples / total
        if update.dense is not None:
            for m, d in zip(mean, unflatten(update.dense, global_tensors), strict=True):
                m.add_(d, alpha=weight)
            continue
        if personalized(plan.method):  # one block a step, each with its own scale: added step by step
            pi = (block_pis or {}).get(update.client_id)
            steps = step_perturbations(update, plan, perturbation, pi, tilt, layout)
            for record, (pert, _) in zip(client_records(update), steps, strict=True):
                add_directions_(mean, [(s, -plan.lr * g * weight) for s, g in record.grad_terms()], pert)
            continue
        for record in client_records(update):
            terms += [(seed, -plan.lr * g * weight) for seed, g in record.grad_terms()]
    if terms:
        add_directions_(mean, terms, perturbation)  # merges shared seeds: one regeneration per direction
    return mean


def block_probes(update: ClientUpdate, plan: LocalTraining, block_pi: np.ndarray) -> tuple[list[int], list[float]]:
    """The blocks a personalized client's steps drew and their energy estimates pi_b g^2 (mean over queries)."""
    blocks = [draw_block(int(s), block_pi) for s in step_seeds(update)]
    energies = [float(np.mean([probe_energy(g, block_pi, b) for g in row])) for b, row in zip(blocks, update.grads,
                                                                                         strict=True)]
    return blocks, energies


def unflatten(dense: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a flat float32 vector (dense uplink, weights downlink) into tensors shaped like `like`."""
    flat = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    out, start = [], 0
    for t in like:
        out.append(flat[start:start + t.numel()].view_as(t).clone())
        start += t.numel()
    return out


def broadcast(round_id: int, tensors: Sequence[torch.Tensor], config: dict,
              server_state: np.ndarray | None = None) -> ServerBroadcast:
    """The downlink of a round: the trainable weights (every server optimizer supports it), the round's
    plan as config, and `server_state` (a personalized client's block distribution)."""
    weights = torch.cat([t.reshape(-1) for t in tensors]).numpy().astype(np.float32)
    empty_u64 = np.zeros(0, np.uint64)
    state = np.zeros(0, np.float32) if server_state is None else server_state.astype(np.float32)
    return ServerBroadcast(round_id, "weights", empty_u64, empty_u64, np.zeros(0, np.float32), state, weights, config)
