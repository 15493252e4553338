"""Update screening: the server scores each client's update by the loss change it causes on a small probe set it
holds, and refuses the updates that raise the loss by more than `federation.screen_threshold`.

Three scores (`federation.screen_score`):
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
- `agreement`: whether the client's scalars agree with the probe set's. The server replays the client's local
  steps from its seeds (it can: that is how it rebuilds the update) and, at each step's weights, measures the
  probe loss's own directional derivative along each of the step's directions (one-sided, q + 1 probe passes a
  step). The score is minus the rank correlation between the client's scalars and those derivatives: an honest
  client's data pulls the same way as the probe set's more often than not, so its correlation is positive, and a
  client that flips its scalars' signs (or sends scalars of another task, or random ones) scores near or above
  zero. Over a round's hundreds of scalars the correlation separates the two even when each pair is mostly
  noise, where a loss change of the whole update cannot: a flipped ZO update is noise, as an honest one is. Its
  price is the replay: a probe pass for every scalar the client sent, which on a trainable label head over
  remembered features costs little, and on a trainable set inside the model as much as the client's own steps.
  Under label skew it fails (docs/security.md): the label head's rows all read one large common component of the
  features, so an honest client holding a class the model over-predicts anti-correlates with a balanced probe set
  as strongly as a flipped one does (AG News at alpha 0.1: 17 of 23 honest uplinks refused at threshold 0). It
  is a screen for federations whose clients' data look like the probe set's.

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
from zofed.fl.roles import Replay, Screen
from zofed.run.setup import Setup
from zofed.zo.perturb import Perturbation, write_directions_
from zofed.zo.step import StepRecord

SCORES = ("alone", "leave-one-out", "agreement")
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


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's correlation of two equal-length samples (ties broken by order); 0 when either is constant, as
    a client sending one value says nothing about direction."""
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    ranks_a, ranks_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def agreement_scores(loss_of: LossOf, replays: Sequence[Replay], eps: float) -> list[float]:
    """Minus the rank correlation between each client's scalars and the probe loss's directional derivatives along
    the same directions at the same weights (see the module's note)."""
    def score(replay: Replay) -> float:
        sent, probe = [], []

        def visit(tensors: Sequence[torch.Tensor], record: StepRecord, pert: Perturbation) -> None:
            centre = loss_of(tensors)
            moved = [torch.empty_like(t) for t in tensors]
            for seed, scalar in zip(record.query_seeds(), record.grads, strict=True):
                write_directions_(moved, tensors, [(seed, eps)], pert)
                sent.append(scalar)
                probe.append((loss_of(moved) - centre) / eps)

        replay(visit)
        return -rank_correlation(np.asarray(sent), np.asarray(probe))

    return [score(replay) for replay in replays]


def probe_loss_screen(setup: Setup, examples: int, seed: int, threshold: float, score: str = "alone",
                      eps: float = 1e-3) -> Screen:
    """A screen scoring updates by `score` (one of SCORES) on `examples` probe examples (`eps`: the step of the
    agreement score's derivatives, the run's zo.eps)."""
    if score not in SCORES:
        raise ValueError(f"unknown screen score {score!r}; choose one of {', '.join(SCORES)}")
    indices = np.sort(streams.probe_set(seed).permutation(len(setup.train))[:examples])
    batch = setup.task.collate(setup.train, indices)
    params = setup.trainable.tensors()
    # with a prefix cache the frozen bottom (every block, on a trainable head) runs over the probe batch once, here
    cached = None if setup.cache is None else setup.task.cached_loss(setup.model, setup.cache, batch)

    def loss_of(tensors: Sequence[torch.Tensor]) -> float:
        load_tensors_(params, tensors)
        return setup.task.loss(setup.model, batch) if cached is None else cached()

    def scores(tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]],
               replays: Sequence[Replay]) -> list[float]:
        held = [p.detach().clone() for p in params]  # the clients' replica: put back as it was
        try:
            if score == "alone":
                return alone_scores(loss_of, tensors, updates)
            if score == "agreement":
                return agreement_scores(loss_of, replays, eps)
            return leave_one_out_scores(loss_of, tensors, updates, threshold)
        finally:
            load_tensors_(params, held)

    measure = "scalars' rank correlation with the probe's, negated" if score == "agreement" else "probe loss change"
    return Screen(scores, threshold, measure)
