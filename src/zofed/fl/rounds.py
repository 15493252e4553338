"""One federated round, whatever carries its messages: the in-process engine and the Flower backend both call
`run_round` and differ only in `deliver`, which takes the round's downlinks and returns each client's reply.

    local = server.round_plan(r); sampled = server.sample(r)
    downlinks = [(c, server.downlink(local, c)) for c in sampled]
    replies = deliver(r, downlinks)                   # uplink bytes, or a Failure with its reason
    every reply, in ascending client id: server.receive(...)   (the aggregate sums in one order everywhere)
    fewer accepted than `min_accepted`: RoundFailed, the model untouched
    server.aggregate(local, inbox)

The round record (metrics every backend writes) counts bytes from the encoded messages and client compute in
forward passes of the full model (the method's count: two per ZO query and step, three per back-propagated step).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from zofed.fl.privacy import epsilon_spent
from zofed.fl.roles import ServerRole
from zofed.fl.server import RoundInbox


@dataclass(frozen=True)
class Failure:
    """A client that gave no usable reply; `reason` starts with a short code (missing, client_error, ...)."""

    reason: str


@dataclass(frozen=True)
class Summed:
    """A client whose uplink reached the server only inside client `into`'s reply: a secure sum of the round's
    scalars (flower/secure.py). It counts as accepted; its numbers are in that one uplink."""

    into: int


Deliver = Callable[[int, Sequence[tuple[int, bytes]]], dict[int, "bytes | Failure | Summed"]]


class RoundFailed(RuntimeError):
    """Too few clients of a round gave a usable uplink; `record` is the round's record (nothing was applied)."""

    def __init__(self, message: str, record: dict) -> None:
        super().__init__(message)
        self.record = record


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_round(server: ServerRole, round_id: int, deliver: Deliver, *, min_accepted: int = 0) -> dict:
    """Plan, deliver, receive and aggregate one round; returns its record."""
    t0 = time.perf_counter()
    local = server.round_plan(round_id)
    sampled = server.sample(round_id)
    downlinks = [(c, server.downlink(local, c)) for c in sampled]
    replies = deliver(round_id, downlinks)
    inbox = RoundInbox()
    summed = 0  # clients whose scalars came inside another's secure sum
    for client_id in sampled:
        reply = replies.get(client_id, Failure("missing: no reply"))
        if isinstance(reply, Failure):
            inbox.rejected.append((client_id, reply.reason))
        elif isinstance(reply, Summed):
            summed += 1
        else:
            server.receive(inbox, local, client_id, reply)
    carriers = {r.into for r in replies.values() if isinstance(r, Summed)}
    if summed and not any(u.client_id in carriers for u in inbox.accepted):  # the sum was refused: so were its parts
        inbox.rejected.extend((c, "the secure sum holding its scalars was refused") for c in sampled
                              if isinstance(replies.get(c), Summed))
        summed = 0
    # Under DP a client's train loss is no part of what the accountant covers: the record leaves it out (NaN)
    losses = [] if server.dp_noise is not None else \
        [u.metrics["train_loss"] for u in inbox.accepted if "train_loss" in u.metrics]
    charges = [server.client_passes(local, c) for c in sampled]
    server.spent += sum(charges)
    record = {"round": round_id + 1, "clients": sampled, "accepted": len(inbox.accepted) + summed,
              "rejected": [{"client": c, "reason": r} for c, r in inbox.rejected],
              "bytes_up_per_client": float(np.mean(inbox.bytes_up)) if inbox.bytes_up else 0.0,
              "bytes_down_per_client": float(np.mean([len(d) for _, d in downlinks])),
              "train_loss": float(np.mean(losses)) if losses else float("nan"),
              "forward_passes_per_client": float(np.mean(charges)),
              "forward_passes": server.spent}  # the run's so far
    if summed:
        record["secure_sum_of"] = len(inbox.accepted) + summed
    if len(inbox.accepted) + summed < min_accepted:
        record.update(round_seconds=round(time.perf_counter() - t0, 3), peak_rss_mib=peak_rss_mib())
        reasons = "; ".join(f"client {c}: {r}" for c, r in inbox.rejected)
        raise RoundFailed(f"round {round_id + 1}: {len(inbox.accepted) + summed} of {len(sampled)} sampled clients "
                          f"gave a usable uplink, fewer than the {min_accepted} the round needs ({reasons})", record)
    server.aggregate(local, inbox)
    if server.clip_norm is not None and server.dp_noise is None:  # under DP, whose norms were over C is unaccounted
        record["clipped"] = server.last_clipped
    if server.dp_noise is not None:  # the privacy spent so far, for the delta the run set
        plan = server.plan
        record["dp_epsilon"] = epsilon_spent(server.dp_noise, plan.num_clients, plan.clients_per_round, round_id + 1,
                                             server.dp_delta)
    if server.screen is not None:  # screened uplinks count as rejected
        record["screened"] = server.last_screened
        record["accepted"] = len(inbox.accepted)
        record["rejected"] = [{"client": c, "reason": r} for c, r in inbox.rejected]
    record.update(round_seconds=round(time.perf_counter() - t0, 3),
                  aggregate_seconds=round(sum(server.last_seconds.values()), 4), peak_rss_mib=peak_rss_mib())
    return record
