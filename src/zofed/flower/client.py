"""The ClientApp side: one zofed client per SuperNode, its partition named by the node config.

A process builds the model, the data and the partition once (the same `build` and `client_splits` as the
in-process engine, so every node derives the same partition from the same config) and keeps them for the
messages that follow: Flower's simulation reuses its worker processes across rounds; a deployed SuperNode
starts one ClientApp process per message, which then pays the build every round (docs/flower.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Context, Message

from zofed.flower.messages import (
    NUM_PARTITIONS,
    PARTITION_ID,
    partition_content,
    read_train,
    uplink_content,
)
from zofed.flower.secure import is_secure_train, read_secure_train, secure_reply


@dataclass
class ClientWorker:
    role: Any  # zofed.fl.roles.ClientRole, imported lazily: a query needs neither torch nor the model
    indices: list[np.ndarray]  # training examples of each client id


@functools.lru_cache(maxsize=2)
def client_worker(text: str) -> ClientWorker:
    """Build once per process and config text: the model replica, the encoded data, every client's examples."""
    from zofed.data.partition import client_splits
    from zofed.fl.client import ClientContext
    from zofed.flower.config import parse_config_text
    from zofed.run.federated import make_client_role
    from zofed.run.setup import build

    config = parse_config_text(text)
    setup = build(config)
    splits = client_splits(setup.train_data, config.federation.partition)
    ctx = ClientContext(setup.model, setup.trainable, setup.task, setup.train, setup.train_body)
    role = make_client_role(config, ctx, len(splits), setup.label_names)
    return ClientWorker(role, [s.train for s in splits])


def node_partition(node_config: Mapping[str, Any]) -> tuple[int, int]:
    """(partition id, number of partitions) from a SuperNode's node config; ValueError naming what is missing."""
    missing = [k for k in (PARTITION_ID, NUM_PARTITIONS) if k not in node_config]
    if missing:
        raise ValueError(f"this SuperNode's node config lacks {', '.join(missing)}: start it with "
                         f"--node-config \"{PARTITION_ID}=<id> {NUM_PARTITIONS}=<clients>\"")
    return int(node_config[PARTITION_ID]), int(node_config[NUM_PARTITIONS])


def answer_query(message: Message, context: Context) -> Message:
    return Message(partition_content(*node_partition(context.node_config)), reply_to=message)


def train_client(message: Message, context: Context, text: str | None = None) -> Message:
    """Decode the downlink, train this node's client, reply with the encoded uplink. `text` is the run's config
    YAML (the simulation's); without it the config is the run config's `zofed-config` with its flat keys laid
    over it, as the ServerApp resolves it. Errors propagate: Flower turns them into an error reply that the
    server counts. A secure round's message (flower/secure.py) is answered in the layout SecAgg+ masks."""
    secure = is_secure_train(message)
    if secure:
        downlink, client_id, round_id, scalar_range = read_secure_train(message)
    else:
        downlink, client_id, round_id = read_train(message)
    partition_id, _ = node_partition(context.node_config)
    if client_id != partition_id:
        raise ValueError(f"asked to train client {client_id}, but this SuperNode holds partition {partition_id}")
    if text is None:
        from zofed.flower.config import config_text, resolve_run_config

        text = config_text(resolve_run_config(context.run_config))  # the resolved text keys the worker cache
    worker = client_worker(text)
    if not 0 <= client_id < len(worker.indices):
        raise ValueError(f"client {client_id} is outside the partition's {len(worker.indices)} clients")
    uplink = worker.role.train(downlink, client_id, worker.indices[client_id], round_id)
    if secure:
        return secure_reply(message, uplink, scalar_range)
    return Message(uplink_content(uplink, client_id), reply_to=message)
