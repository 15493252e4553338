"""Wire protocol between clients and server: typed messages, a versioned byte encoding, validation on receipt.

Every message is laid out as (all integers and arrays little-endian, whatever the platform):

    magic b"ZOFD" | uint16 version | uint8 kind (1 uplink, 2 downlink) | uint32 header length
    | UTF-8 JSON header (sorted keys, no whitespace) | raw array bytes, in header order

The header holds the scalar fields under one-letter keys (a seed-and-scalar uplink is a few hundred bytes, so
the header is a large share of it) and one [key, dtype, shape, byte length] entry per array:

    uplink:   r round_id, c client_id, b base_seed (null: explicit seeds), n num_examples, m metrics, a arrays
              arrays s seeds, g grads (float32, or float16 when the client rounded them: scalar_bits 16),
              d dense (only when not None)
    downlink: r round_id, k config, a arrays
              arrays ss server_state, w weights

Version 2 carries only what some method sends (every downlink carries the weights). Float16 scalars are optional
within it: a float32 message is the same bytes either way, and a receiver without float16 scalars refuses a float16
one with a dtype error.

Decoding evaluates nothing: it parses JSON, compares each dtype string with the one its field requires and
checks every length against the bytes at hand before reading, so untrusted bytes can only raise MessageError.
"""

from __future__ import annotations

import json
import math
import numbers
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zofed.zo.noise import derive_seed

PROTOCOL_VERSION = 2
MAGIC = b"ZOFD"
KIND_UPLINK = 1
KIND_DOWNLINK = 2
MAX_HEADER_BYTES = 64 * 2**10  # scalars, metrics, config and array descriptors only: more is abuse
_PREFIX = struct.Struct("<4sHBI")  # magic, version, kind, header length
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_JSON_ARGS: dict[str, Any] = {"sort_keys": True, "separators": (",", ":"), "allow_nan": False, "ensure_ascii": False}


class MessageError(ValueError):
    """A message that must not be sent or accepted: `reason` is a short code for programs, str() a sentence.

    Reasons: too_large, bad_magic, version, unknown_kind, truncated, trailing_bytes, bad_header (decoded
    header fields), bad_field (the same problems in an in-memory message), dtype, length_mismatch, shape,
    non_finite, wrong_round, wrong_client; and from the server's check against the round (server.py): seeds
    (not the step seeds the method assigned the client).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # keep the reason across process boundaries (e.g. simulation workers)
        return type(self), (self.reason, str(self))


# eq=False: the generated __eq__/__hash__ would compare numpy arrays with `==` and fail.
@dataclass(frozen=True, eq=False)
class ClientUpdate:
    """Uplink: one client's round as step seeds and projected-gradient scalars, plus small extras."""

    round_id: int  # uint32
    client_id: int  # uint32
    seeds: np.ndarray  # uint64 (steps,); empty when base_seed is used
    base_seed: int | None  # uint64; step t's seed is derive_seed(base_seed, t), t = 0, 1, ... (see step_seeds)
    grads: np.ndarray  # float32 (steps, queries)
    num_examples: int  # uint32
    metrics: dict[str, float]  # finite numbers, sent as JSON in the header
    dense: np.ndarray | None = None  # float32 flat update, for baselines that upload one (FedAvg, FedZO)
    # 16: the grads travel as float16 (half the bytes a scalar), which they must then hold exactly: the client
    # rounds each scalar before its step uses it (zo_step's scalar_bits), so the server's replay stays exact
    scalar_bits: int = 32

    @property
    def numbers(self) -> np.ndarray:
        """What the uplink says about the update: its dense update, or its scalars."""
        return self.dense if self.dense is not None else self.grads

    def with_numbers(self, values: np.ndarray) -> ClientUpdate:
        """The same uplink carrying `values` (float32) in place of `numbers` (clipped, noised, or a lie); new
        scalars travel as float32, whatever the old ones did."""
        values = np.asarray(values, np.float32)
        return replace(self, **({"dense": values} if self.dense is not None else {"grads": values, "scalar_bits": 32}))


@dataclass(frozen=True, eq=False)
class ServerBroadcast:
    """Downlink: the new trainable weights, the method's state for this client and the round plan."""

    round_id: int  # uint32
    server_state: np.ndarray  # float32 (k,): what the method sends this client (zofed: its block distribution)
    weights: np.ndarray  # float32 flat trainable tensors
    config: dict[str, float | int | str] = field(default_factory=dict)  # small per-round settings, JSON


Message = ClientUpdate | ServerBroadcast


@dataclass(frozen=True)
class _Array:
    key: str  # name on the wire
    attr: str
    dtype: str  # the wire dtype the field travels as, and the in-memory one
    ndims: tuple[int, ...]
    optional: bool = False
    narrow: str | None = None  # a narrower wire dtype it may travel as instead (read back as `dtype`)


SCALAR_BITS = (32, 16)  # the widths a ClientUpdate's scalars may travel with (16: the grads' narrow dtype)


_UPLINK_ARRAYS = (
    _Array("s", "seeds", "<u8", (1,)),
    _Array("g", "grads", "<f4", (2,), narrow="<f2"),
    _Array("d", "dense", "<f4", (1,), optional=True),
)
_DOWNLINK_ARRAYS = (
    _Array("ss", "server_state", "<f4", (1,)),
    _Array("w", "weights", "<f4", (1,)),
)
_UPLINK_KEYS = {"r", "c", "b", "n", "m", "a"}
_DOWNLINK_KEYS = {"r", "k", "a"}


def validate(msg: Message) -> None:
    """Raise MessageError if `msg` breaks any rule that decode() enforces on received bytes."""
    _validate(msg, "bad_field")


def encode(msg: Message) -> bytes:
    """The canonical bytes of a valid message: the same message always gives the same bytes."""
    validate(msg)
    if isinstance(msg, ClientUpdate):
        kind, specs = KIND_UPLINK, _UPLINK_ARRAYS
        base = None if msg.base_seed is None else int(msg.base_seed)
        header: dict[str, Any] = {"r": int(msg.round_id), "c": int(msg.client_id), "b": base,
                                  "n": int(msg.num_examples), "m": {k: float(v) for k, v in msg.metrics.items()}}
    else:
        kind, specs = KIND_DOWNLINK, _DOWNLINK_ARRAYS
        header = {"r": int(msg.round_id), "k": dict(msg.config)}
    arrays = [(spec, _wire_dtype(msg, spec), getattr(msg, spec.attr)) for spec in specs
              if getattr(msg, spec.attr) is not None]
    header["a"] = [[spec.key, dtype, list(a.shape), a.size * _itemsize(dtype)] for spec, dtype, a in arrays]
    blob = json.dumps(header, **_JSON_ARGS).encode("utf-8")
    if len(blob) > MAX_HEADER_BYTES:  # receivers would refuse it
        raise MessageError("too_large", f"header is {len(blob)} bytes, over {MAX_HEADER_BYTES}: trim metrics/config")
    parts = [_PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(blob)), blob]
    parts += [np.ascontiguousarray(a, dtype=dtype).tobytes() for _, dtype, a in arrays]
    return b"".join(parts)


def _wire_dtype(msg: Message, spec: _Array) -> str:
    """The grads travel narrow when the uplink says so (scalar_bits 16); every other array as its own dtype."""
    return spec.narrow if spec.narrow is not None and msg.scalar_bits == 16 else spec.dtype


def _itemsize(dtype: str) -> int:
    return int(dtype[2:])


def uplink_max_bytes(steps: int, queries: int, dense_values: int | None = None) -> int:
    """The most bytes a valid uplink of this round plan can take: the prefix, a header at its cap and the arrays at
    their widest (`steps` listed seeds and float32 scalars, or `dense_values` float32 values and no scalars). A
    receiver refuses anything longer before parsing it."""
    arrays = 4 * dense_values if dense_values is not None else 8 * steps + 4 * steps * queries
    return _PREFIX.size + MAX_HEADER_BYTES + arrays


def message_nbytes(msg: Message) -> int:
    """Bytes on the wire: how communication is counted, up and down."""
    return len(encode(msg))


def decode(data: bytes | bytearray | memoryview, *, expect_round: int | None = None,
           expect_client: int | None = None, max_bytes: int = 64 * 2**20) -> Message:
    """Parse and fully validate received bytes; raise MessageError for anything not acceptable.

    `expect_client` applies to uplinks only: a broadcast names no client.
    """
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise MessageError("too_large", f"message is {len(view)} bytes, over the limit of {max_bytes}")
    if len(view) < _PREFIX.size:
        raise MessageError("truncated", f"message is {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, kind, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise MessageError("bad_magic", f"magic is {magic!r}, expected {MAGIC!r}: not a zofed message")
    if version != PROTOCOL_VERSION:
        raise MessageError("version", f"protocol version {version} is not supported (this side speaks "
                                      f"{PROTOCOL_VERSION})")
    if kind not in (KIND_UPLINK, KIND_DOWNLINK):
        raise MessageError("unknown_kind", f"message kind {kind} is unknown (1 uplink, 2 downlink)")
    if header_len > MAX_HEADER_BYTES:
        raise MessageError("too_large", f"header length {header_len} is over the limit of {MAX_HEADER_BYTES}")
    end = _PREFIX.size + header_len
    if end > len(view):
        raise MessageError("truncated", f"header needs {header_len} bytes but only {len(view) - _PREFIX.size} follow")
    header = _parse_header(view[_PREFIX.size:end])
    keys, specs = (_UPLINK_KEYS, _UPLINK_ARRAYS) if kind == KIND_UPLINK else (_DOWNLINK_KEYS, _DOWNLINK_ARRAYS)
    if not isinstance(header, dict) or set(header) != keys:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise MessageError("bad_header", f"header must be an object with keys {sorted(keys)}, got {got}")
    arrays, narrowed, offset = _read_arrays(header["a"], specs, view, end)
    if offset != len(view):
        raise MessageError("trailing_bytes", f"{len(view) - offset} bytes follow the last array")
    msg: Message
    if kind == KIND_UPLINK:
        msg = ClientUpdate(round_id=header["r"], client_id=header["c"], base_seed=header["b"],
                           num_examples=header["n"], metrics=header["m"], **arrays,
                           scalar_bits=16 if "grads" in narrowed else 32)
    else:
        msg = ServerBroadcast(round_id=header["r"], config=header["k"], **arrays)
    _validate(msg, "bad_header")
    if expect_round is not None and msg.round_id != expect_round:
        raise MessageError("wrong_round", f"round_id is {msg.round_id}, expected {expect_round}")
    if expect_client is not None and isinstance(msg, ClientUpdate) and msg.client_id != expect_client:
        raise MessageError("wrong_client", f"client_id is {msg.client_id}, expected {expect_client}")
    return msg


def step_seeds(update: ClientUpdate, steps: int | None = None) -> np.ndarray:
    """uint64 seed of each local step: the explicit seeds, or derive_seed(base_seed, t) for t = 0 .. steps-1.

    `steps` defaults to the number of grads rows; with explicit seeds it must match their count.
    """
    if update.base_seed is None:
        if steps is not None and steps != len(update.seeds):
            raise ValueError(f"update carries {len(update.seeds)} explicit seeds, asked for {steps}")
        return update.seeds.astype(np.uint64)  # a copy: the message stays immutable
    count = update.grads.shape[0] if steps is None else steps
    return np.array([derive_seed(update.base_seed, t) for t in range(count)], dtype=np.uint64)


def _parse_header(raw: memoryview) -> Any:
    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MessageError("bad_header", f"header is not valid UTF-8 JSON: {exc}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # json keeps the last silently: refuse the ambiguity
        raise ValueError("duplicate key in header object")
    return out


def _is_uint(value: Any, limit: int) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and 0 <= value <= limit


def _read_arrays(entries: Any, specs: tuple[_Array, ...], view: memoryview,
                 offset: int) -> tuple[dict[str, np.ndarray], set[str], int]:
    """Arrays described by header entries [key, dtype, shape, nbytes], read from `view` starting at `offset`, each
    in its field's in-memory dtype; also the fields that travelled in their narrower dtype."""
    if not isinstance(entries, list) or not all(_is_descriptor(e) for e in entries):
        raise MessageError("bad_header", "header 'a' must be a list of [key, dtype, shape, nbytes] entries, "
                                         f"each dimension in 0..{_U32_MAX}")
    keys = [e[0] for e in entries]
    expected = [s.key for s in specs if not s.optional or s.key in keys]
    if keys != expected:  # one canonical order, so re-encoding a decoded message gives the same bytes
        raise MessageError("bad_header", f"arrays must be {expected} in that order, got {keys}")
    by_key = {s.key: s for s in specs}
    arrays, narrowed = {}, set()
    for key, dtype, shape, nbytes in entries:
        spec = by_key[key]
        if dtype not in (spec.dtype, spec.narrow):
            allowed = spec.dtype if spec.narrow is None else f"{spec.dtype} or {spec.narrow}"
            raise MessageError("dtype", f"{spec.attr} must have dtype {allowed}, got {dtype!r}")
        if len(shape) not in spec.ndims:
            raise MessageError("shape", f"{spec.attr} must have {' or '.join(map(str, spec.ndims))} dimensions, "
                                        f"got shape {shape}")
        if nbytes != math.prod(shape) * _itemsize(dtype):
            raise MessageError("length_mismatch", f"{spec.attr} declares {nbytes} bytes but shape {shape} of "
                                                  f"{dtype} needs {math.prod(shape) * _itemsize(dtype)}")
        if offset + nbytes > len(view):
            raise MessageError("truncated", f"{spec.attr} needs {nbytes} bytes but {len(view) - offset} remain")
        raw = np.frombuffer(view, dtype=dtype, count=nbytes // _itemsize(dtype), offset=offset)
        arrays[spec.attr] = raw.reshape(shape).astype(np.dtype(spec.dtype).newbyteorder("="))  # owned, native
        if dtype != spec.dtype:
            narrowed.add(spec.attr)
        offset += nbytes
    return arrays, narrowed, offset


def _is_descriptor(entry: Any) -> bool:
    return (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and isinstance(entry[1], str)
            and isinstance(entry[2], list) and all(_is_uint(d, _U32_MAX) for d in entry[2])
            and _is_uint(entry[3], _U64_MAX))


def _validate(msg: Message, field_reason: str) -> None:
    """Checks shared by validate() and decode(); `field_reason` tells a bad in-memory field from a bad header."""
    if isinstance(msg, ClientUpdate):
        name, specs = "ClientUpdate", _UPLINK_ARRAYS
        _check_uint(msg, "round_id", _U32_MAX, field_reason)
        _check_uint(msg, "client_id", _U32_MAX, field_reason)
        _check_uint(msg, "num_examples", _U32_MAX, field_reason)
        if msg.base_seed is not None:
            _check_uint(msg, "base_seed", _U64_MAX, field_reason)
        _check_dict(msg.metrics, "ClientUpdate.metrics", field_reason, strings=False)
        _check_arrays(msg, name, specs)
        steps = msg.grads.shape[0]
        if msg.base_seed is not None and len(msg.seeds):
            raise MessageError("shape", f"ClientUpdate has both base_seed and {len(msg.seeds)} seeds: give one")
        if msg.base_seed is None and len(msg.seeds) != steps:
            raise MessageError("shape", f"ClientUpdate.grads has {steps} rows but seeds has {len(msg.seeds)} "
                                        "entries and there is no base_seed")
        if steps and not msg.grads.shape[1]:
            raise MessageError("shape", f"ClientUpdate.grads has {steps} steps of 0 queries")
        if msg.scalar_bits not in SCALAR_BITS:
            raise MessageError(field_reason, f"ClientUpdate.scalar_bits must be one of {list(SCALAR_BITS)}, got "
                                             f"{msg.scalar_bits!r}")
        if msg.scalar_bits == 16 and not _holds_exactly(msg.grads, np.float16):
            raise MessageError(field_reason, "ClientUpdate.grads must hold float16 values to travel as float16 "
                                             "(round them before the step uses them: zo_step's scalar_bits)")
    elif isinstance(msg, ServerBroadcast):
        name, specs = "ServerBroadcast", _DOWNLINK_ARRAYS
        _check_uint(msg, "round_id", _U32_MAX, field_reason)
        _check_dict(msg.config, "ServerBroadcast.config", field_reason, strings=True)
        _check_arrays(msg, name, specs)
    else:
        raise TypeError(f"expected ClientUpdate or ServerBroadcast, got {type(msg).__name__}")
    for spec in specs:  # last: the one check that reads every value
        value = getattr(msg, spec.attr)
        if spec.dtype[1] == "f" and value is not None and not np.isfinite(value).all():
            raise MessageError("non_finite", f"{name}.{spec.attr} holds NaN or infinite values")


def _holds_exactly(values: np.ndarray, dtype: type) -> bool:
    with np.errstate(over="ignore"):  # a value too large for `dtype` becomes inf, which differs from it
        return bool(np.array_equal(values.astype(dtype).astype(values.dtype), values, equal_nan=True))


def _check_uint(msg: Message, attr: str, limit: int, reason: str) -> None:
    value = getattr(msg, attr)
    if not _is_uint(value, limit):
        raise MessageError(reason, f"{type(msg).__name__}.{attr} must be an integer in 0..{limit}, got {value!r}")


def _check_dict(values: Any, where: str, reason: str, *, strings: bool) -> None:
    """metrics (strings=False): finite numbers; config (strings=True): finite int, float or str (JSON-able)."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise MessageError(reason, f"{where} must be a dict with string keys, got {values!r:.80}")
    for key, value in values.items():
        if strings:
            ok = isinstance(value, str | int | float)
        else:  # encode() sends float(value), so any real number but a bool will do
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
        if not ok:
            allowed = "an int, float or str" if strings else "a number"
            raise MessageError(reason, f"{where}[{key!r}] must be {allowed}, got {value!r:.80}")
        if not isinstance(value, str) and not _finite(value):
            raise MessageError("non_finite", f"{where}[{key!r}] is not finite: {value!r:.80}")


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        return False


def _check_arrays(msg: Message, name: str, specs: tuple[_Array, ...]) -> None:
    for spec in specs:
        value = getattr(msg, spec.attr)
        if value is None and spec.optional:
            continue
        if not isinstance(value, np.ndarray) or value.dtype.newbyteorder("<") != np.dtype(spec.dtype):
            got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise MessageError("dtype", f"{name}.{spec.attr} must be a numpy array of {np.dtype(spec.dtype)}, "
                                        f"got {got}")
        if value.ndim not in spec.ndims:
            raise MessageError("shape", f"{name}.{spec.attr} must have {' or '.join(map(str, spec.ndims))} "
                                        f"dimensions, got shape {value.shape}")
        if any(d > _U32_MAX for d in value.shape):
            raise MessageError("shape", f"{name}.{spec.attr} has a dimension over {_U32_MAX}: {value.shape}")
