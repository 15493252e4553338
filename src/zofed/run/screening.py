"""Update screening: the server scores each client's update on a small probe set it holds and refuses the updates
whose score is above `federation.screen_threshold`. The guard is against updates that push the model somewhere
harmful, whatever their size, and assumes nothing about how many clients lie. In a simulation the probe set is a
seeded sample of the training data, standing in for the few examples a real server would hold.

Three scores (`federation.screen_score`); docs/security.md says what each catches and what it costs honest clients:
- `alone`: loss(global + update) - loss(global), one probe pass a client and one for the round. Under strong label
  skew an honest update may raise the loss on a balanced probe set and a sign-flipped one lower it.
- `leave-one-out`: loss(global + mean of the kept updates) - loss(global + the same mean without it). The worst
  client above the threshold is refused and the rest scored again, until every kept score is at or below it: at
  most m(m+1)/2 + m probe passes for m clients. Two liars that pull the same way hide each other, and honest
  scores are noisy, so it needs a threshold above that noise and clipping before it.
- `agreement`: minus the rank correlation between the client's scalars and the probe loss's own directional
  derivatives along the same directions (read from the client's seeds), taken one-sided at the round's start
  weights: a probe pass per scalar and one for the round. A sign flipper scores the negative of its honest self.
  The derivatives are read at the start because along the client's replayed steps they would flip with its
  scalars. The rows of a trainable label head all read one large common feature, which under label skew
  dominates a client's scalars; so with every block frozen both series are first regressed on each direction's
  component along it (`head_common_mode`) and the residuals are correlated. The agreement fades as the model fits
  the probe set: the score suits federations whose clients' data resemble it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from zofed import streams
from zofed.fl.client import load_tensors_
from zofed.fl.roles import Screen
from zofed.fl.server import ClientSteps
from zofed.models.selection import LABEL_HEAD
from zofed.run.setup import Setup
from zofed.zo.perturb import write_directions_

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


Regressors = Callable[[Sequence[torch.Tensor]], np.ndarray]  # a direction -> the values to regress out along it


def residuals(values: np.ndarray, regressors: np.ndarray) -> np.ndarray:
    """`values` less their least-squares fit on an intercept and `regressors` (rows: samples); unchanged when
    there are too few samples to fit."""
    design = np.column_stack([np.ones(len(values)), regressors])
    if len(values) <= design.shape[1] + 1:
        return values
    return values - design @ np.linalg.lstsq(design, values, rcond=None)[0]


def agreement_scores(loss_of: LossOf, start: Sequence[torch.Tensor], steps: Sequence[ClientSteps], eps: float,
                     common: Regressors | None = None) -> list[float]:
    """Minus the rank correlation between each client's scalars and the probe loss's directional derivatives along
    the same directions at the round's `start` weights, after both are regressed on `common`'s values of each
    direction (see the module's note)."""
    centre = loss_of(start)
    moved = [torch.empty_like(t) for t in start]

    def score(client: ClientSteps) -> float:
        sent, probe, along = [], [], []
        for record, pert in client:
            for seed, scalar in zip(record.query_seeds(), record.grads, strict=True):
                write_directions_(moved, start, [(seed, eps)], pert)
                sent.append(scalar)
                probe.append((loss_of(moved) - centre) / eps)
                if common is not None:
                    along.append(common([(m - t) / eps for m, t in zip(moved, start, strict=True)]))
        sent_values, probe_values = np.asarray(sent, np.float64), np.asarray(probe, np.float64)
        if common is not None:
            sent_values, probe_values = residuals(sent_values, np.asarray(along)), residuals(probe_values,
                                                                                           np.asarray(along))
        return -rank_correlation(sent_values, probe_values)

    return [score(client) for client in steps]


def head_common_mode(setup: Setup, indices: np.ndarray) -> Regressors | None:
    """The label head's common-mode regressors (see the module's note): for each head row, a direction's part of
    that row dotted with the unit mean of the probe examples' features, as the head reads them. None unless the
    head trains and every block is frozen (the features then never change)."""
    cache = setup.cache
    heads = [i for i, name in enumerate(setup.trainable.names) if LABEL_HEAD in name.split(".")]
    if not heads or cache is None or cache.start != len(cache.layers):
        return None
    with torch.no_grad():
        features = setup.task.last_features(cache, setup.train, indices, body=setup.train_body)
        features = cache.backbone.norm(features).float()
    mean = features.mean(0)
    unit = (mean / mean.norm()).cpu()

    def along(direction: Sequence[torch.Tensor]) -> np.ndarray:
        return np.concatenate([(direction[i].detach().float().cpu().view(-1, unit.numel()) @ unit).numpy()
                               for i in heads])

    return along


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
    cached = (None if setup.cache is None
              else setup.task.cached_loss(setup.model, setup.cache, batch, body=setup.train_body))
    common = head_common_mode(setup, indices) if score == "agreement" else None

    def loss_of(tensors: Sequence[torch.Tensor]) -> float:
        load_tensors_(params, tensors)
        return setup.task.loss(setup.model, batch) if cached is None else cached()

    def scores(tensors: Sequence[torch.Tensor], updates: list[list[torch.Tensor]],
               steps: Sequence[ClientSteps]) -> list[float]:
        held = [p.detach().clone() for p in params]  # the clients' replica: put back as it was
        try:
            if score == "alone":
                return alone_scores(loss_of, tensors, updates)
            if score == "agreement":
                return agreement_scores(loss_of, tensors, steps, eps, common)
            return leave_one_out_scores(loss_of, tensors, updates, threshold)
        finally:
            load_tensors_(params, held)

    measure = "scalars' rank correlation with the probe's, negated" if score == "agreement" else "probe loss change"
    return Screen(scores, threshold, measure)
