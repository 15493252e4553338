"""Update screening: the server scores each client's update by the loss change it causes on a small probe set it
holds, and refuses the updates that raise the loss by more than `federation.screen_threshold`.

Each client costs one forward pass of the probe batch (and the round one more, at the global weights). The guard
is against updates that push the model somewhere harmful, whatever their size; it needs no assumption about how
many clients lie. In a simulation the probe set is a seeded sample of the training data, standing in for the few
examples a real server would hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zofed import streams
from zofed.fl.client import load_tensors_
from zofed.fl.roles import Screen
from zofed.run.setup import Setup


def probe_loss_screen(setup: Setup, examples: int, seed: int, threshold: float) -> Screen:
    """A screen scoring an update by loss(global + update) - loss(global) on `examples` probe examples."""
    indices = np.sort(streams.probe_set(seed).permutation(len(setup.train))[:examples])
    batch = setup.task.collate(setup.train, indices)
    params = setup.trainable.tensors()

    def score(tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]]) -> list[float]:
        held = [p.detach().clone() for p in params]  # the clients' replica: put back as it was
        try:
            load_tensors_(params, tensors)
            base = setup.task.loss(setup.model, batch)
            changes = []
            for update in updates:
                load_tensors_(params, [t + d for t, d in zip(tensors, update, strict=True)])
                changes.append(setup.task.loss(setup.model, batch) - base)
            return changes
        finally:
            load_tensors_(params, held)

    return score, threshold
