"""zofed's encoded messages inside Flower messages.

A Flower message carries one ConfigRecord under the key "zofed" holding the raw bytes of zofed's own wire
format (fl/protocol.py) plus the client id and round as plain integers. Model weights go down inside the
zofed downlink bytes; the uplink is the zofed ClientUpdate bytes (seeds and scalars), so what Flower moves is
exactly what the in-process engine counts, plus Flower's own envelope (`flower_nbytes`).
"""

from __future__ import annotations

import re

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

RECORD = "zofed"
TRAIN = "train"  # message type: train one client for one round
QUERY = "query"  # message type: which partition does this SuperNode hold
PARTITION_ID = "partition-id"  # node config keys (`flower-supernode --node-config`), as Flower's simulation sets them
NUM_PARTITIONS = "num-partitions"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train_content(downlink: bytes, client_id: int, round_id: int) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"downlink": downlink, "client-id": client_id, "round": round_id})})


def read_train(message: Message) -> tuple[bytes, int, int]:
    """(downlink bytes, client id, round) of a train message; ValueError if it is not one."""
    record = _record(message, ("downlink", "client-id", "round"))
    downlink = record["downlink"]
    if not isinstance(downlink, bytes):
        raise ValueError("a zofed train message carries its downlink as bytes")
    return downlink, int(record["client-id"]), int(record["round"])


def uplink_content(uplink: bytes, client_id: int) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"uplink": uplink, "client-id": client_id})})


def read_uplink(message: Message) -> bytes:
    uplink = _record(message, ("uplink",))["uplink"]
    if not isinstance(uplink, bytes):
        raise ValueError("a zofed reply carries its uplink as bytes")
    return uplink


def partition_content(partition_id: int, num_partitions: int) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({PARTITION_ID: partition_id, NUM_PARTITIONS: num_partitions})})


def read_partition(message: Message) -> tuple[int, int]:
    record = _record(message, (PARTITION_ID, NUM_PARTITIONS))
    return int(record[PARTITION_ID]), int(record[NUM_PARTITIONS])


def flower_nbytes(message: Message) -> int:
    """Bytes of the message as Flower serializes it (every object of its tree: envelope, records, payload),
    before the transport's own framing."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def error_reason(message: Message, limit: int = 300) -> str:
    """A one-line reason for a Flower error reply: the last line of its traceback text, shortened."""
    text = _ANSI.sub("", message.error.reason or "")
    # Flower writes "<class ...>:<'traceback text'>": keep the text's last line, the exception's message.
    lines = [line.strip() for line in text.replace("\\n", "\n").splitlines() if line.strip().strip("'>")]
    last = lines[-1].removesuffix("'>") if lines else "no reason given"
    reason = f"code {message.error.code}: {last}"
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _record(message: Message, keys: tuple[str, ...]) -> ConfigRecord:
    if RECORD not in message.content.config_records:
        raise ValueError(f"the message holds no {RECORD!r} config record")
    record = message.content.config_records[RECORD]
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"the {RECORD!r} record lacks {', '.join(missing)}")
    return record
