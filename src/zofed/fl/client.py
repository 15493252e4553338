"""The client's local training: ZO steps on its own data from the global weights, reported as an uplink.

The client perturbs from a clean copy of its trainable tensors (see `zo_step(clean=...)`), so the update it
applies locally is bit-identical to what the server rebuilds from its seeds and scalars. Under `zofed`'s
personalized sampling each step perturbs one block drawn from the client's distribution `pi` (personal.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from zofed.data.tasks import Encoded, Task
from zofed.fl.methods import personalized, seed_plan, uploads_dense
from zofed.fl.personal import MomentumTilt, step_perturbation, tensor_blocks
from zofed.fl.protocol import ClientUpdate
from zofed.models.selection import TrainableParams
from zofed.zo.optim import MeZO
from zofed.zo.perturb import Perturbation
from zofed.zo.step import zo_step


@dataclass(frozen=True)
class LocalTraining:
    """What the server asks of every client in a round."""

    method: str
    run_seed: int
    round_id: int
    local_steps: int
    lr: float
    eps: float
    queries: int = 1
    batch_size: int = 16
    noise: str = "rademacher"
    pool_size: int = 0  # fedkseed
    tilt: float = 0.0  # zofed: lean towards the server's first moment (sent with the downlink)
    blocks: int = 0  # zofed: how many blocks the trainable tensors are cut into (0: one per tensor)
    shared_seeds: int = 0  # zofed: 1 when the round's clients share their step seeds

    def to_config(self) -> dict[str, float | int | str]:
        """The plan as the downlink's config entries."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> LocalTraining:
        missing = [f.name for f in fields(cls) if f.name not in config]
        if missing:
            raise ValueError(f"round config lacks {', '.join(missing)}")
        casts = {"int": int, "float": float, "str": str}
        try:
            return cls(**{f.name: casts[f.type](config[f.name]) for f in fields(cls)})
        except (TypeError, ValueError) as err:
            raise ValueError(f"round config has a value of the wrong type: {err}") from None


@dataclass
class ClientContext:
    """Shared by all simulated clients of a process: one model replica and the encoded training data."""

    model: torch.nn.Module
    trainable: TrainableParams
    task: Task
    train: Encoded


def load_tensors_(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values, strict=True):
            t.copy_(v)


def run_client(ctx: ClientContext, global_tensors: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
               plan: LocalTraining, block_pi: np.ndarray | None = None,
               tilt: MomentumTilt | None = None) -> tuple[ClientUpdate, list[torch.Tensor]]:
    """Train locally from `global_tensors`; returns the uplink and the client's final trainable tensors.
    `block_pi` is the client's block distribution and `tilt` the server's momentum (personalized methods)."""
    if len(indices) == 0:
        raise ValueError(f"client {client_id} has no training examples")
    tensors = ctx.trainable.tensors()
    load_tensors_(tensors, global_tensors)
    clean = [t.clone() for t in global_tensors]
    seeds = seed_plan(plan.method, plan.run_seed, plan.round_id, client_id, plan.local_steps, plan.pool_size,
                      bool(plan.shared_seeds))
    optimizer = MeZO()
    state = optimizer.init(clean)
    if personalized(plan.method) and block_pi is None:
        raise ValueError(f"{plan.method} clients need their block distribution from the downlink")
    pert = Perturbation(kind=plan.noise, masks=ctx.trainable.masks)
    layout = tensor_blocks(tensors, plan.blocks) if personalized(plan.method) else None
    grads, losses = [], []
    for t, seed in enumerate(seeds.step_seeds):
        if personalized(plan.method):
            pert, _ = step_perturbation(seed, block_pi, plan.noise, ctx.trainable.masks, tilt, layout)
        rng = np.random.default_rng([plan.run_seed, plan.round_id, client_id, t])
        batch = ctx.task.collate(ctx.train, rng.choice(indices, size=min(plan.batch_size, len(indices)),
                                                       replace=False))
        state, record = zo_step(tensors, lambda b=batch: ctx.task.loss(ctx.model, b), optimizer, state, seed=seed,
                                eps=plan.eps, lr=plan.lr, queries=plan.queries, perturbation=pert, clean=clean)
        grads.append(record.grads)
        losses.append(record.loss)
    metrics = {"train_loss": float(np.mean(losses))}
    if uploads_dense(plan.method):
        dense = torch.cat([(c - g).reshape(-1) for c, g in zip(clean, global_tensors, strict=True)]).numpy()
        update = ClientUpdate(plan.round_id, client_id, np.zeros(0, np.uint64), None,
                              np.zeros((0, plan.queries), np.float32), np.zeros(0, np.float32), len(indices),
                              metrics, dense.astype(np.float32))
    else:
        update = ClientUpdate(
            plan.round_id, client_id,
            np.array(seeds.step_seeds, dtype=np.uint64) if seeds.explicit else np.zeros(0, np.uint64),
            None if seeds.explicit else seeds.base_seed, np.asarray(grads, dtype=np.float32),
            np.zeros(0, np.float32), len(indices), metrics)
    return update, clean
