"""The in-process federated engine: one model replica serves every simulated client in turn.

It runs the same round as every other backend (fl/rounds.py), so everything that crosses the "wire" is really
encoded and decoded: byte counts are measured, and validation runs as it would on a network. Per-client state
is an index array into the shared encoded data and the method's small per-client state on the server. Client
sampling, batches and seeds derive from (run seed, round, client, step): a run repeats bit for bit. A client whose
training raises (a non-finite loss, say) is its round's rejected uplink, `client_error` with the exception's first
line, as on Flower; the round goes on with the others, and a round with none keeps the model. Wherever blocks below
the trainable ones are frozen (zo.cache: prefix, or none, whose clients are charged whole passes) the engine
remembers what each example's frozen prefix gives (data/prefix_memo.py), which saves its time, not the compute a
client is charged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from zofed.fl.client import ClientContext, simulation_prefixes
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.rounds import Failure, run_round

Tamper = Callable[[int, int, bytes], bytes]  # (round, client, uplink bytes) -> bytes actually delivered


def client_error_reason(err: Exception, limit: int = 300) -> str:
    """A one-line reason for a client's failed round: the exception's type and the first line of its message."""
    lines = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


@contextmanager
def remembered_prefixes(client: ClientRole, server: ServerRole,
                        client_indices: Sequence[np.ndarray]) -> Iterator[None]:
    """While the rounds run, the clients' prefix memo (`simulation_prefixes`), shared by the honest and the
    attacking view of the data (the same token ids); a role whose context already holds one keeps it."""
    plan = server.plan
    memo = None if client.ctx.prefixes is not None else simulation_prefixes(
        client.ctx, plan.pass_fraction, plan.feature_cache, client_indices)
    views = (client.ctx, client.attack_ctx)
    if memo is not None:
        for view in views:
            view.prefixes = memo
    try:
        yield
    finally:
        if memo is not None:  # the rows are the simulation's: keep what its store lacks, free them with it
            memo.save()
            for view in views:
                view.prefixes = None


@dataclass
class SimulationResult:
    global_tensors: list[torch.Tensor]
    history: list[dict] = field(default_factory=list)


def simulate(ctx: ClientContext, client_indices: Sequence[np.ndarray], server: ServerRole, rounds: int, *,
             start_round: int = 0, evaluate: Callable[[int], dict[str, float]] | None = None,
             tamper: Tamper | None = None, on_round: Callable[[dict], None] | None = None,
             on_checkpoint: Callable[[int, ServerRole], None] | None = None,
             client: ClientRole | None = None, stop: Callable[[dict], bool] | None = None) -> SimulationResult:
    """Run rounds `start_round`..`rounds`-1 of `server`'s plan; returns the final global tensors and per-round
    records. `on_round(record)` and then `on_checkpoint(rounds_done, server)` follow every round; `client`
    replaces the honest client role built from `ctx` (a run with attackers passes its own); `stop(record)`, asked
    after a round's checkpoint, ends the run there when it says True."""
    if len(client_indices) != server.plan.num_clients:
        raise ValueError(f"{len(client_indices)} clients hold data, the plan has {server.plan.num_clients}")
    client = client or ClientRole(ctx, server.plan.first_order_optimizer)

    def deliver(round_id: int, downlinks: Sequence[tuple[int, bytes]]) -> dict[int, bytes | Failure]:
        replies: dict[int, bytes | Failure] = {}
        for client_id, downlink in downlinks:
            try:
                uplink = client.train(downlink, client_id, client_indices[client_id], round_id)
            except Exception as err:  # a client that fails is its round's rejection, as on Flower
                replies[client_id] = Failure(f"client_error: {client_error_reason(err)}")
                continue
            replies[client_id] = uplink if tamper is None else tamper(round_id, client_id, uplink)
        return replies

    result = SimulationResult(server.tensors)
    with remembered_prefixes(client, server, client_indices):
        for round_id in range(start_round, rounds):
            record = run_round(server, round_id, deliver)
            client.load_global(server.model_tensors())  # the model evaluated (clients start from their downlink)
            if evaluate is not None:
                record.update(evaluate(round_id + 1))
            result.history.append(record)
            if on_round is not None:  # the round's records first: a checkpoint never gets ahead of them
                on_round(record)
            if on_checkpoint is not None:
                on_checkpoint(round_id + 1, server)
            if stop is not None and stop(record):
                break
    result.global_tensors = server.model_tensors()
    return result
