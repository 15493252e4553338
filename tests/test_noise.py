"""The noise contract: a pure function of (seed, tensor, element index), the same bits everywhere.

The committed vectors are what every platform must reproduce (a CUDA or MPS run of this file checks the same
numbers); a plain-Python evaluation of the same hash, with no torch at all, checks the tensor code against the
written definition.
"""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zofed.zo import noise
from zofed.zo.noise import (
    CHUNK,
    GAUSSIAN_COUNTER,
    NoiseSource,
    _counters_,
    derive_seed,
    gaussian,
    words_of_seeds,
)
from zofed.zo.perturb import Perturbation, add_directions_, add_seed_rows_

# (seed, tensor, first word) -> the next four words as uint32
WORD_VECTORS = {
    (0, 0, 0): [3761278579, 1174573768, 3151483190, 1107398617],
    (1, 0, 0): [2885042249, 3487161979, 1951333379, 280435914],
    (2024, 3, 1000): [1535623829, 422764189, 3656158657, 3368085428],
    (2**62 + 5, 17, 2**31 - 4): [3924306674, 3199442314, 1323260543, 1955108163],
}
RADEMACHER_VECTOR = ((9, 2, 128, 0.5), [-0.5, -0.5, -0.5, 0.5, 0.5, 0.5, 0.5, -0.5])
GAUSSIAN_VECTOR = ((7, 1, 64), [0.5711509585380554, -0.5829125642776489, -0.31386303901672363, 0.6057842969894409])


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_word(seed: int, tensor: int, counter: int) -> int:
    """The documented definition, in plain Python integers."""
    key = derive_seed(seed, tensor)
    k0, k1 = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    return _mix(_mix((counter & 0xFFFFFFFF) ^ k0) ^ k1)


@pytest.mark.parametrize(("seed", "tensor", "start"), sorted(WORD_VECTORS))
def test_words_match_the_committed_vectors_and_the_written_definition(seed, tensor, start):
    got = [int(w) & 0xFFFFFFFF for w in words_of_seeds([seed], tensor, start, 4)[0]]
    assert got == WORD_VECTORS[(seed, tensor, start)]
    assert got == [reference_word(seed, tensor, start + j) for j in range(4)]


def test_rademacher_and_gaussian_match_their_committed_vectors():
    (seed, tensor, start, scale), expected = RADEMACHER_VECTOR
    assert NoiseSource("rademacher").chunk(seed, tensor, start, 8, scale).tolist() == expected
    (seed, tensor, start), expected = GAUSSIAN_VECTOR
    assert gaussian(seed, tensor, start, 4).tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_rademacher_signs_are_the_bits_of_the_words_most_significant_first():
    source = NoiseSource("rademacher")
    signs = source.chunk(11, 4, 64 * 5, 96, 1.0)
    for e in range(96):
        word = reference_word(11, 4, (64 * 5 + e) // 32)
        assert signs[e] == (-1.0 if (word >> (31 - e % 32)) & 1 else 1.0)


def test_a_tensors_noise_does_not_depend_on_chunking_threads_or_the_other_tensors():
    n = CHUNK * 2 + 4321
    for kind in ("rademacher", "gaussian"):
        whole = [torch.zeros(n), torch.zeros(70)]
        add_directions_(whole, [(5, 1.0)], Perturbation(kind=kind))
        alone = [torch.zeros(0), torch.zeros(70)]  # tensor 1 of another model, whose tensor 0 is empty
        add_directions_(alone, [(5, 1.0)], Perturbation(kind=kind))
        assert torch.equal(whole[1], alone[1])
        source = NoiseSource(kind)
        pieces = [source.chunk(5, 0, s, min(640, n - s)).clone() for s in range(0, n, 640)]  # other chunk size
        assert torch.equal(torch.cat(pieces), whole[0])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            again = [torch.zeros(n)]
            add_directions_(again, [(5, 1.0)], Perturbation(kind=kind))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(again[0], whole[0])


def test_gaussian_noise_is_normal_and_within_a_few_ulp_of_a_float64_evaluation():
    z = gaussian(3, 1, 0, 200_000)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z > 1.96).double().mean()) - 0.025) < 0.002
    w = [reference_word(3, 1, GAUSSIAN_COUNTER + j) for j in range(2000)]
    u1 = np.array([(w[2 * m] >> 8) * 2.0**-24 for m in range(1000)])
    u2 = np.array([(w[2 * m + 1] >> 8) * 2.0**-24 for m in range(1000)])
    radius = np.sqrt(-2 * np.log1p(-u1))
    exact = np.stack([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)], axis=1).reshape(-1)
    assert np.max(np.abs(z[:2000].double().numpy() - exact) / np.maximum(1.0, np.abs(exact))) < 2e-6


def test_rademacher_words_are_balanced_and_unrelated_across_seeds_and_tensors():
    bits = lambda seed, tensor: NoiseSource("rademacher").chunk(seed, tensor, 0, 1 << 16).clone()  # noqa: E731
    a, b, c = bits(1, 0), bits(2, 0), bits(1, 1)
    assert abs(float(a.mean())) < 0.02
    assert abs(float((a * b).mean())) < 0.02 and abs(float((a * c).mean())) < 0.02
    assert abs(float((a[1:] * a[:-1]).mean())) < 0.02  # neighbours within a word are unrelated


def test_a_chunk_must_start_on_a_word_pair_boundary():
    with pytest.raises(ValueError, match="multiple of 64"):
        NoiseSource("rademacher").chunk(1, 0, 32, 10)


@pytest.mark.parametrize("size", [100, CHUNK // 2])  # rows in the source's reused buffer, or too many for it
def test_noise_rows_for_many_seeds_are_each_seeds_own_chunk_bit_for_bit(size):
    """A grid of many seeds (its keys a tensor) against one seed at a time (its keys Python ints)."""
    seeds = [3, 2**62 + 17, 0, 99]
    grid = words_of_seeds(seeds, 5, 7, 40)
    assert torch.equal(grid, torch.cat([words_of_seeds([s], 5, 7, 40) for s in seeds]))
    scales = [0.25, -3.0e-4, 1.0, -7.5]
    for kind in ("rademacher", "gaussian"):
        source = NoiseSource(kind)
        rows = source.rows(seeds, 2, 128, size, scales).clone()
        assert rows.shape == (4, size)
        for k, (seed, scale) in enumerate(zip(seeds, scales, strict=True)):
            assert torch.equal(rows[k], source.chunk(seed, 2, 128, size, scale))
        assert not torch.equal(rows[1] / scales[1], rows[3] / scales[3])  # different seeds, different noise


def test_pooled_seed_rows_add_what_seed_by_seed_directions_add_bit_for_bit():
    """The server's pooled rebuild: every seed's noise on every tensor it touches, one noise call per tensor."""
    sizes = [CHUNK + 300, 70, 576, 1]
    rng = np.random.default_rng(0)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=9)]
    coefficients = rng.normal(size=(9, len(sizes))) * (rng.random((9, len(sizes))) < 0.5)  # zeros: untouched
    precondition = [torch.from_numpy(rng.random(n).astype(np.float32) + 0.5) for n in sizes]
    masks = [torch.from_numpy(rng.random(n) < 0.7) for n in sizes]
    for kind in ("rademacher", "gaussian"):
        for extra in ({}, {"precondition": precondition, "masks": masks}):
            start = [torch.from_numpy(rng.normal(size=n).astype(np.float32)) for n in sizes]
            one_by_one = [t.clone() for t in start]
            for seed, row in zip(seeds, coefficients, strict=True):
                add_directions_(one_by_one, [(seed, 1.0)], Perturbation(kind=kind, scales=row.tolist(), **extra))
            pooled = [t.clone() for t in start]
            add_seed_rows_(pooled, seeds, coefficients, Perturbation(kind=kind, **extra))
            for a, b in zip(pooled, one_by_one, strict=True):
                assert torch.equal(a, b)
            assert not torch.equal(pooled[0], start[0])
    with pytest.raises(ValueError, match="without scales"):
        add_seed_rows_(start, seeds, coefficients, Perturbation(scales=[1.0] * len(sizes)))


def _rademacher_reference(seed: int, tensor: int, numel: int) -> torch.Tensor:
    """One tensor's Rademacher noise from a single unchunked words call (the words' bits, most significant first)."""
    w = words_of_seeds([seed], tensor, 0, (numel + 31) // 32)[0].to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(1) >> torch.arange(31, -1, -1)) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).reshape(-1)[:numel]


@pytest.mark.parametrize("cache", [False, True])
def test_noise_made_chunk_by_chunk_in_reused_scratch_equals_one_unchunked_evaluation(monkeypatch, cache):
    """Small chunks, so one tensor spans many: each chunk's words are hashed in the source's reused scratch (or
    kept, with the cache) and must be the same bits as one call over the whole tensor."""
    monkeypatch.setattr(noise, "CHUNK", 256)
    n = 256 * 9 + 100
    for kind, reference in (("rademacher", _rademacher_reference(21, 3, n)), ("gaussian", gaussian(21, 3, 0, n))):
        source = NoiseSource(kind, cache_words=cache)
        for _ in range(2):  # the second pass reads the cache, when there is one
            out = [torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(n)]
            add_directions_(out, [(21, 1.0)], Perturbation(kind=kind), source)
            assert torch.equal(out[3], reference)


def test_prefetched_noise_gives_each_seeds_own_chunks_bit_for_bit(monkeypatch):
    """A step's noise made for all its seeds at once, chunk by chunk, must be the noise each chunk would make."""
    monkeypatch.setattr(noise, "CHUNK", 256)
    n, seeds = 256 * 3 + 70, [5, 2**62 + 3, 11]
    cached = NoiseSource("rademacher")
    cached.prefetch(seeds, 2, n)
    monkeypatch.setattr(noise, "words_of_seeds", None)  # a chunk that hashed again would fail here
    for seed in seeds:
        for scale in (1.0, -2.5e-3):
            out = torch.zeros(n)
            add_directions_([torch.zeros(1), torch.zeros(1), out], [(seed, scale)], Perturbation(scales=[0, 0, 1]),
                            cached)
            assert torch.equal(out, scale * _rademacher_reference(seed, 2, n))
    cached.clear()
    with pytest.raises(TypeError):  # cleared: the next chunk hashes its words again
        cached.chunk(seeds[0], 2, 0, 256)
    with pytest.raises(ValueError, match="Rademacher"):
        NoiseSource("gaussian", cache_words=True).prefetch(seeds, 2, n)


def test_counters_wrap_like_uint32_across_the_signed_boundary():
    for start in (2**31 - 5, 2**32 - 3, 2**31, 0, 3 * 2**32 + 7):
        got = _counters_(torch.empty(10, dtype=torch.int32), start).to(torch.int64) & 0xFFFFFFFF
        assert got.tolist() == [(start + j) & 0xFFFFFFFF for j in range(10)]
    got = words_of_seeds([8, 9], 2, 2**31 - 3, 6)
    for row, seed in zip(got, (8, 9), strict=True):
        assert [int(x) & 0xFFFFFFFF for x in row] == [reference_word(seed, 2, 2**31 - 3 + j) for j in range(6)]


class _NewStorageBytes(TorchDispatchMode):
    """Adds up the bytes of every tensor an operation returns in new memory (views and in-place or out= results
    share an argument's memory and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shared = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.bytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared)
        return out


def test_a_rademacher_pass_allocates_no_tensor_per_chunk(monkeypatch):
    """The scratch is the source's own fixed buffers: a pass over a tensor of many chunks allocates nothing, so
    the memory a step needs does not grow with the largest tensor (nor fragments the heap chunk by chunk)."""
    monkeypatch.setattr(noise, "CHUNK", 1024)
    source = NoiseSource("rademacher")
    tensors = [torch.zeros(1024 * 40 + 77), torch.zeros(300)]
    with _NewStorageBytes() as counted:
        add_directions_(tensors, [(4, 1e-3), (9, -2e-3)], Perturbation(), source)
    assert counted.bytes == 0
    assert tensors[0].abs().min() > 0  # the pass did write noise


def test_a_rademacher_chunk_larger_than_the_scratch_is_refused():
    with pytest.raises(ValueError, match="at most"):
        NoiseSource("rademacher").chunk(1, 0, 0, CHUNK + 64)
