"""Fuzzing the wire: 10,000 random mutations of valid uplinks and of valid downlinks (bit flips, byte
overwrites, truncations, splices of two messages, huge lengths, header edits). Each is refused with a reason or
decodes to a message that passes validation; nothing else is ever raised, and a round fed mutated uplinks goes on.
Mutations of a valid uplink's seeds alone leave a well-formed message, which the server refuses for its seeds."""

import json
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import ClientUpdate, MessageError, ServerBroadcast, decode, encode, validate
from zofed.fl.protocol import step_seeds as protocol_step_seeds
from zofed.fl.roles import ServerRole
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import make_server_optimizer

PREFIX = struct.Struct("<4sHBI")
MUTATIONS = 10_000


def _uplinks() -> list[bytes]:
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(4, 2)).astype(np.float32)
    return [encode(ClientUpdate(3, 1, np.zeros(0, np.uint64), 12345, grads, 40, {"train_loss": 0.7})),
            encode(ClientUpdate(3, 2, np.arange(4, dtype=np.uint64), None, grads, 8, {})),
            encode(ClientUpdate(3, 2, np.zeros(0, np.uint64), 12345, grads.astype(np.float16).astype(np.float32), 8,
                                {}, scalar_bits=16)),
            encode(ClientUpdate(3, 1, np.zeros(0, np.uint64), None, np.zeros((0, 1), np.float32), 5, {},
                                dense=rng.normal(size=16).astype(np.float32)))]


def _downlinks() -> list[bytes]:
    rng = np.random.default_rng(1)
    return [encode(ServerBroadcast(3, rng.random(4).astype(np.float32), rng.normal(size=32).astype(np.float32),
                                   {"lr": 1e-3, "local_steps": 4, "method": "zofed"})),
            encode(ServerBroadcast(0, np.zeros(0, np.float32), np.ones(8, np.float32)))]


def _huge_length(data: bytearray, rng: np.random.Generator) -> bytearray:
    """A length field made huge: the prefix's header length, or a number inside the JSON header."""
    if rng.random() < 0.5:
        struct.pack_into("<I", data, 7, int(rng.choice([2**31, 2**32 - 1, len(data) + 1, 70_000])))
        return data
    _, _, _, header_len = PREFIX.unpack_from(data)
    header = json.loads(bytes(data[PREFIX.size:PREFIX.size + header_len]))
    entry = header["a"][int(rng.integers(len(header["a"])))] if header["a"] else None
    if entry is None:
        return data
    slot = int(rng.integers(2, 4))  # the shape or the byte length
    big = int(rng.choice([2**31, 2**63, 10**30, -1]))
    if slot == 2:
        entry[2] = [big] + entry[2][1:]
    else:
        entry[3] = big
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return bytearray(PREFIX.pack(*PREFIX.unpack_from(data)[:3], len(blob)) + blob + data[PREFIX.size + header_len:])


def mutate(valid: list[bytes], rng: np.random.Generator) -> bytes:
    data = bytearray(valid[int(rng.integers(len(valid)))])
    action = int(rng.integers(6))
    if action == 0:  # flip bits
        for pos in rng.integers(0, len(data), int(rng.integers(1, 6))):
            data[pos] ^= 1 << int(rng.integers(8))
    elif action == 1:  # overwrite bytes
        for pos in rng.integers(0, len(data), int(rng.integers(1, 6))):
            data[pos] = int(rng.integers(256))
    elif action == 2:  # truncate
        del data[int(rng.integers(len(data))):]
    elif action == 3:  # splice: the head of one message and the tail of another
        other = valid[int(rng.integers(len(valid)))]
        data = data[:int(rng.integers(len(data) + 1))] + other[int(rng.integers(len(other) + 1)):]
    elif action == 4:
        data = _huge_length(data, rng)
    else:  # insert or duplicate a run of bytes
        at = int(rng.integers(len(data) + 1))
        data[at:at] = data[at:at + int(rng.integers(1, 16))] or bytes([int(rng.integers(256))])
    return bytes(data)


@pytest.mark.parametrize("kind", ["uplink", "downlink"])
def test_every_mutation_is_refused_with_a_reason_or_decodes_to_a_valid_message(kind):
    valid = _uplinks() if kind == "uplink" else _downlinks()
    rng = np.random.default_rng(7)
    reasons: dict[str, int] = {}
    decoded = 0
    for _ in range(MUTATIONS):
        data = mutate(valid, rng)
        try:
            msg = decode(data, max_bytes=2**20)
        except MessageError as err:  # anything else escapes and fails the test
            assert err.reason and str(err)
            reasons[err.reason] = reasons.get(err.reason, 0) + 1
        else:
            validate(msg)
            decoded += 1
    assert sum(reasons.values()) > MUTATIONS // 2, reasons  # most mutations break the message ...
    assert len(reasons) >= 5, reasons  # ... in many different ways, each named
    assert decoded > 0  # and some (a changed scalar value) still make a valid message


def test_a_round_fed_mutated_uplinks_rejects_them_and_goes_on():
    sizes = (8, 8)
    plan = FederationPlan("zo-seeds", 40, 40, 4, lr=0.1, eps=1e-2, run_seed=5, queries=2)
    server = ServerRole(plan, [torch.zeros(n) for n in sizes], None, make_server_optimizer("sgd", 1.0))
    local, inbox = server.round_plan(0), RoundInbox()
    rng = np.random.default_rng(3)
    honest = {}
    for c in server.sample(0):
        server.send_state(local, c)
        seeds = server.method.step_seeds(local, c)
        grads = rng.normal(size=(4, 2)).astype(np.float32)
        honest[c] = encode(ClientUpdate(0, c, np.zeros(0, np.uint64), seeds.base_seed, grads, 10, {}))
    for c, data in honest.items():
        server.receive(inbox, local, c, data if c % 4 == 0 else mutate(list(honest.values()), rng))
    assert len(inbox.accepted) + len(inbox.rejected) == 40 and len(inbox.rejected) > 15
    assert all(isinstance(reason, str) and reason for _, reason in inbox.rejected)
    server.aggregate(local, inbox)
    assert all(torch.isfinite(t).all() for t in server.tensors)
    assert any(float(t.abs().max()) > 0 for t in server.tensors)  # the honest uplinks moved the model


SEED_MUTATIONS = 2_000


def _mutate_seeds(update: ClientUpdate, rng: np.random.Generator) -> bytes:
    """A valid uplink naming other step seeds than `update`'s: a changed base seed, changed listed seeds (in the
    message or in its bytes), or the same seeds named the other way."""
    steps = update.grads.shape[0]
    action = int(rng.integers(5))
    if action == 0:  # another base seed: near the right one, one bit off, or anywhere
        right = update.base_seed if update.base_seed is not None else int(rng.integers(2**63))
        other = int(rng.choice([right + 1, right - 1, right ^ (1 << int(rng.integers(64))), rng.integers(2**63)]))
        return encode(replace(update, seeds=np.zeros(0, np.uint64), base_seed=other % 2**64))
    if action == 1:  # the right seeds, named the other way
        if update.base_seed is not None:
            return encode(replace(update, seeds=protocol_step_seeds(update), base_seed=None))
        return encode(replace(update, seeds=np.zeros(0, np.uint64), base_seed=int(update.seeds[0])))
    listed = protocol_step_seeds(update)
    if action == 2:  # some listed seeds replaced
        at = rng.integers(0, steps, int(rng.integers(1, steps + 1)))
        listed[at] = rng.integers(0, 2**63, len(at), dtype=np.uint64)
    elif action == 3:  # the listed seeds in another order
        listed = listed[rng.permutation(steps)]
    data = bytearray(encode(replace(update, seeds=listed, base_seed=None)))
    if action == 4:  # bits flipped in the seeds' bytes (the first array, right after the header)
        start = PREFIX.size + PREFIX.unpack_from(data)[3]
        for pos in rng.integers(start, start + 8 * steps, int(rng.integers(1, 4))):
            data[pos] ^= 1 << int(rng.integers(8))
    return bytes(data)


@pytest.mark.parametrize("method", ["zo-seeds", "fedkseed", "zofed"])
def test_every_mutation_of_a_valid_uplinks_seeds_is_refused_for_its_seeds(method):
    plan = FederationPlan(method, 8, 8, 4, lr=0.1, eps=1e-2, run_seed=5, queries=2, pool_size=8)
    server = ServerRole(plan, [torch.zeros(8), torch.zeros(8)], None, make_server_optimizer("sgd", 1.0))
    local = server.round_plan(0)
    rng = np.random.default_rng(11)
    assigned = {}
    for c in range(8):
        seeds = server.method.step_seeds(local, c)
        listed = np.asarray(seeds.seeds, np.uint64) if seeds.explicit else np.zeros(0, np.uint64)
        assigned[c] = ClientUpdate(0, c, listed, seeds.base_seed, rng.normal(size=(4, 2)).astype(np.float32), 10, {})
    honest = RoundInbox()
    for c, update in assigned.items():
        server.receive(honest, local, c, encode(update))
    assert len(honest.accepted) == 8, honest.rejected
    reasons: dict[str, int] = {}
    tried = 0
    for _ in range(SEED_MUTATIONS):
        c = int(rng.integers(8))
        data = _mutate_seeds(assigned[c], rng)
        lie = decode(data)  # well-formed: only its seeds are wrong
        if np.array_equal(protocol_step_seeds(lie), protocol_step_seeds(assigned[c])) and \
                (lie.base_seed is None) == (assigned[c].base_seed is None):
            continue  # a reordering of equal seeds, or a flip undone: the same uplink
        inbox = RoundInbox()
        server.receive(inbox, local, c, data)  # anything but MessageError escapes receive and fails the test
        assert not inbox.accepted, (c, lie.base_seed, lie.seeds)
        reason = inbox.rejected[0][1].partition(":")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
        tried += 1
    assert reasons == {"seeds": tried} and tried > SEED_MUTATIONS // 2
