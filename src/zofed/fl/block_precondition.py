"""zofed's optional preconditioned noise (`federation.sampling.precondition`): each block's noise shaped per
coordinate by the federation's running second moment of the update (HiSo's idea, kept block by block).

The server keeps K, one value per trainable coordinate, starting at 0. After each round it folds in the round's
mean update per local step, g = -delta / (lr * local_steps), at the coordinates that moved (a block no client drew
has no new estimate, and its zero update must not read as a quiet coordinate):

    K_i <- beta K_i + (1 - beta) g_i^2

and sends p with the downlink, p_i = (K_i + mean_b K)^-1/2 normalized to unit RMS within each block b (p = 1 in a
block not yet moved). Shrinking every coordinate's K towards its block's mean keeps one noisy small g_i^2 from
blowing its p up, while a coordinate whose updates run far above the block's (an outlier channel of a norm gain) is
probed about sqrt(K_i / mean) times less than the rest. The normalization keeps the block's noise its size, so its
scale 1/sqrt(pi_b) keeps its meaning; a step's expected update becomes p_b^2 * grad_b, and the probes pi_b g^2
estimate the energy of the preconditioned gradient p_b * grad_b, which the step's variance follows. Every client of
a round is sent the same p, so the server still pools the round's steps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zofed.zo.reduce import rms

BETA = 0.9  # memory of the second moment, in rounds (HiSo's)


@dataclass
class BlockPreconditioner:
    """The server's K, one flat tensor per trainable tensor, and the p sent in the current round."""

    k: list[torch.Tensor]
    layout: np.ndarray  # each tensor's block
    round_id: int = -1
    sent: np.ndarray | None = None

    @classmethod
    def start(cls, tensors: Sequence[torch.Tensor], layout: np.ndarray) -> BlockPreconditioner:
        return cls([torch.zeros(t.numel(), dtype=torch.float64, device=t.device) for t in tensors], layout)

    def for_round(self, round_id: int) -> np.ndarray:
        """p for this round, flat float32 over every trainable value (what the downlink carries): one array a round,
        so the clients' perturbations share it."""
        if self.sent is None or self.round_id != round_id:
            self.round_id, self.sent = round_id, self._precondition()
        return self.sent

    def _precondition(self) -> np.ndarray:
        p: list[torch.Tensor] = [torch.empty(0)] * len(self.k)
        for block in range(int(self.layout.max()) + 1):
            members = np.flatnonzero(self.layout == block).tolist()
            k = torch.cat([self.k[i] for i in members])
            mean = float(np.sum(k.cpu().numpy())) / k.numel()  # numpy's pairwise sum: the same bits at any thread count
            inv = (k + mean).rsqrt() if mean > 0 else torch.ones_like(k)
            inv = inv / rms(inv)
            for i, part in zip(members, torch.split(inv, [self.k[i].numel() for i in members]), strict=True):
                p[i] = part
        return torch.cat(p).float().cpu().numpy()

    def observe(self, delta: Sequence[torch.Tensor], lr: float, local_steps: int) -> None:
        """Folds the round's mean update into K at the coordinates that moved."""
        for k, d in zip(self.k, delta, strict=True):
            g_hat = d.reshape(-1).double() / (-lr * local_steps)
            moved = g_hat != 0
            k[moved] = BETA * k[moved] + (1 - BETA) * g_hat[moved].square()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f"precondition.{i}": t.contiguous() for i, t in enumerate(self.k)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.k = [tensors[f"precondition.{i}"].clone() for i in range(len(self.k))]
        self.sent = None


def split_precondition(flat: np.ndarray, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A received p as one flat tensor per trainable tensor, checked. Equal p's give the very same tensors: every
    client of a round is sent the same p, and the server pools their terms where their noise is the same memory
    (`Perturbation.noise_key`)."""
    numel = sum(t.numel() for t in like)
    if flat.shape != (numel,):
        raise ValueError(f"a preconditioned zofed downlink carries one value per trainable value ({numel}), "
                         f"got {flat.size}")
    if not np.isfinite(flat).all() or (flat < 0).any():
        raise ValueError("the preconditioner in a zofed downlink must be finite and non-negative")
    return list(_shared_shape(np.ascontiguousarray(flat, dtype=np.float32).tobytes(),
                              tuple(t.numel() for t in like), str(like[0].device)))


@functools.lru_cache(maxsize=2)
def _shared_shape(raw: bytes, sizes: tuple[int, ...], device: str) -> tuple[torch.Tensor, ...]:
    values = torch.frombuffer(bytearray(raw), dtype=torch.float32).to(device)
    return torch.split(values, list(sizes))
