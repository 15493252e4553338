"""Seeded perturbation noise: a pure function of (seed, tensor, element index), the same bits on every device.

Every party regenerates a perturbation from its seed instead of storing or sending it, so client and server
must compute the same values even when one runs on a GPU and the other on a CPU. Torch's generators do not
promise that (the CPU and CUDA streams differ for the same seed, and CUDA's differs between GPU models for
large tensors), so zofed's noise is counter-based, computed with 32-bit integer tensor operations only:

    key         = derive_seed(seed, tensor)                  (splitmix64 in Python; k0, k1 its two halves)
    word(j)     = mix(mix(j xor k0) xor k1)                  (j: the counter; mix: the lowbias32 integer hash)
    rademacher  element e is +1 if bit 31 - (e mod 32) of word(e div 32) is 0, else -1
    gaussian    elements 2m, 2m+1 are Box-Muller of the words of counters 2**31 + 2m and 2**31 + 2m + 1

Integer multiplication wraps modulo 2**32 on every torch backend, so the words, and therefore Rademacher
noise, are bit-identical on CPU, CUDA and MPS, whatever the chunking, the thread count or the other tensors of
the model. Gaussian noise is bit-identical where log, sqrt and cos round alike; elsewhere it may differ in the
last bit or two of float32 (tests bound it against a float64 evaluation). `tests/test_noise.py` holds the
committed vectors every platform must reproduce.

Tensors are cut into chunks of CHUNK elements only to bound the scratch memory; the values do not depend on it.
One code path serves one seed and many: `words_of_seeds` hashes a (seeds, words) grid and `NoiseSource.chunk` is
`NoiseSource.rows` for one seed, so a client's step and a server's rebuild of thousands of seeds make the same bits.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

NoiseKind = Literal["rademacher", "gaussian"]
NOISE_KINDS: tuple[str, ...] = ("rademacher", "gaussian")
CHUNK = 1 << 18  # elements per scratch chunk (a multiple of 64, so chunks start on word and pair boundaries)
GAUSSIAN_COUNTER = 1 << 31  # gaussian words count from here, apart from rademacher's
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_SIGN_BIT = -(2**31)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed; nearby inputs give unrelated streams."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h >> 1


def _int32(value: int) -> int:
    """An unsigned 32-bit constant as the signed value torch's int32 holds."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


_M1, _M2 = _int32(0x7FEB352D), _int32(0x846CA68B)


def _shr(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of uint32 values held in int32 (torch's >> on int32 keeps the sign), into `out`."""
    return torch.bitwise_right_shift(x, k, out=out).bitwise_and_((1 << (32 - k)) - 1)


def _mix_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """lowbias32 (Wellons' integer hash prospector), in place on int32 values read as uint32; `scratch` (x's shape)
    holds the shifted copies, so a caller with a reusable one allocates nothing."""
    tmp = torch.empty_like(x) if scratch is None else scratch
    x.bitwise_xor_(_shr(x, 16, tmp)).mul_(_M1)
    x.bitwise_xor_(_shr(x, 15, tmp)).mul_(_M2)
    return x.bitwise_xor_(_shr(x, 16, tmp))


def tensor_key(seed: int, tensor_index: int) -> tuple[int, int]:
    """The two 32-bit keys of one tensor's noise under `seed`, as int32 values."""
    key = derive_seed(seed, tensor_index)
    return _int32(key), _int32(key >> 32)


def _counters_(out: torch.Tensor, start: int) -> torch.Tensor:
    """Fills flat int32 `out` with the counters start, start + 1, ... modulo 2**32 (as two's complement), in place:
    the signed values run on by one except where the unsigned ones cross 2**31, so one arange on each side."""
    first, n = start & _MASK32, out.numel()
    head = min(n, ((1 << 31) - first) % (1 << 32) or n)
    low = _int32(first)
    torch.arange(low, low + head, dtype=torch.int32, out=out[:head])
    if head < n:
        torch.arange(-(1 << 31), -(1 << 31) + n - head, dtype=torch.int32, out=out[head:])
    return out


def words_of_seeds(seeds: Sequence[int], tensor_index: int, start: int, count: int,
                   device: torch.device | str = "cpu", *, out: torch.Tensor | None = None,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Random words `start` .. `start + count - 1` of one tensor's stream under each seed, one int32 row per seed
    (the bits are what count): the same integer operations on a (seeds, count) grid, so a row does not depend on
    the other seeds (a server rebuilding thousands of small tensors pays one call). Written into `out` when given
    (int32 of that shape, on `device`), with `scratch` (the same) for the hash's shifted copies: a one-seed caller
    that passes both allocates nothing (its keys stay Python ints, with no tensor made or copied to the device)."""
    keys = [tensor_key(s, tensor_index) for s in seeds]
    x = torch.empty((len(keys), count), dtype=torch.int32, device=device) if out is None else out
    _counters_(x[0], start)
    if len(keys) == 1:
        k0, k1 = keys[0]
    else:
        x[1:].copy_(x[:1])
        k0, k1 = torch.tensor(keys, dtype=torch.int32, device=device).unsqueeze(-1).unbind(1)
    _mix_(x.bitwise_xor_(k0), scratch)
    return _mix_(x.bitwise_xor_(k1), scratch)


def _sign_bits(w: torch.Tensor, shifts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 32 bits of each word, most significant first, as the sign bits of int32 values (their other bits 0):
    words of shape (..., n) give (..., n, 32), into `out` when given. `shifts` is arange(32) on the words' device."""
    return torch.bitwise_left_shift(w.unsqueeze(-1), shifts, out=out).bitwise_and_(_SIGN_BIT)


class NoiseSource:
    """Writes seeded noise chunks into a reusable buffer on one device; one per thread of work.

    Its scratch is fixed (a chunk's floats, words and the hash's shifted copies), whatever the tensors' sizes.
    With `cache_words=True` the random words behind Rademacher chunks are kept (1 bit per element, 1/32 of the
    parameters' memory) so the several passes of one ZO step hash them only once; `prefetch` keeps the signs of
    small tensors ready-made (4 bytes per element and seed); `clear()` drops both.
    """

    def __init__(self, kind: NoiseKind, cache_words: bool = False, device: torch.device | str = "cpu") -> None:
        if kind not in NOISE_KINDS:
            raise ValueError(f"unknown noise kind {kind!r}; choose one of {', '.join(NOISE_KINDS)}")
        self.kind = kind
        self.device = torch.device(device)
        self._bits = torch.empty(CHUNK, dtype=torch.int32, device=self.device)
        self._shifts = torch.arange(32, dtype=torch.int32, device=self.device)
        # one chunk's words and the hash's shifted copies: reused, so a pass over a model allocates nothing per chunk
        self._words = torch.empty(CHUNK // 32, dtype=torch.int32, device=self.device)
        self._scratch = torch.empty(CHUNK // 32, dtype=torch.int32, device=self.device)
        self._cache: dict[tuple[int, int, int], torch.Tensor] | None = {} if cache_words else None
        self._signs: dict[tuple[int, int, int], torch.Tensor] = {}  # (seed, tensor, start) -> the chunk's sign bits

    def clear(self) -> None:
        self._signs.clear()
        if self._cache is not None:
            self._cache.clear()

    def _rademacher_words(self, seeds: Sequence[int], tensor_index: int, start: int, count: int) -> torch.Tensor:
        """The words behind a Rademacher grid, (seeds, count): one seed's kept in the word cache when there is one,
        else written into the source's scratch when they fit (valid until the next call), else new."""
        key = (seeds[0], tensor_index, start)
        if self._cache is not None and len(seeds) == 1:
            if key not in self._cache:
                self._cache[key] = words_of_seeds(seeds, tensor_index, start, count, self.device,
                                                  scratch=self._scratch[:count].view(1, count))
            return self._cache[key]
        n = len(seeds) * count
        if n > self._words.numel():
            return words_of_seeds(seeds, tensor_index, start, count, self.device)
        return words_of_seeds(seeds, tensor_index, start, count, self.device, out=self._words[:n].view(-1, count),
                              scratch=self._scratch[:n].view(-1, count))

    def prefetch(self, seeds: Sequence[int], tensor_index: int, numel: int) -> None:
        """Make one tensor's Rademacher signs for all `seeds` now, one pass over all seeds per chunk, and keep them
        for `chunk`: a step that reads each of its queries' noise twice then makes it once, for all queries at once."""
        if self.kind != "rademacher":
            raise ValueError("only Rademacher noise can be prefetched (Gaussian noise is made seed by seed)")
        for _, start, end in chunk_bounds(numel):
            grid = _sign_bits(words_of_seeds(seeds, tensor_index, start // 32, (end - start + 31) // 32, self.device),
                              self._shifts)
            rows = grid.view(len(seeds), -1)[:, : end - start]
            self._signs.update({(seed, tensor_index, start): row for seed, row in zip(seeds, rows, strict=True)})

    def chunk(self, seed: int, tensor_index: int, start: int, size: int, scale: float = 1.0) -> torch.Tensor:
        """`scale * z` for elements `start` .. `start + size - 1` of one tensor: `rows` for one seed, as a float32
        view that is valid until the next call. `start` must be a multiple of 64 (chunk_bounds gives such chunks)."""
        if self.kind == "rademacher" and size > CHUNK:
            raise ValueError(f"a Rademacher chunk holds at most {CHUNK} elements (its reused buffer), not {size}")
        return self.rows([seed], tensor_index, start, size, [scale])[0]

    def rows(self, seeds: Sequence[int], tensor_index: int, start: int, size: int,
             scales: Sequence[float]) -> torch.Tensor:
        """`scales[k] * z(seeds[k])` over elements `start` .. `start + size - 1` of one tensor, one float32 row per
        seed; row k does not depend on the other seeds. Rademacher rows are made in one pass over all seeds, into
        the source's reused buffer when they fit one chunk (then valid until the next call; else a new tensor).
        Gaussian rows are made one seed at a time (a vectorized kernel's tail may round its transcendentals
        differently)."""
        if start % 64:
            raise ValueError(f"noise chunks start on a multiple of 64 elements, not at {start}")
        if self.kind == "gaussian":
            z = [gaussian(s, tensor_index, start, size, self.device).mul_(c)
                 for s, c in zip(seeds, scales, strict=True)]
            return z[0].unsqueeze(0) if len(z) == 1 else torch.stack(z)
        count, n = (size + 31) // 32, len(seeds)
        out = self._bits[: n * count * 32].view(n, count * 32) if n * count * 32 <= self._bits.numel() else None
        kept = self._signs.get((seeds[0], tensor_index, start)) if n == 1 else None  # prefetched
        if kept is None:
            w = self._rademacher_words(seeds, tensor_index, start // 32, count)
            signs = _sign_bits(w, self._shifts, out=None if out is None else out.view(n, count, 32)).view(n, -1)
        else:
            signs = kept.unsqueeze(0)
        # Bit k of a word is the sign bit of entry k; xor with a float32 scale's bits (its sign and magnitude)
        # makes +-scale: 32 entries per word with integer operations only.
        if n == 1:
            scale_bits = _float_bits(scales[0])  # a Python int: no tensor made or copied to the device
        else:
            scale_bits = torch.tensor(scales, dtype=torch.float64).to(torch.float32).view(torch.int32)
            scale_bits = scale_bits.to(self.device)[:, None]
        signs = signs[:, :size]
        into = signs if kept is None else None if out is None else out[:, :size]  # kept signs stay as they are
        return torch.bitwise_xor(signs, scale_bits, out=into).view(torch.float32)


def gaussian(seed: int, tensor_index: int, start: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard normal elements `start` .. `start + size - 1` of one tensor (start even): Box-Muller on pairs of
    words, u1 in (0, 1] and u2 in [0, 1) from their top 24 bits."""
    pairs = (size + 1) // 2
    w = words_of_seeds([seed], tensor_index, GAUSSIAN_COUNTER + start, 2 * pairs, device).view(pairs, 2)
    u = _shr(w, 8).to(torch.float32).mul_(2.0**-24)
    radius = torch.log1p(-u[:, 0]).mul_(-2.0).sqrt_()  # 1 - u1 lies in (0, 1]: log is finite
    angle = u[:, 1].mul(2 * math.pi)
    z = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1).reshape(-1)
    return z[:size]


def chunk_bounds(numel: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, start, end) over a flat tensor of `numel` elements."""
    for index, start in enumerate(range(0, numel, CHUNK)):
        yield index, start, min(start + CHUNK, numel)
