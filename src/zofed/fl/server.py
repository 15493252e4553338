"""The server's building blocks: validate uplinks against the round plan, write downlinks, and rebuild one
client's update exactly (roles.py puts them together into a round, aggregate.py combines the clients' updates,
server_opt.py applies the result).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.methods.base import Method, step_records
from zofed.fl.plan import LocalTraining
from zofed.fl.protocol import ClientUpdate, MessageError, ServerBroadcast, decode
from zofed.zo.perturb import Perturbation
from zofed.zo.step import StepRecord


@dataclass
class RoundInbox:
    """Uplinks received in one round: accepted updates, and rejections with their reasons."""

    accepted: list[ClientUpdate] = field(default_factory=list)
    rejected: list[tuple[int | None, str]] = field(default_factory=list)  # (client id if known, reason)
    bytes_up: list[int] = field(default_factory=list)


def receive(inbox: RoundInbox, data: bytes, round_id: int, client_id: int, local: LocalTraining,
            num_trainable: int, dense: bool) -> None:
    """Decode and check one uplink against what this round asked for (`dense`: the method uploads dense
    updates); a bad one is recorded, never raised."""
    inbox.bytes_up.append(len(data))
    try:
        update = decode(data, expect_round=round_id, expect_client=client_id, max_bytes=64 * 2**20 + 8 * num_trainable)
        _check_against_round(update, local, num_trainable, dense)
    except MessageError as err:
        inbox.rejected.append((client_id, f"{err.reason}: {err}"))
        return
    inbox.accepted.append(update)


def _check_against_round(update: ClientUpdate, local: LocalTraining, num_trainable: int, dense: bool) -> None:
    if (update.dense is not None) != dense:
        raise MessageError("shape", f"{local.method} uploads {'a dense update' if dense else 'seeds and scalars'}, "
                                    f"this uplink {'a dense update' if update.dense is not None else 'scalars'}")
    if update.dense is not None:
        if update.dense.size != num_trainable:
            raise MessageError("shape", f"dense update has {update.dense.size} values, the model {num_trainable}")
        return
    if update.grads.shape != (local.local_steps, local.queries):
        raise MessageError("shape", f"grads shape {update.grads.shape}, round asked for "
                                    f"{(local.local_steps, local.queries)}")
    if update.num_examples < 1:
        raise MessageError("bad_field", "num_examples must be at least 1")


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
