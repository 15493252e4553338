"""First-order baselines (FedAvg, FedAdam): clients back-propagate and upload their dense update.

They are the accuracy ceiling and the cost a user pays today: back-propagation memory on every client, and
an uplink as large as the trainable tensors. The server side is shared with the ZO methods: the mean of the
dense updates is the pseudo-gradient of the server optimizer (sgd with lr 1 is FedAvg, adam is FedAdam).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zofed.fl.client import ClientContext, LocalTraining, load_tensors_
from zofed.fl.protocol import ClientUpdate

FIRST_ORDER_METHODS = ("fedavg", "fedadam")
SERVER_OPTIMIZER_OF = {"fedavg": "sgd", "fedadam": "adam"}


def run_first_order_client(ctx: ClientContext, global_tensors: Sequence[torch.Tensor], client_id: int,
                           indices: np.ndarray, plan: LocalTraining, local_optimizer: str = "adamw"
                           ) -> tuple[ClientUpdate, list[torch.Tensor]]:
    """`plan.local_steps` back-propagation steps from the global weights; uploads the dense update."""
    if len(indices) == 0:
        raise ValueError(f"client {client_id} has no training examples")
    params = ctx.trainable.params
    load_tensors_(ctx.trainable.tensors(), global_tensors)
    if local_optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    elif local_optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=plan.lr)
    else:
        raise ValueError(f"unknown first-order local optimizer {local_optimizer!r}; choose adamw or sgd")
    losses = []
    for p in params:
        p.requires_grad_(True)
    try:
        for t in range(plan.local_steps):
            rng = np.random.default_rng([plan.run_seed, plan.round_id, client_id, t])
            batch = ctx.task.collate(ctx.train, rng.choice(indices, size=min(plan.batch_size, len(indices)),
                                                           replace=False))
            optimizer.zero_grad(set_to_none=True)
            loss = ctx.task.loss_tensor(ctx.model, batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:  # the shared replica goes back to forward-only for the ZO clients and evaluation
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    final = [t.detach().clone() for t in ctx.trainable.tensors()]
    dense = torch.cat([(f - g).reshape(-1) for f, g in zip(final, global_tensors, strict=True)]).numpy()
    update = ClientUpdate(plan.round_id, client_id, np.zeros(0, np.uint64), None,
                          np.zeros((0, plan.queries), np.float32), np.zeros(0, np.float32), len(indices),
                          {"train_loss": float(np.mean(losses))}, dense.astype(np.float32))
    return update, final
