"""The in-process federated engine: one model replica serves every simulated client in turn.

Per-client state is an index array into the shared encoded data; everything that crosses the "wire" is
really encoded and decoded (so byte counts are measured, and validation runs as it would on a network).
Client sampling, batches and seeds derive from (run seed, round, client, step): a run repeats bit for bit.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.client import ClientContext, LocalTraining, load_tensors_, run_client
from zofed.fl.first_order import FIRST_ORDER_METHODS, run_first_order_client
from zofed.fl.protocol import decode, encode
from zofed.fl.server import RoundInbox, ServerOptimizer, broadcast, mean_update, receive, unflatten
from zofed.zo.optim import OptState
from zofed.zo.perturb import Perturbation

Tamper = Callable[[int, int, bytes], bytes]  # (round, client, uplink bytes) -> bytes actually delivered


@dataclass
class SimulationResult:
    global_tensors: list[torch.Tensor]
    history: list[dict] = field(default_factory=list)


def sample_clients(run_seed: int, round_id: int, num_clients: int, per_round: int) -> list[int]:
    rng = np.random.default_rng([run_seed, round_id, 11])
    return sorted(int(c) for c in rng.choice(num_clients, size=min(per_round, num_clients), replace=False))


def simulate(ctx: ClientContext, client_indices: Sequence[np.ndarray], *, method: str, rounds: int,
             clients_per_round: int, local_steps: int, lr: float, eps: float, run_seed: int = 0,
             batch_size: int = 16, queries: int = 1, noise: str = "rademacher", pool_size: int = 0,
             server_optimizer: ServerOptimizer | None = None, first_order_optimizer: str = "adamw",
             evaluate: Callable[[int], dict[str, float]] | None = None, tamper: Tamper | None = None,
             on_round: Callable[[dict], None] | None = None, start_round: int = 0,
             server_state: OptState | None = None,
             on_checkpoint: Callable[[int, list[torch.Tensor], OptState], None] | None = None) -> SimulationResult:
    """Run rounds `start_round`..`rounds`-1 from the model's current trainable tensors; returns the final
    global tensors and per-round records. `on_checkpoint(rounds_done, tensors, server_state)` follows
    every round, so a run can resume from `start_round` with the saved tensors and state."""
    server_optimizer = server_optimizer or ServerOptimizer()
    global_tensors = [t.clone() for t in ctx.trainable.tensors()]
    server_state = server_state if server_state is not None else server_optimizer.init(global_tensors)
    num_trainable = sum(t.numel() for t in global_tensors)
    perturbation = Perturbation(kind=noise, masks=ctx.trainable.masks)
    result = SimulationResult(global_tensors)
    for round_id in range(start_round, rounds):
        t0 = time.perf_counter()
        plan = LocalTraining(method, run_seed, round_id, local_steps, lr, eps, queries, batch_size, noise, pool_size)
        downlink = encode(broadcast(round_id, global_tensors, {"lr": lr, "local_steps": local_steps}))
        received = decode(downlink, expect_round=round_id, max_bytes=len(downlink))
        start = unflatten(received.weights, global_tensors)
        inbox = RoundInbox()
        sampled = sample_clients(run_seed, round_id, len(client_indices), clients_per_round)
        losses = []
        for client_id in sampled:
            if method in FIRST_ORDER_METHODS:
                update, _ = run_first_order_client(ctx, start, client_id, client_indices[client_id], plan,
                                                   first_order_optimizer)
            else:
                update, _ = run_client(ctx, start, client_id, client_indices[client_id], plan)
            losses.append(update.metrics["train_loss"])
            data = encode(update)
            if tamper is not None:
                data = tamper(round_id, client_id, data)
            receive(inbox, data, round_id, client_id, plan, num_trainable)
        if inbox.accepted:
            delta = mean_update(global_tensors, inbox.accepted, plan, perturbation)
            server_state = server_optimizer.apply(global_tensors, server_state, delta)
        load_tensors_(ctx.trainable.tensors(), global_tensors)
        record = {"round": round_id + 1, "clients": sampled, "accepted": len(inbox.accepted),
                  "rejected": [{"client": c, "reason": r} for c, r in inbox.rejected],
                  "bytes_up_per_client": float(np.mean(inbox.bytes_up)), "bytes_down_per_client": len(downlink),
                  "train_loss": float(np.mean(losses)),
                  "forward_passes": 2 * queries * local_steps * len(sampled) * (round_id + 1),
                  "round_seconds": round(time.perf_counter() - t0, 3),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        if evaluate is not None:
            record.update(evaluate(round_id + 1))
        result.history.append(record)
        if on_checkpoint is not None:
            on_checkpoint(round_id + 1, global_tensors, server_state)
        if on_round is not None:
            on_round(record)
    return result
