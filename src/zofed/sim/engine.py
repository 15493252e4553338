"""The in-process federated engine: one model replica serves every simulated client in turn.

It drives the same server and client roles as every other backend (fl/roles.py), so everything that
crosses the "wire" is really encoded and decoded: byte counts are measured, and validation runs as it
would on a network. Per-client state is an index array into the shared encoded data and a few block
statistics on the server. Client sampling, batches and seeds derive from (run seed, round, client, step):
a run repeats bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.client import ClientContext
from zofed.fl.personal import BlockSampling
from zofed.fl.protocol import decode
from zofed.fl.roles import ClientRole, FederationPlan, ServerRole, round_record, sample_clients
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import ServerOptimizer

__all__ = ["SimulationResult", "sample_clients", "simulate"]

Tamper = Callable[[int, int, bytes], bytes]  # (round, client, uplink bytes) -> bytes actually delivered


@dataclass
class SimulationResult:
    global_tensors: list[torch.Tensor]
    history: list[dict] = field(default_factory=list)
    server: ServerRole | None = None


def simulate(ctx: ClientContext, client_indices: Sequence[np.ndarray], *, method: str, rounds: int,
             clients_per_round: int, local_steps: int, lr: float, eps: float, run_seed: int = 0,
             batch_size: int = 16, queries: int = 1, noise: str = "rademacher", pool_size: int = 0,
             server_optimizer: ServerOptimizer | None = None, sampling: BlockSampling | None = None,
             first_order_optimizer: str = "adamw", evaluate: Callable[[int], dict[str, float]] | None = None,
             tamper: Tamper | None = None, on_round: Callable[[dict], None] | None = None, start_round: int = 0,
             server: ServerRole | None = None,
             on_checkpoint: Callable[[int, ServerRole], None] | None = None) -> SimulationResult:
    """Run rounds `start_round`..`rounds`-1; returns the final global tensors and per-round records.

    Pass `server` (restored from a checkpoint) to continue a run; otherwise the server starts from the
    model's current trainable tensors. `on_checkpoint(rounds_done, server)` follows every round.
    """
    plan = FederationPlan(method, len(client_indices), clients_per_round, local_steps, lr, eps, run_seed, queries,
                          batch_size, noise, pool_size)
    if server is None:
        server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks, server_optimizer, sampling)
    client = ClientRole(ctx, first_order_optimizer)
    result = SimulationResult(server.tensors, server=server)
    for round_id in range(start_round, rounds):
        t0 = time.perf_counter()
        round_plan = server.round_plan(round_id)
        inbox, losses, bytes_down = RoundInbox(), [], []
        sampled = server.sample(round_id)
        for client_id in sampled:
            downlink = server.downlink(round_plan, client_id)
            bytes_down.append(len(downlink))
            uplink = client.train(downlink, client_id, client_indices[client_id], round_id)
            losses.append(decode(uplink).metrics["train_loss"])
            if tamper is not None:
                uplink = tamper(round_id, client_id, uplink)
            server.receive(inbox, round_plan, client_id, uplink)
        server.aggregate(round_plan, inbox)
        client.load_global(server.tensors)
        record = round_record(round_plan, sampled, inbox, bytes_down, losses, time.perf_counter() - t0)
        if evaluate is not None:
            record.update(evaluate(round_id + 1))
        result.history.append(record)
        if on_checkpoint is not None:
            on_checkpoint(round_id + 1, server)
        if on_round is not None:
            on_round(record)
    result.global_tensors = server.tensors
    return result
