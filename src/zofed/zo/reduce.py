"""Sums of squares that give the same bits at any thread count, on any machine: the server's reductions.

torch's CPU reductions split a tensor of more than 32K values among the intra-op threads and add the partial sums
in a different order for each thread count (and each SIMD width), so a server step that divides by an RMS or a mean
square would move the model by other last bits on a machine with another core count, and `zofed replay` would find
that the log does not describe the model. Every reduction that decides the server's state goes through here
instead: the squares in float64 (exact: a float32 squared fits a float64's mantissa), summed by numpy's pairwise sum
(single-threaded, a fixed order in plain C) over fixed-size chunks, and the chunks' sums added in order. A party
that clips or normalizes the same numbers (a client under local DP, a client reading a downlink) calls the same
function and gets the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

CHUNK = 1 << 18  # values summed at once: bounds the float64 copy, not the result (the order is fixed either way)

Values = torch.Tensor | np.ndarray


def _flat(values: Values) -> np.ndarray | torch.Tensor:
    if isinstance(values, np.ndarray):
        return values.reshape(-1)
    return values.detach().reshape(-1).cpu()  # one copy off an accelerator, then chunks on the CPU


def _float64(chunk: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(chunk, np.ndarray):
        return chunk.astype(np.float64, copy=False)
    return chunk.to(torch.float64).numpy()


def sum_squares(values: Values) -> float:
    """The sum of the squared values, in float64, in a fixed order."""
    flat = _flat(values)
    total = 0.0
    for start in range(0, flat.shape[0], CHUNK):
        chunk = _float64(flat[start:start + CHUNK])
        total += float(np.square(chunk).sum())
    return total


def mean_square(values: Values) -> float:
    """The mean of the squared values (0 for none)."""
    count = int(np.prod(values.shape))
    return sum_squares(values) / count if count else 0.0


def rms(values: Values) -> float:
    """The root mean square of the values (0 for none)."""
    return math.sqrt(mean_square(values))


def l2_norm(values: Values) -> float:
    """The Euclidean norm of the values."""
    return math.sqrt(sum_squares(values))
