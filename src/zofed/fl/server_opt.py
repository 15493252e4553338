"""Server optimizers: the round's aggregated client update is a pseudo-gradient, applied with global momentum.

Each optimizer is a chain of small pieces (optax's habit), each an `init`/`update` pair over explicit state. A
tensor's step is kept as `scale * num / den` (den optional) until the end, so the chain applies it in one fused
operation:

    moments       m <- beta1 m + (1 - beta1) d               (d: the aggregated update, a descent direction;
                                                              beta1 constant, or rising linearly over R rounds)
                  adam:    v <- beta2 v + (1 - beta2) d^2
                  yogi:    v <- v - (1 - beta2) d^2 sign(v - d^2)   (v grows no faster than d^2 asks)
                  amsgrad: v as adam, vhat <- max(vhat, v), and vhat divides
                  num, den = m, sqrt(v) + tau
    trust ratio   scale <- scale * max(rms(x), r0)            (a layer-wise trust ratio, as in LAMB; r0: the
                                                              smallest RMS a nonzero trainable tensor started
                                                              with; x the tensor now, or as the run started it)
    schedule      scale <- scale * lr_t                      (constant, or a cosine to zero over R rounds)
    then          x <- x + scale * num / den

`sgd` is the schedule alone (lr 1 is plain averaging of the updates); `adam`, `yogi` and `amsgrad` are moments,
optionally the trust ratio (`relative`), then the schedule.

Moments per `coordinate` keep v per coordinate (FedAdam, FedYogi, FedAMSGrad). Per `tensor` they keep one v per
trainable tensor, the mean of d^2 over it: the step keeps the direction inside a tensor and sets only its size,
since a ZO pseudo-gradient's noise is spread evenly over a tensor and per-coordinate division would turn it into
sign noise. `global` keeps one v for the whole update (the mean of d^2 over every trainable value, kept in each
tensor's slot), so tensors keep their relative step sizes and only the update's length is set: a noisy tensor is not
blown up to a full step. Under a selection mask (trainable.magnitude_fraction, zo.precondition: channels) these means
run over the values that can move (`movable`, from the server), so a mask that pins most values does not make the
rest step further at the same lr. A tensor-wise v can warm-start from its first round's expected energy
(`warm_start`; the method supplies `expected_square`).

The relative step makes lr a relative step size, so a small-valued tensor (a freshly drawn classifier head, std
0.02) is not moved as far as a unit-scale gain. A tensor that starts at zero (LoRA's B) has no scale of its own (its
own RMS would give it a full absolute step, then steps too small to get it anywhere), so it is measured against a
floor fixed when the run starts, the smallest RMS among the nonzero trainable tensors (LoRA's A), until it outgrows
it; a set without zero tensors steps as without the floor (unless a tensor shrinks below it), and only when every
tensor is zero does lr become absolute. The cosine
schedule shrinks a normalized step that would otherwise keep its length when the update is mostly noise.

Every mean square and RMS of the chain is taken by zo/reduce.py, in a fixed order: the step is the same bits at any
thread count, so `zofed replay` on a machine with another number of cores rebuilds the run's model exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from zofed.fl.personal import block_sizes
from zofed.zo.optim import OptState
from zofed.zo.reduce import mean_square, rms, sum_squares

GRANULARITIES = ("coordinate", "tensor", "global")
RELATIVE_ANCHORS = ("current", "start")  # the RMS a relative step is measured against
Buffers = dict[str, list[torch.Tensor]]


@dataclass
class TensorStep:
    """One tensor's step on its way through the chain: scale * num / den (den None: scale * num)."""

    num: torch.Tensor
    den: torch.Tensor | None = None
    scale: float = 1.0


class Piece(Protocol):
    """One link of a server optimizer's chain."""

    extras: frozenset[str]  # per-round inputs it reads (e.g. "expected_square")

    def init(self, tensors: Sequence[torch.Tensor]) -> Buffers: ...

    def update(self, steps: list[TensorStep], buffers: Buffers, tensors: Sequence[torch.Tensor], step: int,
               extras: dict[str, Any]) -> list[TensorStep]: ...


@dataclass(frozen=True)
class Moments:
    """First and second moments of the update; emits m / (sqrt(v) + tau)."""

    rule: str = "adam"  # adam, yogi or amsgrad
    granularity: str = "coordinate"
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-6
    warm_start: bool = False
    beta1_start: float | None = None  # set: beta1 rises linearly from it in the first round to beta1 after
    ramp_rounds: int = 0  # ... this many rounds

    @property
    def extras(self) -> frozenset[str]:
        return frozenset({"expected_square"}) if self.warm_start else frozenset()

    def beta1_at(self, step: int) -> float:
        """The momentum of the round that follows `step` applied rounds. Without Adam's bias correction a
        small beta1 takes larger steps along a persistent direction while v is still young, and forgets sooner;
        a ramp takes those early steps and keeps the smoothing of a large beta1 for the end."""
        if self.beta1_start is None or self.ramp_rounds <= 1:
            return self.beta1
        return self.beta1_start + (self.beta1 - self.beta1_start) * min(step, self.ramp_rounds - 1) / (
            self.ramp_rounds - 1)

    def init(self, tensors: Sequence[torch.Tensor]) -> Buffers:
        second = [torch.zeros_like(t) if self.granularity == "coordinate" else t.new_zeros(1) for t in tensors]
        buffers = {"m": [torch.zeros_like(t) for t in tensors], "v": second}
        if self.rule == "amsgrad":
            buffers["vhat"] = [v.clone() for v in second]
        return buffers

    def update(self, steps, buffers, tensors, step, extras):
        expected = extras.get("expected_square") if self.warm_start else None
        movable = extras.get("movable")  # per tensor, the values a selection mask lets move (None: all)
        if self.granularity == "global":  # one mean square over every movable value, the same in each tensor's slot
            total = sum(s.num.numel() for s in steps) if movable is None else sum(movable)
            shared = sum(sum_squares(s.num) for s in steps) / max(total, 1)
        beta1 = self.beta1_at(step)
        out = []
        for i, s in enumerate(steps):
            d = s.num
            m, v = buffers["m"][i], buffers["v"][i]
            if expected is not None and not v.any():  # one round's worth of the expected energy, not a sign step
                v.fill_((1 - self.beta2) * float(expected[i]))
                if self.rule == "amsgrad":
                    buffers["vhat"][i].copy_(v)
            m.mul_(beta1).add_(d, alpha=1 - beta1)
            if self.granularity == "coordinate":
                d2 = d * d
            elif self.granularity == "tensor":
                moving = d.numel() if movable is None else movable[i]
                d2 = v.new_full((1,), mean_square(d) if moving == d.numel() else sum_squares(d) / max(moving, 1))
            else:
                d2 = v.new_full((1,), shared)
            if self.rule == "yogi":
                v.sub_(d2 * torch.sign(v - d2), alpha=1 - self.beta2)
            else:
                v.mul_(self.beta2).add_(d2, alpha=1 - self.beta2)
            denom = torch.maximum(buffers["vhat"][i], v, out=buffers["vhat"][i]) if self.rule == "amsgrad" else v
            out.append(TensorStep(m, denom.sqrt().add(self.tau), s.scale))
        return out


def movable_values(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None] | None) -> list[int] | None:
    """Per tensor, how many values a mask lets move (its nonzero entries, as zofed's block sizes count them: the noise
    scales of zo.precondition: features pin none, a selection combined with them pins its zeros); None when no value
    is pinned."""
    if masks is None:
        return None
    counts = [int(n) for n in block_sizes(tensors, masks)]
    return None if counts == [t.numel() for t in tensors] else counts


def _rms(tensors: Sequence[torch.Tensor]) -> list[float]:
    return [rms(t) for t in tensors]


@dataclass(frozen=True)
class TrustRatio:
    """Scales each tensor's step by the tensor's root mean square, its RMS now (`current`, LAMB's ratio) or the
    RMS it started the run with (`start`), floored at the smallest RMS a nonzero trainable tensor started the run
    with (1 when every tensor started at zero; the starting RMS are kept in the state). The floor is fixed at the
    start: a zero-started tensor (LoRA's B) steps at its A's scale until it outgrows it. A floor read from the
    tensors now would sink to the first B's tiny RMS once one moved, and every B would then creep from there by a
    factor of (1 + lr) a round (docs/method.md, relative steps)."""

    anchor: str = "current"  # current or start
    extras: frozenset[str] = frozenset()

    def init(self, tensors: Sequence[torch.Tensor]) -> Buffers:
        return {"start_rms": [t.new_full((1,), r, dtype=torch.float64) for t, r in zip(tensors, _rms(tensors),
                                                                                          strict=True)]}

    def update(self, steps, buffers, tensors, step, extras):
        if "start_rms" not in buffers:
            raise ValueError("this server state was saved before relative steps kept each tensor's starting RMS: "
                             "resume it with the zofed version that wrote it, or start the run again")
        start = [float(r) for r in buffers["start_rms"]]
        floor = min((r for r in start if r > 0), default=1.0)
        rms = _rms(tensors) if self.anchor == "current" else start
        for s, r in zip(steps, rms, strict=True):
            s.scale *= max(r, floor)
        return steps


@dataclass(frozen=True)
class Schedule:
    """Multiplies the step by lr, constant or along a cosine from lr in the first round to zero after
    `decay_rounds` rounds (0 keeps it constant)."""

    lr: float
    decay_rounds: int = 0
    extras: frozenset[str] = frozenset()

    def lr_at(self, step: int) -> float:
        """The lr of the round that follows `step` applied rounds."""
        if not self.decay_rounds:
            return self.lr
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(step, self.decay_rounds) / self.decay_rounds))

    def init(self, tensors: Sequence[torch.Tensor]) -> Buffers:
        return {}

    def update(self, steps, buffers, tensors, step, extras):
        lr = self.lr_at(step)
        for s in steps:
            s.scale *= lr
        return steps


@dataclass(frozen=True)
class ServerOptimizer:
    """A chain of pieces; its state is one OptState (round counter and every piece's named buffers)."""

    name: str
    pieces: tuple[Piece, ...]

    @property
    def extras(self) -> frozenset[str]:
        return frozenset().union(*(p.extras for p in self.pieces))

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        buffers: Buffers = {}
        for piece in self.pieces:
            buffers.update(piece.init(tensors))
        return OptState(buffers=buffers)

    @torch.no_grad()
    def apply(self, tensors: Sequence[torch.Tensor], state: OptState, delta: Sequence[torch.Tensor],
              **extras: Any) -> OptState:
        """Move `tensors` in place by the pseudo-gradient `delta`; returns the next state."""
        steps = [TensorStep(d) for d in delta]
        for piece in self.pieces:
            steps = piece.update(steps, state.buffers, tensors, state.step, extras)
        for t, s in zip(tensors, steps, strict=True):
            if s.den is None:
                t.add_(s.num, alpha=s.scale)
            else:
                t.addcdiv_(s.num, s.den, value=s.scale)
        return replace(state, step=state.step + 1)

    def lr_at(self, step: int) -> float:
        return next(p.lr_at(step) for p in self.pieces if isinstance(p, Schedule))


def _sgd(lr: float, decay_rounds: int = 0, **_: Any) -> tuple[Piece, ...]:
    return (Schedule(lr, decay_rounds),)


def _adaptive(rule: str) -> Callable[..., tuple[Piece, ...]]:
    def build(lr: float, decay_rounds: int = 0, granularity: str = "coordinate", beta1: float = 0.9,
              beta2: float = 0.99, tau: float = 1e-6, warm_start: bool = False, relative: bool = False,
              relative_to: str = "current", beta1_start: float | None = None,
              ramp_rounds: int = 0) -> tuple[Piece, ...]:
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown server optimizer granularity {granularity!r}; choose {', '.join(GRANULARITIES)}")
        if warm_start and granularity != "tensor":  # the expected energy is known per tensor
            raise ValueError("a warm start needs tensor-wise moments (granularity tensor)")
        if beta1_start is not None and not 0 <= beta1_start < 1:
            raise ValueError(f"beta1_start must lie in [0, 1), not {beta1_start}")
        if beta1_start is not None and ramp_rounds < 1:
            raise ValueError(f"a beta1 ramp needs a number of rounds to rise over, not {ramp_rounds}")
        moments = Moments(rule, granularity, beta1, beta2, tau, warm_start, beta1_start, ramp_rounds)
        return (moments, *((TrustRatio(relative_to),) if relative else ()), Schedule(lr, decay_rounds))

    return build


@dataclass(frozen=True)
class Kind:
    """A registered server optimizer: how to build its chain, and the lr it takes when none is given."""

    build: Callable[..., tuple[Piece, ...]]
    default_lr: float
    adaptive: bool  # has moments (relative steps, warm starts and granularity apply)


# Adaptive server steps move each coordinate by about lr a round: 3e-3 is about as far as centralized MeZO at
# lr 3e-4 moves a coordinate with the same forward passes.
# A method's own default (zofed: relative 1e-2 of a tensor's RMS) is in its `server_default`.
SERVER_OPTIMIZERS: dict[str, Kind] = {
    "sgd": Kind(_sgd, 1.0, adaptive=False),
    "adam": Kind(_adaptive("adam"), 3e-3, adaptive=True),
    "yogi": Kind(_adaptive("yogi"), 3e-3, adaptive=True),
    "amsgrad": Kind(_adaptive("amsgrad"), 3e-3, adaptive=True),
}


def make_server_optimizer(name: str = "sgd", lr: float | None = None, *, decay_rounds: int = 0,
                          relative: bool = False, relative_to: str = "current", warm_start: bool = False,
                          **moments: Any) -> ServerOptimizer:
    """Build a registered server optimizer by name (lr None: its default); settings that do not go together
    raise a ValueError saying why."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"unknown server optimizer {name!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}")
    if relative_to not in RELATIVE_ANCHORS:
        raise ValueError(f"relative_to must be one of {', '.join(RELATIVE_ANCHORS)}, not {relative_to!r}")
    if relative_to != "current" and not relative:
        raise ValueError(f"relative_to {relative_to} sets the scale of relative steps: it needs relative steps")
    kind = SERVER_OPTIMIZERS[name]
    if decay_rounds < 0:
        raise ValueError(f"decay_rounds must be 0 (constant lr) or a number of rounds, not {decay_rounds}")
    lr = kind.default_lr if lr is None else lr
    if not kind.adaptive:
        if relative:
            raise ValueError(f"relative steps need an adaptive server optimizer (adam, yogi or amsgrad), not {name}")
        if warm_start:
            raise ValueError("a warm start needs a tensor-wise adaptive server optimizer (adam, yogi or amsgrad)")
        if moments.get("beta1_start") is not None:
            raise ValueError(f"a beta1 ramp needs an adaptive server optimizer (adam, yogi or amsgrad), not {name}")
        return ServerOptimizer(name, kind.build(lr, decay_rounds))
    return ServerOptimizer(name, kind.build(lr, decay_rounds, relative=relative, relative_to=relative_to,
                                            warm_start=warm_start, **moments))
