"""Tests for zofed.fl.protocol (version 2): round trips, byte sizes, and every malformed input raising MessageError."""

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
CONFIG = {"lr": 1e-4, "local_steps": 50, "opt": "zo-sgd"}


def uplink(steps: int = 50, queries: int = 1, explicit: bool = False, seed: int = 0, **changes) -> ClientUpdate:
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**63, steps, dtype=np.uint64) if explicit else np.zeros(0, np.uint64)
    msg = ClientUpdate(round_id=3, client_id=7, seeds=seeds, base_seed=None if explicit else BASE_SEED,
                       grads=rng.standard_normal((steps, queries)).astype(np.float32), num_examples=128,
                       metrics={"loss": 0.6931471805599453})
    return replace(msg, **changes)


def downlink(state: int = 3, size: int = 10, seed: int = 1, **changes) -> ServerBroadcast:
    rng = np.random.default_rng(seed)
    msg = ServerBroadcast(3, rng.random(state, dtype=np.float32), rng.standard_normal(size).astype(np.float32),
                          dict(CONFIG))
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


def pack(kind: int, header: dict, payload: bytes = b"", *, version: int = PROTOCOL_VERSION) -> bytes:
    """A message built by hand from a header and payload, e.g. one laid out as an older version wrote it."""
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return PREFIX.pack(b"ZOFD", version, kind, len(blob)) + blob + payload


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


def insert_array(data: bytes, position: int, key: str, dtype: str, values) -> bytes:
    """`data` with one more array, descriptor and bytes both, at `position` of the header's array list."""
    (_, version, kind, _), header, payload = split(data)
    raw = np.ascontiguousarray(values, dtype=dtype).tobytes()
    cut = sum(e[3] for e in header["a"][:position])
    header["a"].insert(position, [key, dtype, list(np.shape(values)), len(raw)])
    return pack(kind, header, payload[:cut] + raw + payload[cut:], version=version)


def remove_array(data: bytes, key: str) -> bytes:
    """`data` without array `key`, descriptor and bytes both."""
    (_, version, kind, _), header, payload = split(data)
    position = [e[0] for e in header["a"]].index(key)
    cut = sum(e[3] for e in header["a"][:position])
    nbytes = header["a"].pop(position)[3]
    return pack(kind, header, payload[:cut] + payload[cut + nbytes:], version=version)


def set_value(data: bytes, key: str, index: int, value: float) -> bytes:
    """Overwrite element `index` of float32 array `key` in the payload."""
    _, header, payload = split(data)
    offset = len(data) - len(payload)
    for name, _, _, nbytes in header["a"]:
        if name == key:
            assert 4 * index < nbytes, (key, index)
            out = bytearray(data)
            struct.pack_into("<f", out, offset + 4 * index, value)
            return bytes(out)
        offset += nbytes
    raise KeyError(key)


# --- the v2 message types -------------------------------------------------------------------------------------------

def test_protocol_version_is_2():
    assert PROTOCOL_VERSION == 2
    for data, kind in ((encode(uplink()), 1), (encode(downlink()), 2)):
        assert PREFIX.unpack_from(data)[:3] == (b"ZOFD", 2, kind)


def test_v2_fields():
    assert [f.name for f in fields(ClientUpdate)] == [
        "round_id", "client_id", "seeds", "base_seed", "grads", "num_examples", "metrics", "dense",
        "scalar_bits"]
    assert [f.name for f in fields(ServerBroadcast)] == ["round_id", "server_state", "weights", "config"]


def test_removed_fields_are_not_accepted():
    rng = np.random.default_rng(0)
    with pytest.raises(TypeError):
        replace(uplink(), personalization=rng.random(8, dtype=np.float32))
    for removed in ({"mode": "weights"}, {"seeds": np.zeros(0, np.uint64)}, {"log_seeds": np.zeros(0, np.uint64)},
                    {"log_coeffs": np.zeros(0, np.float32)}):
        with pytest.raises(TypeError):
            replace(downlink(), **removed)


def test_downlink_weights_are_required_and_config_defaults_to_empty():
    state = np.zeros(2, np.float32)
    with pytest.raises(TypeError):
        ServerBroadcast(3, state)  # type: ignore[call-arg]
    msg = ServerBroadcast(3, state, np.ones(4, np.float32))
    assert msg.config == {}
    back = decode(encode(msg))
    assert isinstance(back, ServerBroadcast) and back.config == {}
    np.testing.assert_array_equal(back.weights, np.ones(4, np.float32))
    assert ServerBroadcast(3, state, np.ones(4, np.float32)).config is not msg.config  # no shared default


# --- round trips and sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("msg", [
    uplink(), uplink(explicit=True, queries=3), uplink(steps=0, metrics={}),
    uplink(explicit=True, dense=np.linspace(-1, 1, 17, dtype=np.float32)),
    uplink(dense=np.zeros(0, np.float32)),
    downlink(), downlink(state=0, config={}), downlink(size=0),
    downlink(config={"lr": 3, "name": "é", "beta": -0.5, "big": 2**40}),
], ids=["base-seed", "explicit-q3", "empty", "dense", "dense-empty", "down", "down-bare", "down-empty-weights",
        "down-config"])
def test_round_trip(msg):
    data = encode(msg)
    back = decode(data, expect_round=3, expect_client=7)
    assert_same(msg, back)
    assert encode(back) == data  # canonical: re-encoding gives the same bytes
    assert message_nbytes(msg) == len(data)
    assert_same(decode(bytearray(data)), back)
    assert_same(decode(memoryview(data)), back)


def test_decoded_arrays_are_owned_native_copies():
    data = bytearray(encode(downlink()))
    back = decode(data)
    data[-4:] = b"\x00\x00\x80\x7f"  # +inf into the buffer after decoding
    assert np.isfinite(back.weights).all()
    assert back.weights.dtype == np.float32 and back.weights.dtype.isnative and back.weights.flags.owndata


def test_encoding_is_deterministic_and_little_endian():
    msg = uplink(explicit=True)
    assert encode(msg) == encode(uplink(explicit=True))
    reordered = replace(msg, metrics={"b": 1.0, "a": 2.0}), replace(msg, metrics={"a": 2.0, "b": 1.0})
    assert encode(reordered[0]) == encode(reordered[1])
    swapped = replace(msg, grads=msg.grads.astype(">f4"), seeds=msg.seeds.astype(">u8"))
    assert encode(swapped) == encode(msg)
    _, _, payload = split(encode(msg))
    assert payload[:8] == struct.pack("<Q", int(msg.seeds[0]))

    down = downlink()
    configs = replace(down, config={"opt": "zo-sgd", "lr": 1e-4, "local_steps": 50}), down
    assert encode(configs[0]) == encode(configs[1])
    swapped_down = replace(down, server_state=down.server_state.astype(">f4"), weights=down.weights.astype(">f4"))
    assert encode(swapped_down) == encode(down)
    _, _, payload = split(encode(down))
    assert payload == down.server_state.astype("<f4").tobytes() + down.weights.astype("<f4").tobytes()


def test_canonical_headers():
    down = downlink()
    (_, _, _, header_len), header, _ = split(encode(down))
    assert header == {"a": [["ss", "<f4", [3], 12], ["w", "<f4", [10], 40]], "k": CONFIG, "r": 3}
    blob = encode(down)[PREFIX.size:PREFIX.size + header_len]
    assert blob == json.dumps(header, sort_keys=True, separators=(",", ":")).encode()

    _, header, _ = split(encode(uplink(steps=4, queries=2)))
    assert header == {"a": [["s", "<u8", [0], 0], ["g", "<f4", [4, 2], 32]], "b": BASE_SEED, "c": 7,
                      "m": {"loss": 0.6931471805599453}, "n": 128, "r": 3}
    _, header, _ = split(encode(uplink(steps=4, dense=np.ones(3, np.float32))))
    assert [e[0] for e in header["a"]] == ["s", "g", "d"]


def test_uplink_size_with_base_seed():
    msg = uplink(steps=50, queries=1)
    size = message_nbytes(msg)
    assert size < 360, f"50-step uplink with base_seed is {size} bytes"
    explicit = message_nbytes(uplink(steps=50, explicit=True))
    assert explicit - size >= 50 * 8 - len(str(BASE_SEED)), (size, explicit)


@pytest.mark.parametrize("explicit", [False, True])
def test_size_is_prefix_header_and_arrays_only(explicit):
    # the same steps/queries give the same size whatever the values; nothing model-sized enters
    sizes = {message_nbytes(uplink(steps=20, queries=2, explicit=explicit, seed=s)) for s in range(5)}
    assert len(sizes) == 1, sizes
    data = encode(uplink(steps=20, queries=2, explicit=explicit))
    (_, _, _, header_len), _, _ = split(data)
    assert len(data) == PREFIX.size + header_len + 4 * 20 * 2 + (8 * 20 if explicit else 0)


def test_downlink_size_is_prefix_header_state_and_weights():
    sizes = {message_nbytes(downlink(state=4, size=1000, seed=s)) for s in range(5)}
    assert len(sizes) == 1, sizes
    data = encode(downlink(state=4, size=1000))
    (_, _, _, header_len), _, _ = split(data)
    assert len(data) == PREFIX.size + header_len + 4 * 4 + 4 * 1000
    assert message_nbytes(downlink(state=4, size=2000)) - len(data) == 4 * 1000


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
    (uplink(dense=np.zeros(3)), "dtype", "dense"),
    (uplink(grads=np.zeros(50, np.float32)), "shape", "grads"),
    (uplink(dense=np.zeros((2, 2), np.float32)), "shape", "dense"),
    (uplink(base_seed=5, seeds=np.arange(50, dtype=np.uint64)), "shape", "base_seed"),
    (uplink(base_seed=None), "shape", "seeds"),
    (uplink(steps=3, queries=0), "shape", "queries"),
    (uplink(round_id=-1), "bad_field", "round_id"),
    (uplink(client_id=2**32), "bad_field", "client_id"),
    (uplink(num_examples=True), "bad_field", "num_examples"),
    (uplink(base_seed=2**64), "bad_field", "base_seed"),
    (uplink(metrics={"loss": "low"}), "bad_field", "metrics"),
    (uplink(metrics={"loss": float("inf")}), "non_finite", "metrics"),
    (uplink(grads=np.array([[0.0], [np.nan]], np.float32), steps=2), "non_finite", "grads"),
    (uplink(dense=np.array([np.inf], np.float32)), "non_finite", "dense"),
    (downlink(weights=None), "dtype", "weights"),
    (downlink(weights=np.zeros(3)), "dtype", "weights"),
    (downlink(weights=[0.0, 1.0]), "dtype", "weights"),
    (downlink(server_state=None), "dtype", "server_state"),
    (downlink(server_state=np.zeros(3, np.float16)), "dtype", "server_state"),
    (downlink(weights=np.zeros((2, 5), np.float32)), "shape", "weights"),
    (downlink(server_state=np.zeros((3, 1), np.float32)), "shape", "server_state"),
    (downlink(round_id=-1), "bad_field", "round_id"),
    (downlink(round_id=3.0), "bad_field", "round_id"),
    (downlink(config={"lr": [1]}), "bad_field", "config"),
    (downlink(config={1: "x"}), "bad_field", "config"),
    (downlink(config={"lr": float("nan")}), "non_finite", "config"),
    (downlink(weights=np.array([0, np.nan], np.float32)), "non_finite", "weights"),
    (downlink(server_state=np.array([np.inf], np.float32)), "non_finite", "server_state"),
])
def test_invalid_messages_are_not_encoded(msg, reason, name):
    with pytest.raises(MessageError) as info:
        encode(msg)
    assert info.value.reason == reason and name in str(info.value), str(info.value)
    with pytest.raises(MessageError) as info:
        validate(msg)
    assert info.value.reason == reason


# --- malformed bytes ------------------------------------------------------------------------------------------------

UP = encode(uplink())
UP_EXPLICIT = encode(uplink(steps=4, queries=2, explicit=True))
UP_DENSE = encode(uplink(dense=np.ones(5, np.float32)))
DOWN = encode(downlink())
DOWN_BARE = encode(downlink(state=0, size=0, config={}))

# what a version-1 sender wrote: the uplink with personalization "p", the downlink with mode "o", seeds "s" and
# the update log "ls"/"lc" (log mode: no weights; weights mode: weights last)
_PERSONALIZATION = np.linspace(0, 1, 8, dtype=np.float32)
_LOG_SEEDS = np.arange(6, dtype=np.uint64) * 2**40
_LOG_COEFFS = np.linspace(-1, 1, 12, dtype=np.float32).reshape(6, 2)


def v1_downlink(mode: str, *, version: int = 1) -> bytes:
    msg = downlink()
    arrays = [("s", "<u8", np.arange(4, dtype=np.uint64)), ("ls", "<u8", _LOG_SEEDS), ("lc", "<f4", _LOG_COEFFS),
              ("ss", "<f4", msg.server_state)] + ([("w", "<f4", msg.weights)] if mode == "weights" else [])
    header = {"r": 3, "o": mode, "k": dict(CONFIG),
              "a": [[key, dtype, list(a.shape), a.nbytes] for key, dtype, a in arrays]}
    return pack(2, header, b"".join(a.astype(dtype).tobytes() for _, dtype, a in arrays), version=version)


def v1_uplink(*, version: int = 1) -> bytes:
    data = insert_array(UP, 2, "p", "<f4", _PERSONALIZATION)
    return repack(data, version=version)


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


def _shape(key, shape):  # a consistent descriptor (nbytes matching the shape) that no payload backs
    def edit(h):
        entry = array_entry(h, key)
        entry[2], entry[3] = shape, 4 * int(np.prod(shape, dtype=object))
    return edit


MALFORMED = [
    ("magic", b"ZOFX" + UP[4:], {}, "bad_magic"),
    ("magic-repacked", repack(UP, magic=b"\x00ZOF"), {}, "bad_magic"),
    ("version-next", repack(UP, version=PROTOCOL_VERSION + 1), {}, "version"),
    ("version-0", repack(DOWN, version=0), {}, "version"),
    ("version-1-stamp-up", repack(UP, version=1), {}, "version"),
    ("version-1-stamp-down", repack(DOWN, version=1), {}, "version"),
    ("v1-uplink", v1_uplink(), {}, "version"),
    ("v1-downlink-log", v1_downlink("log"), {}, "version"),
    ("v1-downlink-weights", v1_downlink("weights"), {}, "version"),
    ("version-max", repack(UP, version=2**16 - 1), {}, "version"),
    ("kind", repack(UP, kind=3), {}, "unknown_kind"),
    ("kind-0", repack(DOWN, kind=0), {}, "unknown_kind"),
    ("kind-swapped", repack(UP, kind=2), {}, "bad_header"),
    ("kind-swapped-down", repack(DOWN, kind=1), {}, "bad_header"),
    ("too-large", UP, {"max_bytes": len(UP) - 1}, "too_large"),
    ("too-large-down", DOWN, {"max_bytes": len(DOWN) - 1}, "too_large"),
    ("header-too-large", PREFIX.pack(b"ZOFD", PROTOCOL_VERSION, 1, MAX_HEADER_BYTES + 1) + UP[PREFIX.size:], {},
     "too_large"),
    ("header-length-max", PREFIX.pack(b"ZOFD", PROTOCOL_VERSION, 2, 2**32 - 1) + DOWN[PREFIX.size:], {},
     "too_large"),
    ("short-prefix", UP[:5], {}, "truncated"),
    ("empty", b"", {}, "truncated"),
    ("short-header", UP[:PREFIX.size + 10], {}, "truncated"),
    ("short-payload", UP[:-1], {}, "truncated"),
    ("short-weights", DOWN[:-4], {}, "truncated"),
    ("no-payload-down", DOWN[:len(DOWN) - 52], {}, "truncated"),
    ("trailing", UP + b"\x00", {}, "trailing_bytes"),
    ("trailing-down", DOWN + b"\x00" * 4, {}, "trailing_bytes"),
    ("not-json", repack(UP, header_bytes=b"{not json"), {}, "bad_header"),
    ("not-utf8", repack(UP, header_bytes=b'{"r":"\xff"}'), {}, "bad_header"),
    ("not-object", repack(UP, header_bytes=b"[1,2]"), {}, "bad_header"),
    ("nested", repack(UP, header_bytes=b"[" * 50_000), {}, "bad_header"),
    ("duplicate-key", header_text(UP, '"r":3', '"r":3,"r":3'), {}, "bad_header"),
    ("duplicate-key-down", header_text(DOWN, '"r":3', '"r":3,"r":3'), {}, "bad_header"),
    ("missing-field", edited(UP, lambda h: h.pop("n")), {}, "bad_header"),
    ("missing-field-down", edited(DOWN, lambda h: h.pop("k")), {}, "bad_header"),
    ("extra-field", edited(UP, _set("x", 1)), {}, "bad_header"),
    ("round-as-string", edited(UP, _set("r", "3")), {}, "bad_header"),
    ("round-negative-down", edited(DOWN, _set("r", -1)), {}, "bad_header"),
    ("negative-client", edited(UP, _set("c", -1)), {}, "bad_header"),
    ("client-over-uint32", edited(UP, _set("c", 2**32)), {}, "bad_header"),
    ("base-seed-over-uint64", edited(UP, _set("b", 2**64)), {}, "bad_header"),
    ("examples-bool", edited(UP, _set("n", True)), {}, "bad_header"),
    ("examples-float", edited(UP, _set("n", 128.0)), {}, "bad_header"),
    ("metrics-list", edited(UP, _set("m", [1.0])), {}, "bad_header"),
    ("metric-string", edited(UP, _set("m", {"loss": "x"})), {}, "bad_header"),
    ("arrays-not-list", edited(UP, _set("a", {})), {}, "bad_header"),
    ("descriptor-short", edited(UP, lambda h: h["a"][0].pop()), {}, "bad_header"),
    ("descriptor-key-not-str", edited(DOWN, _entry("w", 0, 1)), {}, "bad_header"),
    ("negative-dim", edited(UP, _entry("g", 2, [-50, -1])), {}, "bad_header"),
    ("arrays-reordered", edited(UP, lambda h: h["a"].reverse()), {}, "bad_header"),
    ("arrays-reordered-down", edited(DOWN, lambda h: h["a"].reverse()), {}, "bad_header"),
    ("unknown-array", edited(UP, lambda h: h["a"].append(["z", "<f4", [0], 0])), {}, "bad_header"),
    ("missing-array", edited(UP, lambda h: h["a"].pop(1)), {}, "bad_header"),
    ("duplicate-array", insert_array(UP_DENSE, 3, "d", "<f4", np.ones(5, np.float32)), {}, "bad_header"),
    ("down-without-weights", remove_array(DOWN, "w"), {}, "bad_header"),
    ("down-without-weights-header-only", edited(DOWN, lambda h: h["a"].pop(1)), {}, "bad_header"),
    ("down-without-state", remove_array(DOWN, "ss"), {}, "bad_header"),
    ("down-weights-twice", insert_array(DOWN, 2, "w", "<f4", np.ones(2, np.float32)), {}, "bad_header"),
    # version-2 stamps on what a version-1 sender would have written, and each removed field alone
    ("v1-uplink-stamped-2", v1_uplink(version=2), {}, "bad_header"),
    ("v1-downlink-log-stamped-2", v1_downlink("log", version=2), {}, "bad_header"),
    ("v1-downlink-weights-stamped-2", v1_downlink("weights", version=2), {}, "bad_header"),
    ("up-personalization-p", insert_array(UP, 2, "p", "<f4", _PERSONALIZATION), {}, "bad_header"),
    ("up-personalization-p-after-dense", insert_array(UP_DENSE, 3, "p", "<f4", _PERSONALIZATION), {},
     "bad_header"),
    ("up-empty-p", insert_array(UP, 2, "p", "<f4", np.zeros(0, np.float32)), {}, "bad_header"),
    ("down-old-mode-weights", edited(DOWN, _set("o", "weights")), {}, "bad_header"),
    ("down-old-mode-log", edited(DOWN, _set("o", "log")), {}, "bad_header"),
    ("down-old-mode-null", edited(DOWN, _set("o", None)), {}, "bad_header"),
    ("down-old-seeds-s", insert_array(DOWN, 0, "s", "<u8", np.arange(4, dtype=np.uint64)), {}, "bad_header"),
    ("down-old-log-seeds-ls", insert_array(DOWN, 0, "ls", "<u8", _LOG_SEEDS), {}, "bad_header"),
    ("down-old-log-coeffs-lc", insert_array(DOWN, 0, "lc", "<f4", _LOG_COEFFS), {}, "bad_header"),
    ("down-empty-ls", insert_array(DOWN, 0, "ls", "<u8", np.zeros(0, np.uint64)), {}, "bad_header"),
    ("down-uplink-array", insert_array(DOWN, 2, "g", "<f4", np.zeros((1, 1), np.float32)), {}, "bad_header"),
    ("config-nested", edited(DOWN, _set("k", {"lr": {"x": 1}})), {}, "bad_header"),
    ("config-list", edited(DOWN, _set("k", [1])), {}, "bad_header"),
    ("config-null", edited(DOWN, _set("k", {"lr": None})), {}, "bad_header"),
    ("dtype-f8", edited(UP, _entry("g", 1, "<f8")), {}, "dtype"),
    ("dtype-big-endian", edited(UP, _entry("g", 1, ">f4")), {}, "dtype"),
    ("dtype-seeds-signed", edited(UP_EXPLICIT, _entry("s", 1, "<i8")), {}, "dtype"),
    ("dtype-dense-f2", edited(UP_DENSE, _entry("d", 1, "<f2")), {}, "dtype"),
    ("dtype-object", edited(DOWN, _entry("ss", 1, "O")), {}, "dtype"),
    ("dtype-weights-big-endian", edited(DOWN, _entry("w", 1, ">f4")), {}, "dtype"),
    ("dtype-weights-u4", edited(DOWN, _entry("w", 1, "<u4")), {}, "dtype"),
    ("length-shape", edited(UP, _entry("g", 2, [49, 1])), {}, "length_mismatch"),
    ("length-nbytes", edited(UP, _entry("g", 3, 196)), {}, "length_mismatch"),
    ("length-weights", edited(DOWN, _entry("w", 3, 36)), {}, "length_mismatch"),
    ("length-state", edited(DOWN, _entry("ss", 2, [2])), {}, "length_mismatch"),
    # huge declared lengths are refused before anything is allocated or read
    ("huge-nbytes", edited(UP, _entry("g", 3, 2**64 - 1)), {}, "length_mismatch"),
    ("nbytes-over-uint64", edited(UP, _entry("g", 3, 2**64)), {}, "bad_header"),
    ("dim-over-uint32", edited(UP, _entry("g", 2, [2**32, 1])), {}, "bad_header"),
    ("huge-grads", edited(UP, _shape("g", [2**31, 2**29])), {}, "truncated"),
    ("huge-weights", edited(DOWN, _shape("w", [2**32 - 1])), {}, "truncated"),
    ("huge-state", edited(DOWN, _shape("ss", [2**32 - 1])), {}, "truncated"),
    ("huge-weights-nbytes", edited(DOWN, _entry("w", 3, 2**63)), {}, "length_mismatch"),
    ("ndim", edited(UP, _entry("g", 2, [50])), {}, "shape"),
    ("ndim-weights", edited(DOWN, _entry("w", 2, [2, 5])), {}, "shape"),
    ("ndim-state", edited(DOWN, _entry("ss", 2, [3, 1])), {}, "shape"),
    ("ndim-weights-scalar", edited(DOWN, _entry("w", 2, [])), {}, "shape"),
    ("rows-vs-seeds", edited(UP_EXPLICIT, _entry("g", 2, [8, 1])), {}, "shape"),
    ("both-seeds", edited(UP_EXPLICIT, _set("b", 5)), {}, "shape"),
    ("no-seeds", edited(UP, _set("b", None)), {}, "shape"),
    ("nan-grads", set_value(UP, "g", 17, float("nan")), {}, "non_finite"),
    ("inf-dense", set_value(UP_DENSE, "d", 0, float("inf")), {}, "non_finite"),
    ("nan-dense", set_value(UP_DENSE, "d", 4, float("nan")), {}, "non_finite"),
    ("nan-state", set_value(DOWN, "ss", 2, float("nan")), {}, "non_finite"),
    ("inf-state", set_value(DOWN, "ss", 0, float("inf")), {}, "non_finite"),
    ("inf-weights", set_value(DOWN, "w", 3, float("-inf")), {}, "non_finite"),
    ("nan-weights-last", set_value(DOWN, "w", 9, float("nan")), {}, "non_finite"),
    ("nan-metric", edited(UP, _set("m", {"loss": float("nan")})), {}, "non_finite"),
    ("huge-metric", header_text(UP, "0.6931471805599453", "1e400"), {}, "non_finite"),
    ("huge-int-metric", edited(UP, _set("m", {"loss": 10**400})), {}, "non_finite"),
    ("inf-config", edited(DOWN, _set("k", {"lr": float("inf")})), {}, "non_finite"),
    ("huge-config", header_text(DOWN, "0.0001", "1e400"), {}, "non_finite"),
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


def test_malformed_case_ids_are_unique():
    names = [c[0] for c in MALFORMED]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("data", [v1_uplink(), v1_downlink("log"), repack(DOWN, version=1)], ids=["up", "log", "down"])
def test_version_1_is_refused_naming_both_versions(data):
    with pytest.raises(MessageError) as info:
        decode(data)
    assert info.value.reason == "version"
    assert "version 1 " in str(info.value) and f"speaks {PROTOCOL_VERSION}" in str(info.value), str(info.value)


def test_helpers_without_edit_are_identity():
    # the helpers themselves must not change a valid message, or the cases above would test two things at once
    for data in (UP, UP_EXPLICIT, UP_DENSE, DOWN, DOWN_BARE):
        assert_same(decode(repack(data)), decode(data))
    # inserting or removing a legal array by hand gives exactly what encode() writes
    assert insert_array(UP, 2, "d", "<f4", np.ones(5, np.float32)) == UP_DENSE
    assert remove_array(UP_DENSE, "d") == UP
    state, weights = decode(DOWN).server_state, decode(DOWN).weights
    assert insert_array(remove_array(DOWN, "w"), 1, "w", "<f4", weights) == DOWN
    assert insert_array(remove_array(DOWN, "ss"), 0, "ss", "<f4", state) == DOWN
    # the hand-built v1 messages differ from v2 only in what v2 removed: undoing that gives a valid v2 message
    assert remove_array(v1_uplink(version=2), "p") == UP
    undone = v1_downlink("weights", version=2)
    for key in ("s", "ls", "lc"):
        undone = remove_array(undone, key)
    assert repack(undone, lambda h: h.pop("o")) == repack(DOWN)
    assert_same(decode(repack(undone, lambda h: h.pop("o"))), downlink())


@pytest.mark.parametrize("data", [UP, DOWN], ids=["uplink", "downlink"])
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


def half_uplink(steps: int = 8, queries: int = 4) -> ClientUpdate:
    """An uplink whose scalars were rounded to float16 by the client, as zo_step(scalar_bits=16) rounds them."""
    msg = uplink(steps=steps, queries=queries)
    return replace(msg, grads=msg.grads.astype(np.float16).astype(np.float32), scalar_bits=16)


def test_float16_scalars_travel_in_half_the_bytes_and_decode_to_the_same_float32_values():
    half, full = half_uplink(), replace(half_uplink(), scalar_bits=32)
    data = encode(half)
    (_, _, _, header_len), header, _ = split(data)
    assert header["a"][1] == ["g", "<f2", [8, 4], 64]
    assert len(data) == PREFIX.size + header_len + 2 * 8 * 4  # 2 bytes a scalar
    assert message_nbytes(full) - len(data) == 2 * 8 * 4 + 1  # and the header's byte count is one digit shorter
    back = decode(data)
    assert back.scalar_bits == 16 and back.grads.dtype == np.float32
    assert_same(back, half)
    assert encode(back) == data  # canonical: a decoded message re-encodes to its own bytes


def test_float16_scalars_must_hold_float16_values_and_any_new_numbers_travel_as_float32():
    msg = half_uplink()
    unrounded = replace(msg, grads=msg.grads + np.float32(1e-4))
    with pytest.raises(MessageError, match="must hold float16 values") as err:
        encode(unrounded)
    assert err.value.reason == "bad_field"
    with pytest.raises(MessageError, match="scalar_bits must be one of") as err:
        encode(replace(msg, scalar_bits=8))
    clipped = msg.with_numbers(msg.grads * 0.3)  # the server's clip, say: no longer float16 values
    assert clipped.scalar_bits == 32 and decode(encode(clipped)).scalar_bits == 32
    nan = replace(msg, grads=np.full_like(msg.grads, np.nan))
    with pytest.raises(MessageError) as err:
        encode(nan)
    assert err.value.reason == "non_finite"  # not blamed on the rounding


def test_a_header_naming_another_scalar_dtype_is_refused():
    data = bytearray(encode(half_uplink()))
    at = bytes(data).index(b'"<f2"')
    data[at:at + 5] = b'"<f8"'
    with pytest.raises(MessageError, match="grads must have dtype <f4 or <f2") as err:
        decode(bytes(data))
    assert err.value.reason == "dtype"
