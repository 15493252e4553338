"""Server optimizers: the round's mean client update is a pseudo-gradient, applied with global momentum.

    m <- beta1 m + (1 - beta1) d                       (d: the mean update, a descent direction)
    adam:    v <- beta2 v + (1 - beta2) d^2
    yogi:    v <- v - (1 - beta2) d^2 sign(v - d^2)     (v grows no faster than d^2 asks)
    amsgrad: v <- beta2 v + (1 - beta2) d^2, vhat <- max(vhat, v), and vhat divides
    x <- x + lr m / (sqrt(v) + tau)

`granularity="coordinate"` keeps v per coordinate (FedAdam, FedYogi, FedAMSGrad). `"block"` keeps one v per
trainable tensor, the mean of d^2 over it: the step keeps the direction inside a block and only sets each
block's step size, which suits ZO pseudo-gradients (noise spread evenly over a block, which per-coordinate
division would turn into sign noise), and the state to send to clients is one number per block.
`sgd` is x <- x + lr d (lr 1 is plain averaging of the updates).

`decay_rounds=R` lowers lr along a cosine, from lr in the first round to zero after R rounds. A normalized step
keeps its length when the rebuilt update is mostly noise, as it is once the easy progress is made; the decay
shrinks it instead (0 keeps lr constant).

`relative=True` multiplies each tensor's step by its own root mean square before the step (a layer-wise trust
ratio, as in LAMB): lr becomes a relative step, so a small-valued tensor (a freshly drawn classifier head,
std 0.02) is not moved as far as a unit-scale gain. A tensor that is all zeros moves by lr, as if absolute.

Downlink modes: every optimizer can send new weights; only `sgd` can send an update log (seeds and
coefficients a client replays), because only its step is a linear combination of the clients' directions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from zofed.zo.optim import OptState

SERVER_OPTIMIZERS = ("sgd", "adam", "yogi", "amsgrad")
GRANULARITIES = ("coordinate", "block")


@dataclass(frozen=True)
class ServerOptimizer:
    name: str = "sgd"
    lr: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-6
    granularity: str = "coordinate"
    warm_start: bool = False  # block v starts from the energy a block's first round is expected to carry
    relative: bool = False  # each tensor's step is scaled by its own RMS (adam, yogi, amsgrad)
    decay_rounds: int = 0  # cosine decay of lr to zero over this many rounds; 0 keeps lr constant

    def __post_init__(self) -> None:
        if self.name not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.name!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown server optimizer granularity {self.granularity!r}; choose coordinate or block")
        if self.warm_start and (self.name == "sgd" or self.granularity != "block"):
            raise ValueError("a warm start needs a block-wise adaptive server optimizer (adam, yogi or amsgrad)")
        if self.relative and self.name == "sgd":
            raise ValueError("relative steps need an adaptive server optimizer (adam, yogi or amsgrad), not sgd")
        if self.decay_rounds < 0:
            raise ValueError(f"decay_rounds must be 0 (constant lr) or a number of rounds, not {self.decay_rounds}")

    def lr_at(self, step: int) -> float:
        """The lr of the round that follows `step` applied rounds."""
        if not self.decay_rounds:
            return self.lr
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(step, self.decay_rounds) / self.decay_rounds))

    @property
    def downlink_modes(self) -> tuple[str, ...]:
        return ("weights", "log") if self.name == "sgd" else ("weights",)

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        if self.name == "sgd":
            return OptState()
        second = [torch.zeros_like(t) if self.granularity == "coordinate" else torch.zeros(1, dtype=t.dtype)
                  for t in tensors]
        buffers = {"m": [torch.zeros_like(t) for t in tensors], "v": second}
        if self.name == "amsgrad":
            buffers["vhat"] = [v.clone() for v in second]
        return OptState(buffers=buffers)

    @torch.no_grad()
    def apply(self, tensors: Sequence[torch.Tensor], state: OptState, delta: Sequence[torch.Tensor],
              expected_square: Sequence[float] | None = None) -> OptState:
        """Move `tensors` in place by the pseudo-gradient `delta`; returns the next state.

        With `warm_start`, `expected_square` is each block's expected mean of d^2 this round: a block whose v
        is still zero starts from one round's worth of it, (1 - beta2) E[d^2], so its first step is in
        proportion to what its probes measured instead of a full-size sign step."""
        lr = self.lr_at(state.step)
        if self.name == "sgd":
            for t, d in zip(tensors, delta, strict=True):
                t.add_(d, alpha=lr)
            return replace(state, step=state.step + 1)
        b = state.buffers
        for i, (t, d) in enumerate(zip(tensors, delta, strict=True)):
            m, v = b["m"][i], b["v"][i]
            if self.warm_start and expected_square is not None and not v.any():
                v.fill_((1 - self.beta2) * float(expected_square[i]))
                if self.name == "amsgrad":
                    b["vhat"][i].copy_(v)
            m.mul_(self.beta1).add_(d, alpha=1 - self.beta1)
            d2 = d * d if self.granularity == "coordinate" else (d * d).mean().reshape(1)
            if self.name == "yogi":
                v.sub_(d2 * torch.sign(v - d2), alpha=1 - self.beta2)
            else:
                v.mul_(self.beta2).add_(d2, alpha=1 - self.beta2)
            denom = v
            if self.name == "amsgrad":
                denom = torch.maximum(b["vhat"][i], v, out=b["vhat"][i])
            t.addcdiv_(m, denom.sqrt().add(self.tau), value=lr * self._trust(t))
        return replace(state, step=state.step + 1)

    def _trust(self, tensor: torch.Tensor) -> float:
        """The factor on this tensor's step: its RMS when steps are relative (1 for an all-zero tensor)."""
        if not self.relative:
            return 1.0
        rms = float(tensor.double().pow(2).mean().sqrt())
        return rms if rms > 0 else 1.0

    def block_state(self, state: OptState) -> np.ndarray:
        """The per-block second moments (block granularity): small enough to send to every client."""
        if self.name == "sgd" or self.granularity != "block":
            return np.zeros(0, np.float32)
        key = "vhat" if self.name == "amsgrad" else "v"
        return torch.cat(state.buffers[key]).numpy().astype(np.float32)
