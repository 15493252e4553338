"""Seeded perturbation noise, regenerated from a seed instead of stored.

Every trainable tensor is cut into fixed-size chunks and each chunk draws from its own generator seeded
by (seed, tensor index, chunk index). Any chunk of any perturbation can therefore be rebuilt on its own,
in any order: the client perturbs and restores in place, and the server streams over tensors to rebuild
a client's update without ever holding a dense copy of the noise.

The chunk size and the seed mixing are part of the reproducibility contract between client and server:
changing them changes every perturbation.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Literal

import torch

NoiseKind = Literal["rademacher", "gaussian"]
NOISE_KINDS: tuple[str, ...] = ("rademacher", "gaussian")
CHUNK = 1 << 18  # elements per seeded chunk: small enough to stay in cache, large enough to amortize calls
_MASK64 = (1 << 64) - 1
_SHIFTS = torch.arange(32, dtype=torch.int32)
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


def _float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


class NoiseSource:
    """Writes seeded noise chunks into a reusable buffer; one per thread of work.

    With `cache_words=True` the random words behind Rademacher chunks are kept (1 bit per element,
    1/32 of the parameters' memory) so the several passes of one ZO step draw them only once; `clear()`
    drops them when the step moves to the next direction.
    """

    def __init__(self, kind: NoiseKind, cache_words: bool = False) -> None:
        if kind not in NOISE_KINDS:
            raise ValueError(f"unknown noise kind {kind!r}; choose one of {', '.join(NOISE_KINDS)}")
        self.kind = kind
        self._gen = torch.Generator(device="cpu")
        self._bits = torch.empty(CHUNK, dtype=torch.int32)
        self._cache: dict[tuple[int, int, int], torch.Tensor] | None = {} if cache_words else None

    def clear(self) -> None:
        if self._cache is not None:
            self._cache.clear()

    def _words(self, seed: int, tensor_index: int, chunk_index: int, words: int) -> torch.Tensor:
        key = (seed, tensor_index, chunk_index)
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        self._gen.manual_seed(derive_seed(seed, tensor_index, chunk_index))
        rand = torch.randint(-(2**31), 2**31, (words,), dtype=torch.int32, generator=self._gen)
        if self._cache is not None:
            self._cache[key] = rand
        return rand

    def chunk(self, seed: int, tensor_index: int, chunk_index: int, size: int, scale: float = 1.0) -> torch.Tensor:
        """`scale * z` for one chunk, as a float32 view that is valid until the next call."""
        if self.kind == "gaussian":
            self._gen.manual_seed(derive_seed(seed, tensor_index, chunk_index))
            z = torch.randn(size, generator=self._gen)
            return z.mul_(scale) if scale != 1.0 else z
        # Rademacher from random bits: bit k of a random word becomes the sign bit of a float whose
        # magnitude bits are |scale|, so one word yields 32 entries of +-scale with integer ops only.
        words = (size + 31) // 32
        rand = self._words(seed, tensor_index, chunk_index, words)
        bits = self._bits[: words * 32].view(words, 32)
        torch.bitwise_left_shift(rand.unsqueeze(1), _SHIFTS, out=bits)
        bits.bitwise_and_(_SIGN_BIT).bitwise_or_(_float_bits(abs(scale)))
        out = self._bits[:size].view(torch.float32)
        return out.neg_() if scale < 0 else out


def chunk_bounds(numel: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, start, end) over a flat tensor of `numel` elements."""
    for index, start in enumerate(range(0, numel, CHUNK)):
        yield index, start, min(start + CHUNK, numel)
