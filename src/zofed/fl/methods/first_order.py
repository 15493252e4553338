"""FedAvg and FedAdam: clients back-propagate and upload their dense update.

They are the accuracy ceiling and the cost a user pays today: back-propagation memory on every client, and an
uplink as large as the trainable tensors. The server side is shared with the ZO methods: the mean of the dense
updates is the pseudo-gradient of the server optimizer (sgd with lr 1 is FedAvg, adam is FedAdam).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zofed.fl.client import ClientContext, client_shift, dense_update, load_tensors_, local_batch
from zofed.fl.methods.base import Method, ServerDefault
from zofed.fl.plan import LocalTraining
from zofed.fl.protocol import ClientUpdate

LOCAL_OPTIMIZERS = ("adamw", "sgd")


def run_first_order_client(ctx: ClientContext, start: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
                           local: LocalTraining, local_optimizer: str = "adamw"
                           ) -> tuple[ClientUpdate, list[torch.Tensor]]:
    """`local.local_steps` back-propagation steps from the global weights; uploads the dense update."""
    if len(indices) == 0:
        raise ValueError(f"client {client_id} has no training examples")
    params = ctx.trainable.params
    load_tensors_(ctx.trainable.tensors(), start)
    if local_optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=local.lr, weight_decay=0.0)
    elif local_optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=local.lr)
    else:
        raise ValueError(f"unknown first-order local optimizer {local_optimizer!r}; choose adamw or sgd")
    shift = client_shift(ctx, local, indices)
    losses = []
    for p in params:
        p.requires_grad_(True)
    try:
        for t in range(local.local_steps):
            batch = local_batch(ctx, local, client_id, indices, t)
            optimizer.zero_grad(set_to_none=True)
            loss = ctx.task.loss_tensor(ctx.model, batch, shift)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:  # the shared replica goes back to forward-only for the ZO clients and evaluation
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    final = [t.detach().clone() for t in ctx.trainable.tensors()]
    metrics = {"train_loss": float(np.mean(losses))}
    return dense_update(local.round_id, client_id, local.queries, len(indices), metrics, final, start), final


class FedAvg(Method):
    name = "fedavg"
    summary = "first-order local steps (back-propagation), dense update uploaded, plain averaging"
    first_order = True
    dense_uplink = True
    server_default = ServerDefault("sgd", 1.0)

    def forward_passes(self, local: LocalTraining) -> float:
        """A forward and a backward (two forwards' worth) per local step."""
        return 3.0 * local.local_steps

    def step_seeds(self, local: LocalTraining, client_id: int):
        raise TypeError(f"{self.name} clients back-propagate: their steps have no seeds")

    def train(self, ctx: ClientContext, start: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
              local: LocalTraining, server_state: np.ndarray, **options: Any
              ) -> tuple[ClientUpdate, list[torch.Tensor]]:
        return run_first_order_client(ctx, start, client_id, indices, local,
                                      options.get("first_order_optimizer", "adamw"))


class FedAdam(FedAvg):
    name = "fedadam"
    summary = "FedAvg's clients, with Adam on the server (per coordinate)"
    server_default = ServerDefault("adam", 1e-3)
