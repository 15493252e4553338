"""Tests for zofed.fl.protocol: round trips, byte sizes, and every malformed input raising MessageError."""

from __future__ import annotations

import json
import struct
from dataclasses import fields, replace

import numpy as np
import pytest

from zofed.fl.protocol import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    ClientUpdate,
    MessageError,
    ServerBroadcast,
    decode,
    encode,
    message_nbytes,
    step_seeds,
    validate,
)
from zofed.zo.noise import derive_seed

PREFIX = struct.Struct("<4sHBI")
BASE_SEED = derive_seed(2024, 7)


def uplink(steps: int = 50, queries: int = 1, blocks: int = 8, explicit: bool = False, seed: int = 0,
           **changes) -> ClientUpdate:
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**63, steps, dtype=np.uint64) if explicit else np.zeros(0, np.uint64)
    msg = ClientUpdate(round_id=3, client_id=7, seeds=seeds, base_seed=None if explicit else BASE_SEED,
                       grads=rng.standard_normal((steps, queries)).astype(np.float32),
                       personalization=rng.random(blocks, dtype=np.float32), num_examples=128,
                       metrics={"loss": 0.6931471805599453})
    return replace(msg, **changes)


def downlink(mode: str = "log", **changes) -> ServerBroadcast:
    rng = np.random.default_rng(1)
    msg = ServerBroadcast(round_id=3, mode=mode, seeds=np.arange(4, dtype=np.uint64) * 2**40,
                          log_seeds=rng.integers(0, 2**63, 6, dtype=np.uint64),
                          log_coeffs=rng.standard_normal((6, 2)).astype(np.float32),
                          server_state=rng.random(3, dtype=np.float32),
                          weights=rng.standard_normal(10).astype(np.float32) if mode == "weights" else None,
                          config={"lr": 1e-4, "local_steps": 50, "opt": "zo-sgd"})
    return replace(msg, **changes)


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y and type(x) is type(y), f.name


def split(data: bytes) -> tuple[tuple, dict, bytes]:
    prefix = PREFIX.unpack_from(data)
    end = PREFIX.size + prefix[3]
    return prefix, json.loads(data[PREFIX.size:end]), data[end:]


def repack(data: bytes, edit=None, *, magic: bytes = b"ZOFD", version: int = PROTOCOL_VERSION, kind: int | None = None,
           header_bytes: bytes | None = None) -> bytes:
    """`data` with one thing changed: `edit(header)` mutates the parsed header, the rest is re-packed as is."""
    (_, _, old_kind, _), header, payload = split(data)
    if edit is not None:
        edit(header)
    blob = header_bytes if header_bytes is not None else json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(magic, version, old_kind if kind is None else kind, len(blob)) + blob + payload


def array_entry(header: dict, key: str) -> list:
    return next(e for e in header["a"] if e[0] == key)


def set_value(data: bytes, key: str, index: int, value: float) -> bytes:
    """Overwrite element `index` of float32 array `key` in the payload."""
    _, header, payload = split(data)
    offset = len(data) - len(payload)
    for name, _, _, nbytes in header["a"]:
        if name == key:
            out = bytearray(data)
            struct.pack_into("<f", out, offset + 4 * index, value)
            return bytes(out)
        offset += nbytes
    raise KeyError(key)


# --- round trips and sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("msg", [
    uplink(), uplink(explicit=True, queries=3), uplink(steps=0, blocks=0, metrics={}),
    uplink(explicit=True, dense=np.linspace(-1, 1, 17, dtype=np.float32)),
    downlink(), downlink("weights"), downlink(seeds=np.zeros(0, np.uint64), config={}),
    downlink(log_coeffs=np.ones(6, np.float32), server_state=np.zeros(0, np.float32)),
], ids=["base-seed", "explicit-q3", "empty", "dense", "log", "weights", "log-bare", "log-1d"])
def test_round_trip(msg):
    data = encode(msg)
    back = decode(data, expect_round=3, expect_client=7)
    assert_same(msg, back)
    assert encode(back) == data  # canonical: re-encoding gives the same bytes
    assert message_nbytes(msg) == len(data)
    assert_same(decode(bytearray(data)), back)


def test_encoding_is_deterministic_and_little_endian():
    msg = uplink(explicit=True)
    assert encode(msg) == encode(uplink(explicit=True))
    reordered = replace(msg, metrics={"b": 1.0, "a": 2.0}), replace(msg, metrics={"a": 2.0, "b": 1.0})
    assert encode(reordered[0]) == encode(reordered[1])
    swapped = replace(msg, grads=msg.grads.astype(">f4"), seeds=msg.seeds.astype(">u8"))
    assert encode(swapped) == encode(msg)
    _, _, payload = split(encode(msg))
    assert payload[:8] == struct.pack("<Q", int(msg.seeds[0]))


def test_uplink_size_with_base_seed():
    msg = uplink(steps=50, queries=1, blocks=8)
    size = message_nbytes(msg)
    assert size < 400, f"50-step uplink with base_seed and 8 blocks is {size} bytes"
    explicit = message_nbytes(uplink(steps=50, blocks=8, explicit=True))
    assert explicit - size >= 50 * 8 - len(str(BASE_SEED)), (size, explicit)


@pytest.mark.parametrize("explicit", [False, True])
def test_size_is_prefix_header_and_arrays_only(explicit):
    # the same steps/queries/blocks give the same size whatever the values; nothing model-sized enters
    sizes = {message_nbytes(uplink(steps=20, queries=2, blocks=5, explicit=explicit, seed=s)) for s in range(5)}
    assert len(sizes) == 1, sizes
    data = encode(uplink(steps=20, queries=2, blocks=5, explicit=explicit))
    (_, _, _, header_len), _, _ = split(data)
    assert len(data) == PREFIX.size + header_len + 4 * 20 * 2 + 4 * 5 + (8 * 20 if explicit else 0)


def test_step_seeds():
    msg = uplink(steps=4)
    np.testing.assert_array_equal(step_seeds(msg), [derive_seed(BASE_SEED, t) for t in range(4)])
    assert step_seeds(msg, steps=6).dtype == np.uint64 and len(step_seeds(msg, steps=6)) == 6
    explicit = uplink(steps=4, explicit=True)
    np.testing.assert_array_equal(step_seeds(explicit), explicit.seeds)
    with pytest.raises(ValueError):
        step_seeds(explicit, steps=5)


def test_broadcast_ignores_expect_client():
    assert decode(encode(downlink()), expect_client=99).round_id == 3


def test_message_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(MessageError("dtype", "grads must be float32")))
    assert err.reason == "dtype" and str(err) == "grads must be float32"


# --- validate / encode refuse invalid in-memory messages --------------------------------------------------------------

@pytest.mark.parametrize("msg, reason, name", [
    (uplink(grads=np.zeros((50, 1))), "dtype", "grads"),
    (uplink(seeds=[1, 2]), "dtype", "seeds"),
    (uplink(grads=np.zeros(50, np.float32)), "shape", "grads"),
    (uplink(base_seed=5, seeds=np.arange(50, dtype=np.uint64)), "shape", "base_seed"),
    (uplink(base_seed=None), "shape", "seeds"),
    (uplink(steps=3, queries=0), "shape", "queries"),
    (uplink(round_id=-1), "bad_field", "round_id"),
    (uplink(client_id=2**32), "bad_field", "client_id"),
    (uplink(num_examples=True), "bad_field", "num_examples"),
    (uplink(metrics={"loss": "low"}), "bad_field", "metrics"),
    (uplink(metrics={"loss": float("inf")}), "non_finite", "metrics"),
    (uplink(personalization=np.array([0, np.nan], np.float32)), "non_finite", "personalization"),
    (uplink(dense=np.array([np.inf], np.float32)), "non_finite", "dense"),
    (downlink(mode="delta"), "bad_field", "mode"),
    (downlink(weights=np.zeros(3, np.float32)), "shape", "weights"),
    (downlink(log_coeffs=np.zeros((5, 2), np.float32)), "shape", "log_coeffs"),
    (downlink(config={"lr": [1]}), "bad_field", "config"),
    (downlink(config={"lr": float("nan")}), "non_finite", "config"),
])
def test_invalid_messages_are_not_encoded(msg, reason, name):
    with pytest.raises(MessageError) as info:
        encode(msg)
    assert info.value.reason == reason and name in str(info.value), str(info.value)
    with pytest.raises(MessageError):
        validate(msg)


# --- malformed bytes ------------------------------------------------------------------------------------------------

UP = encode(uplink())
UP_EXPLICIT = encode(uplink(steps=4, queries=2, explicit=True))
UP_DENSE = encode(uplink(dense=np.ones(5, np.float32)))
DOWN = encode(downlink())
DOWN_WEIGHTS = encode(downlink("weights"))


def edited(data: bytes, fn) -> bytes:  # short alias for the table below
    return repack(data, fn)


def header_text(data: bytes, old: str, new: str) -> bytes:
    """`data` re-packed with a textual edit of its header, for JSON that json.dumps would not write."""
    text = json.dumps(split(data)[1], separators=(",", ":"))
    assert old in text
    return repack(data, header_bytes=text.replace(old, new).encode())


def _set(key, value):
    return lambda h: h.__setitem__(key, value)


def _entry(key, position, value):
    return lambda h: array_entry(h, key).__setitem__(position, value)


MALFORMED = [
    ("magic", b"ZOFX" + UP[4:], {}, "bad_magic"),
    ("magic-repacked", repack(UP, magic=b"\x00ZOF"), {}, "bad_magic"),
    ("version", repack(UP, version=PROTOCOL_VERSION + 1), {}, "version"),
    ("kind", repack(UP, kind=3), {}, "unknown_kind"),
    ("kind-swapped", repack(UP, kind=2), {}, "bad_header"),
    ("too-large", UP, {"max_bytes": len(UP) - 1}, "too_large"),
    ("header-too-large", PREFIX.pack(b"ZOFD", PROTOCOL_VERSION, 1, MAX_HEADER_BYTES + 1) + UP[PREFIX.size:], {},
     "too_large"),
    ("short-prefix", UP[:5], {}, "truncated"),
    ("short-header", UP[:PREFIX.size + 10], {}, "truncated"),
    ("short-payload", UP[:-1], {}, "truncated"),
    ("trailing", UP + b"\x00", {}, "trailing_bytes"),
    ("not-json", repack(UP, header_bytes=b"{not json"), {}, "bad_header"),
    ("not-utf8", repack(UP, header_bytes=b'{"r":"\xff"}'), {}, "bad_header"),
    ("not-object", repack(UP, header_bytes=b"[1,2]"), {}, "bad_header"),
    ("nested", repack(UP, header_bytes=b"[" * 50_000), {}, "bad_header"),
    ("duplicate-key", header_text(UP, '"r":3', '"r":3,"r":3'), {}, "bad_header"),
    ("missing-field", edited(UP, lambda h: h.pop("n")), {}, "bad_header"),
    ("extra-field", edited(UP, _set("x", 1)), {}, "bad_header"),
    ("round-as-string", edited(UP, _set("r", "3")), {}, "bad_header"),
    ("negative-client", edited(UP, _set("c", -1)), {}, "bad_header"),
    ("client-over-uint32", edited(UP, _set("c", 2**32)), {}, "bad_header"),
    ("base-seed-over-uint64", edited(UP, _set("b", 2**64)), {}, "bad_header"),
    ("examples-bool", edited(UP, _set("n", True)), {}, "bad_header"),
    ("examples-float", edited(UP, _set("n", 128.0)), {}, "bad_header"),
    ("metrics-list", edited(UP, _set("m", [1.0])), {}, "bad_header"),
    ("metric-string", edited(UP, _set("m", {"loss": "x"})), {}, "bad_header"),
    ("arrays-not-list", edited(UP, _set("a", {})), {}, "bad_header"),
    ("descriptor-short", edited(UP, lambda h: h["a"][0].pop()), {}, "bad_header"),
    ("negative-dim", edited(UP, _entry("g", 2, [-50, -1])), {}, "bad_header"),
    ("arrays-reordered", edited(UP, lambda h: h["a"].reverse()), {}, "bad_header"),
    ("unknown-array", edited(UP, lambda h: h["a"].append(["z", "<f4", [0], 0])), {}, "bad_header"),
    ("missing-array", edited(UP, lambda h: h["a"].pop(2)), {}, "bad_header"),
    ("mode-unknown", edited(DOWN, _set("o", "delta")), {}, "bad_header"),
    ("config-nested", edited(DOWN, _set("k", {"lr": {"x": 1}})), {}, "bad_header"),
    ("dtype-f8", edited(UP, _entry("g", 1, "<f8")), {}, "dtype"),
    ("dtype-big-endian", edited(UP, _entry("p", 1, ">f4")), {}, "dtype"),
    ("dtype-seeds-signed", edited(UP_EXPLICIT, _entry("s", 1, "<i8")), {}, "dtype"),
    ("dtype-object", edited(DOWN, _entry("lc", 1, "O")), {}, "dtype"),
    ("length-shape", edited(UP, _entry("g", 2, [49, 1])), {}, "length_mismatch"),
    ("length-nbytes", edited(UP, _entry("p", 3, 28)), {}, "length_mismatch"),
    ("ndim", edited(UP, _entry("g", 2, [50])), {}, "shape"),
    ("rows-vs-seeds", edited(UP_EXPLICIT, _entry("g", 2, [8, 1])), {}, "shape"),
    ("both-seeds", edited(UP_EXPLICIT, _set("b", 5)), {}, "shape"),
    ("no-seeds", edited(UP, _set("b", None)), {}, "shape"),
    ("weights-in-log-mode", edited(DOWN_WEIGHTS, _set("o", "log")), {}, "shape"),
    ("weights-missing", edited(DOWN, _set("o", "weights")), {}, "shape"),
    ("log-rows", edited(DOWN, _entry("lc", 2, [3, 4])), {}, "shape"),
    ("nan-grads", set_value(UP, "g", 17, float("nan")), {}, "non_finite"),
    ("inf-personalization", set_value(UP, "p", 0, float("inf")), {}, "non_finite"),
    ("nan-dense", set_value(UP_DENSE, "d", 4, float("nan")), {}, "non_finite"),
    ("nan-log-coeffs", set_value(DOWN, "lc", 11, float("nan")), {}, "non_finite"),
    ("inf-weights", set_value(DOWN_WEIGHTS, "w", 3, float("-inf")), {}, "non_finite"),
    ("nan-metric", edited(UP, _set("m", {"loss": float("nan")})), {}, "non_finite"),
    ("huge-metric", header_text(UP, "0.6931471805599453", "1e400"), {}, "non_finite"),
    ("huge-int-metric", edited(UP, _set("m", {"loss": 10**400})), {}, "non_finite"),
    ("inf-config", edited(DOWN, _set("k", {"lr": float("inf")})), {}, "non_finite"),
    ("wrong-round", UP, {"expect_round": 4}, "wrong_round"),
    ("wrong-round-down", DOWN, {"expect_round": 2}, "wrong_round"),
    ("wrong-client", UP, {"expect_round": 3, "expect_client": 8}, "wrong_client"),
]


@pytest.mark.parametrize("data, kwargs, reason", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_bytes_raise_message_error(data, kwargs, reason):
    with pytest.raises(MessageError) as info:
        decode(data, **kwargs)
    assert info.value.reason == reason, str(info.value)
    assert str(info.value)


def test_repack_without_edit_is_identity():
    # the helper itself must not change a valid message, or the cases above would test two things at once
    for data in (UP, UP_EXPLICIT, DOWN, DOWN_WEIGHTS):
        assert_same(decode(repack(data)), decode(data))


@pytest.mark.parametrize("data", [UP, DOWN_WEIGHTS], ids=["uplink", "downlink"])
def test_random_mutations_only_raise_message_error(data):
    rng = np.random.default_rng(0)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(200):
        bad = bytearray(data)
        action = rng.integers(3)
        if action == 0:  # overwrite a few bytes
            for pos in rng.integers(0, len(bad), rng.integers(1, 4)):
                bad[pos] = rng.integers(256)
        elif action == 1:  # cut somewhere
            del bad[rng.integers(len(bad)):]
        else:  # insert a byte
            bad.insert(int(rng.integers(len(bad) + 1)), int(rng.integers(256)))
        try:
            msg = decode(bytes(bad))
        except MessageError as exc:
            assert exc.reason and str(exc)
            outcomes["error"] += 1
        else:
            validate(msg)
            outcomes["ok"] += 1
    assert outcomes["error"] > 100, outcomes
