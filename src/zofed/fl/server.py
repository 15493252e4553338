"""The server's building blocks: validate uplinks against the round plan, write downlinks, and rebuild one
client's update exactly (roles.py puts them together into a round, aggregate.py combines the clients' updates,
server_opt.py applies the result).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.methods.base import Method, StepSeeds, step_records
from zofed.fl.plan import LocalTraining
from zofed.fl.protocol import ClientUpdate, MessageError, ServerBroadcast, decode, uplink_max_bytes
from zofed.zo.perturb import Perturbation
from zofed.zo.step import StepRecord


@dataclass
class RoundInbox:
    """Uplinks received in one round: accepted updates, and rejections with their reasons."""

    accepted: list[ClientUpdate] = field(default_factory=list)
    rejected: list[tuple[int | None, str]] = field(default_factory=list)  # (client id if known, reason)
    bytes_up: list[int] = field(default_factory=list)


def receive(inbox: RoundInbox, data: bytes, round_id: int, client_id: int, local: LocalTraining,
            num_trainable: int, dense: bool, seeds: StepSeeds | None) -> None:
    """Decode and check one uplink against what this round asked of this client (`dense`: the method uploads
    dense updates; `seeds`: the step seeds it assigned the client, None for a dense uplink); a bad one is
    recorded, never raised."""
    inbox.bytes_up.append(len(data))
    try:
        # the plan says how large the uplink can be: anything larger is refused before any parsing
        bound = uplink_max_bytes(local.local_steps, local.queries, num_trainable if dense else None)
        update = decode(data, expect_round=round_id, expect_client=client_id, max_bytes=bound)
        _check_against_round(update, local, num_trainable, dense, seeds)
    except MessageError as err:
        inbox.rejected.append((client_id, f"{err.reason}: {err}"))
        return
    inbox.accepted.append(update)


def _check_against_round(update: ClientUpdate, local: LocalTraining, num_trainable: int, dense: bool,
                         seeds: StepSeeds | None) -> None:
    if (update.dense is not None) != dense:
        raise MessageError("shape", f"{local.method} uploads {'a dense update' if dense else 'seeds and scalars'}, "
                                    f"this uplink {'a dense update' if update.dense is not None else 'scalars'}")
    if update.num_examples < 1:  # every uplink is weighted by it: none may weigh nothing
        raise MessageError("bad_field", "num_examples must be at least 1")
    if update.dense is not None:
        if update.dense.size != num_trainable:
            raise MessageError("shape", f"dense update has {update.dense.size} values, the model {num_trainable}")
        if update.base_seed is not None or update.seeds.size:
            raise MessageError("seeds", f"{local.method} uploads a dense update, which names no step seeds")
        if update.grads.size:
            raise MessageError("shape", f"a dense update carries no scalars, this one {update.grads.size}")
        return
    if update.grads.shape != (local.local_steps, local.queries):
        raise MessageError("shape", f"grads shape {update.grads.shape}, round asked for "
                                    f"{(local.local_steps, local.queries)}")
    if seeds is None:
        raise TypeError("a seed-and-scalar uplink is checked against the seeds its method assigned the client")
    _check_seeds(update, local, seeds)


def _check_seeds(update: ClientUpdate, local: LocalTraining, assigned: StepSeeds) -> None:
    """The uplink must name exactly the step seeds the method assigned this client, the way the method names them:
    a client that picks its own seeds chooses its directions (grinding seeds towards an attack, a seed outside
    FedKSeed's pool, zofed's block through the seed)."""
    if assigned.explicit:
        if update.base_seed is not None:
            raise MessageError("seeds", f"{local.method} lists each step's seed; this uplink names a base seed")
        differ = np.flatnonzero(update.seeds != np.asarray(assigned.seeds, np.uint64))
        if differ.size:
            raise MessageError("seeds", f"{differ.size} of {update.seeds.size} step seeds are not the ones assigned "
                                        f"to this client (the first at step {int(differ[0])})")
    elif update.base_seed is None:
        raise MessageError("seeds", f"{local.method} names the steps' seeds by their base seed; this uplink lists "
                                    f"{update.seeds.size} seeds")
    elif update.base_seed != assigned.base_seed:
        raise MessageError("seeds", f"base seed {update.base_seed} is not the one assigned to this client")


ClientSteps = Iterator[tuple[StepRecord, Perturbation]]  # a seed-and-scalar uplink's steps, each with its directions


def client_steps(method: Method, start: Sequence[torch.Tensor], update: ClientUpdate, local: LocalTraining,
                 masks: Sequence[torch.Tensor | None] | None = None,
                 sent_state: np.ndarray | None = None) -> ClientSteps:
    """One client's local steps as the server reads them from its uplink, in order: each step's record (seed,
    scalars) with the perturbation its directions were drawn from, made as they are read (none for a dense
    upload)."""
    if update.dense is not None:
        return iter(())
    records = step_records(update)
    state_in = np.zeros(0, np.float32) if sent_state is None else sent_state
    return zip(records, method.perturbations(local, start, masks, [r.seed for r in records], state_in), strict=True)


def rebuild_client_update(method: Method, start: Sequence[torch.Tensor], update: ClientUpdate, local: LocalTraining,
                          masks: Sequence[torch.Tensor | None] | None = None,
                          sent_state: np.ndarray | None = None) -> list[torch.Tensor]:
    """One client's local update, replayed step by step from its seeds and scalars with the round's local
    optimizer as the client applied it (bit for bit), or its dense upload."""
    if update.dense is not None:
        return unflatten(update.dense, start)
    tensors = [t.clone() for t in start]
    optimizer = local.local_optimizer()
    state = optimizer.init(tensors)
    for record, pert in client_steps(method, start, update, local, masks, sent_state):
        state = optimizer.apply(tensors, state, record.grad_terms(), [], local.lr, pert)
    return [t - s for t, s in zip(tensors, start, strict=True)]


def unflatten(dense: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a flat float32 vector (dense uplink, weights downlink) into tensors shaped like `like`."""
    flat = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
    out, start = [], 0
    for t in like:
        out.append(flat[start:start + t.numel()].view_as(t).to(t.device, copy=True))
        start += t.numel()
    return out


def broadcast(round_id: int, tensors: Sequence[torch.Tensor], config: dict,
              server_state: np.ndarray | None = None) -> ServerBroadcast:
    """The downlink of a round: the trainable weights, the round plan as config, and `server_state` (what the
    method sends this client, e.g. zofed's block distribution)."""
    weights = torch.cat([t.reshape(-1) for t in tensors]).cpu().numpy().astype(np.float32)
    state = np.zeros(0, np.float32) if server_state is None else server_state.astype(np.float32)
    return ServerBroadcast(round_id, state, weights, config)
