"""FedAvg and FedAdam: clients back-propagate and upload their dense update.

They are the baselines the ZO methods are measured against, at the cost a user pays today: back-propagation memory
on every client, and an uplink as large as the trainable tensors. The server side is shared with the ZO methods: the
mean of the dense updates is the pseudo-gradient of the server optimizer (sgd with lr 1 is FedAvg, adam is FedAdam).

With every block frozen and the label head training, their clients step on cached features as the ZO clients do
(zo.cache: features; `federation.recipe=head federation.method=fedavg` runs the head recipe this way). Of the
recipe's settings they read the cached features, logit_adjust and the server's tail averaging; the ZO keys
(zo.queries, optimizer.lr, scalar_bits) do not apply: the local lr is federation.first_order_lr and the dense
uplink travels as float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zofed.fl.client import (
    ClientContext,
    client_cache,
    client_shift,
    dense_update,
    load_tensors_,
    local_batch,
    round_features,
)
from zofed.fl.methods.base import Method, ServerDefault
from zofed.fl.plan import LocalTraining
from zofed.fl.protocol import ClientUpdate

LOCAL_OPTIMIZERS = ("adamw", "sgd")


def run_first_order_client(ctx: ClientContext, start: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
                           local: LocalTraining, local_optimizer: str = "adamw"
                           ) -> tuple[ClientUpdate, list[torch.Tensor]]:
    """`local.local_steps` back-propagation steps from the global weights; uploads the dense update (float32,
    whatever `local.scalar_bits` says: that setting narrows ZO scalars). With `local.feature_cache` the client runs
    that many of its examples through the frozen model once (`round_features`, as a ZO client does) and every step
    back-propagates through the final norm and the label head alone, on a batch of their last hidden states."""
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
    cache = client_cache(ctx, local) if local.feature_cache else None
    features = round_features(ctx, local, client_id, indices, cache) if local.feature_cache else None
    losses = []
    for p in params:
        p.requires_grad_(True)
    try:
        for t in range(local.local_steps):
            optimizer.zero_grad(set_to_none=True)
            if features is not None:
                loss = features.loss_tensor(ctx, local, client_id, t, cache, shift)
            else:
                loss = ctx.task.loss_tensor(ctx.model, local_batch(ctx, local, client_id, indices, t), shift)
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
