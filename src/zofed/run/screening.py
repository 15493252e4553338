"""Update screening: the server scores each client's update by the loss change it causes on a small probe set it
holds, and refuses the updates that raise the loss by more than `federation.screen_threshold`.

Two scores (`federation.screen_score`):
- `alone`: loss(global + update) - loss(global). One forward pass of the probe batch a client (and the round one
  more, at the global weights). Under strong label skew an honest client's update raises the loss on a balanced
  probe set by itself, and a sign-flipped one may lower it: the score cannot tell them apart there.
- `leave-one-out`: what the client's update does to the round, loss(global + mean of the kept updates) -
  loss(global + the same mean without it). The worst client above the threshold is refused and the rest scored
  again, until every kept update's score is at or below it: m + 1 probe passes a scoring, at most m(m+1)/2 + m
  for m clients (20 for 5). An update that pulls the round's mean away from what the others agree on scores high,
  unless another liar in the round pulls the same way: leaving one of two out still leaves the other. Measured
  on the robustness benchmark, a zero threshold refused half of the honest uplinks and let colluding scaled
  attackers through (docs/security.md): it needs a threshold above the honest scores' noise and clipping first.

The guard is against updates that push the model somewhere harmful, whatever their size; it needs no assumption
about how many clients lie. In a simulation the probe set is a seeded sample of the training data, standing in for
the few examples a real server would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from zofed import streams
from zofed.fl.client import load_tensors_
from zofed.fl.roles import Screen
from zofed.run.setup import Setup

SCORES = ("alone", "leave-one-out")
LossOf = Callable[[Sequence[torch.Tensor]], float]  # the probe loss at the given trainable tensors


def alone_scores(loss_of: LossOf, tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]]) -> list[float]:
    """Each update's own probe-loss change: loss(global + update) - loss(global)."""
    base = loss_of(tensors)
    return [loss_of([t + d for t, d in zip(tensors, update, strict=True)]) - base for update in updates]


def leave_one_out_scores(loss_of: LossOf, tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]],
                         threshold: float) -> list[float]:
    """Each update's effect on the round's mean, refusing the worst above `threshold` and scoring the rest again
    (see the module's note): a refused update keeps the score it was refused with, a kept one its last."""
    def loss_at_mean(members: list[int]) -> float:
        if not members:
            return loss_of(tensors)
        return loss_of([t + sum(updates[i][k] for i in members) / len(members) for k, t in enumerate(tensors)])

    scores = [0.0] * len(updates)
    kept = list(range(len(updates)))
    while kept:
        with_all = loss_at_mean(kept)
        for i in kept:
            scores[i] = with_all - loss_at_mean([j for j in kept if j != i])
        worst = max(kept, key=lambda i: scores[i])
        if scores[worst] <= threshold:
            break
        kept.remove(worst)
    return scores


def probe_loss_screen(setup: Setup, examples: int, seed: int, threshold: float, score: str = "alone") -> Screen:
    """A screen scoring updates by `score` (one of SCORES) on `examples` probe examples."""
    if score not in SCORES:
        raise ValueError(f"unknown screen score {score!r}; choose one of {', '.join(SCORES)}")
    indices = np.sort(streams.probe_set(seed).permutation(len(setup.train))[:examples])
    batch = setup.task.collate(setup.train, indices)
    params = setup.trainable.tensors()

    def loss_of(tensors: Sequence[torch.Tensor]) -> float:
        load_tensors_(params, tensors)
        return setup.task.loss(setup.model, batch)

    def scores(tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]]) -> list[float]:
        held = [p.detach().clone() for p in params]  # the clients' replica: put back as it was
        try:
            if score == "alone":
                return alone_scores(loss_of, tensors, updates)
            return leave_one_out_scores(loss_of, tensors, updates, threshold)
        finally:
            load_tensors_(params, held)

    return scores, threshold
