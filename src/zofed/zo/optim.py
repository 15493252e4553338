"""Local zeroth-order optimizers with explicit, serializable state (an `init`/`apply` pair each).

Each optimizer sees the step's directions only as (seed, coefficient) terms. `apply` restores the last
query's perturbation and applies the update in one streaming pass, so a step never materializes a dense
gradient. Given the same starting tensors, state and terms, `apply` is deterministic: the server can
replay a client's steps with it and obtain the same update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from zofed.zo.noise import NoiseSource
from zofed.zo.perturb import Perturbation, add_directions_, sweep_estimate

OPTIMIZER_NAMES = ("mezo", "zo-sgd-momentum", "zo-adam", "zo-adamu", "sparse-mezo")
# The settings each optimizer takes, by name: what a config section or a round plan hands to make_optimizer.
HYPERPARAMETERS = {"mezo": (), "zo-sgd-momentum": ("momentum",), "zo-adam": ("beta1", "beta2"),
                   "zo-adamu": ("beta1", "beta2", "momentum_weight", "anneal_steps"),
                   "sparse-mezo": ("density", "mask_interval")}


def hyperparameters(name: str, settings: object) -> dict[str, float]:
    """Only the hyperparameters optimizer `name` takes, read from the attributes of `settings`."""
    return {key: getattr(settings, key) for key in HYPERPARAMETERS[name]}


@dataclass
class OptState:
    """Step count plus named lists of per-tensor buffers (flat, one per trainable tensor)."""

    step: int = 0
    buffers: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        flat = {f"{name}.{i}": t.contiguous() for name, ts in self.buffers.items() for i, t in enumerate(ts)}
        flat["step"] = torch.tensor([self.step], dtype=torch.int64)
        return flat

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> OptState:
        buffers: dict[str, dict[int, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key == "step":
                continue
            name, index = key.rsplit(".", 1)
            buffers.setdefault(name, {})[int(index)] = value.clone()
        ordered = {name: [parts[i] for i in range(len(parts))] for name, parts in buffers.items()}
        return cls(step=int(tensors["step"][0]), buffers=ordered)

    def clone(self) -> OptState:
        return OptState(self.step, {k: [t.clone() for t in v] for k, v in self.buffers.items()})


def _zeros_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(t) for t in tensors]


@dataclass(frozen=True)
class MeZO:
    """ZO-SGD: theta <- theta - lr * g * u. Stateless, so restore and update fuse into one term."""

    name: str = "mezo"

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        return OptState()

    def perturbation(self, tensors: Sequence[torch.Tensor], state: OptState, base: Perturbation) -> Perturbation:
        return base

    def apply(self, tensors: Sequence[torch.Tensor], state: OptState, grad_terms: Sequence[tuple[int, float]],
              restore: Sequence[tuple[int, float]], lr: float, perturbation: Perturbation,
              source: NoiseSource | None = None) -> OptState:
        terms = [*restore, *[(seed, -lr * g) for seed, g in grad_terms]]
        add_directions_(tensors, terms, perturbation, source)
        return replace(state, step=state.step + 1)


@dataclass(frozen=True)
class ZOSGDMomentum:
    """Heavy-ball momentum on the ZO estimate: m <- beta m + g u; theta <- theta - lr m."""

    momentum: float = 0.9
    name: str = "zo-sgd-momentum"

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        return OptState(buffers={"m": _zeros_like(tensors)})

    def perturbation(self, tensors: Sequence[torch.Tensor], state: OptState, base: Perturbation) -> Perturbation:
        return base

    def apply(self, tensors, state, grad_terms, restore, lr, perturbation, source=None):
        m = state.buffers["m"]

        def update(i: int, start: int, end: int, param: torch.Tensor, grad: torch.Tensor) -> None:
            buf = m[i][start:end]
            buf.mul_(self.momentum).add_(grad)
            param.add_(buf, alpha=-lr)

        sweep_estimate(tensors, restore, grad_terms, perturbation, update, source)
        return replace(state, step=state.step + 1)


@dataclass(frozen=True)
class ZOAdam:
    """Adam moments on the ZO estimate (ZO-AdaMM): per-coordinate step sizes for ZO updates."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name: str = "zo-adam"

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        return OptState(buffers={"m": _zeros_like(tensors), "v": _zeros_like(tensors)})

    def perturbation(self, tensors: Sequence[torch.Tensor], state: OptState, base: Perturbation) -> Perturbation:
        return base

    def apply(self, tensors, state, grad_terms, restore, lr, perturbation, source=None):
        m, v = state.buffers["m"], state.buffers["v"]
        t = state.step + 1
        step_size = lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)

        def update(i: int, start: int, end: int, param: torch.Tensor, grad: torch.Tensor) -> None:
            m_c, v_c = m[i][start:end], v[i][start:end]
            m_c.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
            v_c.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            param.addcdiv_(m_c, v_c.sqrt().add_(self.eps), value=-step_size)

        sweep_estimate(tensors, restore, grad_terms, perturbation, update, source)
        return replace(state, step=t)


@dataclass(frozen=True)
class ZOAdaMU(ZOAdam):
    """ZO-AdaMU-style: Adam moments, and perturbations tilted towards the first moment with a weight
    annealed linearly from `momentum_weight` to 0 over `anneal_steps` (explores along the momentum early,
    falls back to plain noise later)."""

    momentum_weight: float = 0.5
    anneal_steps: int = 1000
    name: str = "zo-adamu"

    def perturbation(self, tensors: Sequence[torch.Tensor], state: OptState, base: Perturbation) -> Perturbation:
        weight = self.momentum_weight * max(0.0, 1.0 - state.step / max(1, self.anneal_steps))
        m = state.buffers["m"]
        rms = [float(t.norm()) / math.sqrt(max(1, t.numel())) for t in m]
        return replace(base, momentum=m, momentum_weight=weight, momentum_rms=rms)


def magnitude_masks(tensors: Sequence[torch.Tensor], fraction: float, keep: str = "smallest") -> list[torch.Tensor]:
    """Per tensor, a bool mask of the `fraction` of coordinates with the smallest (or largest) |value|.
    The threshold comes from an evenly strided sample so it is cheap and needs no random state."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"mask fraction must be in (0, 1], got {fraction}")
    masks = []
    for t in tensors:
        mags = t.detach().abs().reshape(-1)
        sample = mags[:: max(1, mags.numel() // (1 << 20))]
        q = fraction if keep == "smallest" else 1.0 - fraction
        k = min(sample.numel(), max(1, round(q * sample.numel())))
        threshold = sample.kthvalue(k).values
        masks.append(mags <= threshold if keep == "smallest" else mags > threshold)
    return masks


@dataclass(frozen=True)
class SparseMeZO(MeZO):
    """Sparse MeZO: perturb only the `density` fraction of smallest-magnitude coordinates of each tensor,
    with the masks recomputed from the current weights every `mask_interval` steps."""

    density: float = 0.25
    mask_interval: int = 50
    name: str = "sparse-mezo"

    def init(self, tensors: Sequence[torch.Tensor]) -> OptState:
        return OptState(buffers={"mask": magnitude_masks(tensors, self.density)})

    def perturbation(self, tensors: Sequence[torch.Tensor], state: OptState, base: Perturbation) -> Perturbation:
        if state.step > 0 and state.step % self.mask_interval == 0:
            state.buffers["mask"] = magnitude_masks(tensors, self.density)
        masks = state.buffers["mask"]
        if base.masks is not None:  # combine with a static selection mask
            masks = [m if b is None else b * m for m, b in zip(masks, base.masks, strict=True)]
        return replace(base, masks=masks)


def make_optimizer(name: str, **hyper: float) -> MeZO | ZOSGDMomentum | ZOAdam | ZOAdaMU | SparseMeZO:
    """Build a local optimizer by name; unknown names or hyperparameters raise a clear ValueError."""
    table = {"mezo": MeZO, "zo-sgd-momentum": ZOSGDMomentum, "zo-adam": ZOAdam, "zo-adamu": ZOAdaMU,
             "sparse-mezo": SparseMeZO}
    if name not in table:
        raise ValueError(f"unknown ZO optimizer {name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
    try:
        return table[name](**hyper)
    except TypeError as err:
        raise ValueError(f"bad hyperparameters for {name}: {err}") from None


def learning_rate(step: int, base: float, schedule: str = "constant", total: int = 1, warmup: int = 0) -> float:
    """Learning rate at `step` (0-based): linear warm-up, then constant, linear or cosine decay."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "constant":
        return base
    if schedule == "linear":
        return base * (1.0 - progress)
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose constant, linear or cosine")
