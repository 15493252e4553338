"""The ServerApp side: find the SuperNodes and the partition each holds, then drive zofed's rounds over a
Flower Grid with the shared server role.

Each round is the shared `run_round` (fl/rounds.py) with Flower delivering the messages: replies arrive in any
order and are received in ascending client id, as in the in-process engine, so the same config and seeds give
the same model. Nothing is swallowed: a client error, a reply that is not a zofed uplink and a reply that does not come
within `flower.reply_timeout` are each recorded in the round's `rejected` list with a reason and counted; a
round with fewer usable uplinks than `flower.min_clients` stops the run with an error naming them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from zofed.fl.client import load_tensors_
from zofed.fl.protocol import uplink_max_bytes
from zofed.fl.rounds import Failure, RoundFailed, Summed, run_round
from zofed.flower.messages import QUERY, TRAIN, error_reason, flower_nbytes, read_partition, read_uplink, train_content
from zofed.flower.secure import secure_deliver
from zofed.run.federated import FederatedRun

log = logging.getLogger("zofed.flower")


class FederationError(RuntimeError):
    """The Flower federation cannot go on: too few SuperNodes, a partition held twice, too few replies."""


def min_clients(run: FederatedRun) -> int:
    """Usable uplinks a round needs: `flower.min_clients`, or every sampled client when unset."""
    fed, flower = run.config.federation, run.config.flower
    sampled = min(fed.clients_per_round, len(run.splits))
    if flower.min_clients is None:
        return sampled
    if flower.min_clients > sampled:
        raise FederationError(f"flower.min_clients={flower.min_clients} is more than the {sampled} clients a "
                              f"round samples (federation.clients_per_round)")
    return flower.min_clients


def connect_clients(grid: Grid, num_clients: int, node_timeout: float) -> dict[int, int]:
    """Wait for the SuperNodes, ask each for its partition (both within `node_timeout`: the first answer may
    wait for a worker process to start); returns client id -> node id, one node a client."""
    deadline = time.monotonic() + node_timeout
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < num_clients:
        if time.monotonic() > deadline:
            raise FederationError(f"{len(nodes)} of {num_clients} SuperNodes connected within "
                                  f"{node_timeout:g} s (flower.node_timeout); one SuperNode serves one client")
        time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
    queries = [Message(RecordDict(), dst_node_id=node, message_type=QUERY) for node in nodes]
    replies = list(grid.send_and_receive(queries, timeout=max(deadline - time.monotonic(), 1.0)))
    client_node: dict[int, int] = {}
    problems = []
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            problems.append(f"node {node}: {error_reason(reply)}")
            continue
        partition_id, num_partitions = read_partition(reply)
        if num_partitions != num_clients:
            problems.append(f"node {node} says num-partitions={num_partitions}, the run's partition has {num_clients} "
                            f"clients (start every SuperNode with num-partitions={num_clients})")
        elif not 0 <= partition_id < num_clients:
            problems.append(f"node {node} holds partition-id={partition_id}, outside 0..{num_clients - 1}")
        elif partition_id in client_node:
            problems.append(f"partition-id={partition_id} is held by nodes {client_node[partition_id]} and {node}")
        else:
            client_node[partition_id] = node
    unanswered = len(nodes) - len(replies)
    if unanswered:
        problems.append(f"{unanswered} SuperNodes did not answer the partition query within {node_timeout:g} s "
                        f"of the start (flower.node_timeout)")
    absent = sorted(set(range(num_clients)) - set(client_node))
    if absent:
        problems.append(f"no SuperNode holds partition {', '.join(map(str, absent))}")
    if problems:
        raise FederationError("the SuperNodes do not cover the partition: " + "; ".join(problems))
    return client_node


def flower_round(grid: Grid, run: FederatedRun, round_id: int, client_node: dict[int, int]) -> dict:
    """One round over the grid (the shared `run_round`, delivering over Flower); aggregates and evaluates;
    returns the round's metrics record (`serve` writes it, then the checkpoint)."""
    timeout = run.config.flower.reply_timeout
    counts = {"client_errors": 0, "missing": 0}
    flower_up: list[int] = []
    flower_down: list[int] = []

    def deliver(round_id: int, downlinks) -> dict[int, bytes | Failure | Summed]:
        if run.config.flower.secure_aggregation:
            return deliver_securely(round_id, downlinks)
        sent: dict[int, Message] = {}
        for client_id, downlink in downlinks:
            message = Message(train_content(downlink, client_id, round_id), dst_node_id=client_node[client_id],
                              message_type=TRAIN, group_id=str(round_id))
            flower_down.append(flower_nbytes(message))
            sent[client_id] = message
        node_client = {node: client for client, node in client_node.items()}
        replies: dict[int, bytes | Failure] = {}
        for reply in grid.send_and_receive(list(sent.values()), timeout=timeout):
            client_id = node_client.get(reply.metadata.src_node_id)
            if client_id not in sent or client_id in replies:
                continue
            if reply.has_error():
                counts["client_errors"] += 1
                replies[client_id] = Failure(f"client_error: {error_reason(reply)}")
                continue
            try:
                replies[client_id] = read_uplink(reply)
            except ValueError as err:
                counts["client_errors"] += 1
                replies[client_id] = Failure(f"bad_reply: {err}")
                continue
            flower_up.append(flower_nbytes(reply))
        for client_id in sent.keys() - replies.keys():
            counts["missing"] += 1
            replies[client_id] = Failure(f"missing: no reply within {timeout:g} s (flower.reply_timeout)")
        return replies

    def deliver_securely(round_id: int, downlinks) -> dict[int, bytes | Failure | Summed]:
        largest = max(len(s.train) for s in run.splits)  # SecAgg+ weighs each client by its examples up to this
        local = run.server.round_plan(round_id)  # a clear part longer than this plan's uplink is refused unread
        secure = secure_deliver(grid, round_id, downlinks, client_node, run.config.flower.secagg_range, largest,
                                timeout, uplink_max_bytes(local.local_steps, local.queries))
        failed = sum(isinstance(r, Failure) for r in secure.replies.values())
        counts["client_errors"] += failed
        counts["secagg_clipped"] = secure.clipped
        # every SecAgg+ stage's messages, shared out over the round's clients
        flower_up.extend([secure.flower_bytes_up / len(downlinks)] * len(downlinks))
        flower_down.extend([secure.flower_bytes_down / len(downlinks)] * len(downlinks))
        return secure.replies

    def flower_fields(record: dict) -> dict:
        return {**record, **counts, "flower_bytes_up_per_client": float(np.mean(flower_up)) if flower_up else 0.0,
                "flower_bytes_down_per_client": float(np.mean(flower_down)) if flower_down else 0.0}

    try:
        record = run_round(run.server, round_id, deliver, min_accepted=min_clients(run))
    except RoundFailed as err:
        run.metrics.write({"step": round_id + 1, "event": "round_failed", **flower_fields(err.record)})
        raise FederationError(f"{err} (flower.min_clients)") from None
    record = flower_fields(record)
    load_tensors_(run.setup.trainable.tensors(), run.server.model_tensors())  # the model evaluated and saved
    record.update(run.evaluate(round_id + 1))
    return record


def serve(grid: Grid, run: FederatedRun, on_round: Callable[[dict], None]) -> float:
    """Connect the SuperNodes and run the remaining rounds; returns the seconds spent connecting."""
    min_clients(run)  # a config that can never be met fails before any node is asked
    t0 = time.perf_counter()
    client_node = connect_clients(grid, len(run.splits), run.config.flower.node_timeout)
    connect_seconds = time.perf_counter() - t0
    log.info("%d SuperNodes hold the %d partitions (%.1f s)", len(client_node), len(run.splits), connect_seconds)
    for round_id in range(run.start_round, run.config.federation.rounds):
        on_round(flower_round(grid, run, round_id, client_node))  # the round's records first,
        run.checkpoint(round_id + 1, run.server)  # then its checkpoint: a resume cuts the records back to it
    return connect_seconds
