"""The client's local ZO training: steps on its own data from the global weights, reported as an uplink.

The client perturbs from a clean copy of its trainable tensors (see `zo_step(clean=...)`), so the update it
applies locally is bit-identical to what the server rebuilds from its seeds and scalars. Which seeds and which
perturbation each step uses is the method's choice (fl/methods/); this module only runs the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from zofed import streams
from zofed.data.body_features import BodyFeatures
from zofed.data.prefix_memo import PrefixMemo, prefix_tensors, simulation_memo
from zofed.data.tasks import Encoded, Task, label_shift, shifted
from zofed.fl.plan import LocalTraining
from zofed.fl.protocol import ClientUpdate
from zofed.fl.updates import StepSeeds
from zofed.models.selection import TrainableParams
from zofed.zo.perturb import Perturbation
from zofed.zo.prefix import PrefixCache, first_trainable_layer
from zofed.zo.step import zo_step


@dataclass
class ClientContext:
    """Shared by all simulated clients of a process: one model replica and the encoded training data."""

    model: torch.nn.Module
    trainable: TrainableParams
    task: Task
    train: Encoded
    # the frozen body's remembered features (zo.cache: features, or none in the in-process simulator): a client's
    # features are read from them instead of rerun, which changes no bit (each row is computed alone either way)
    # nor the compute charged; None: rerun
    body: BodyFeatures | None = None
    # the frozen prefix's remembered rows (zo.cache: prefix in the in-process simulator, sim/engine.py): a step's
    # capture pass reads them instead of running the frozen bottom; None: it runs the bottom
    prefixes: PrefixMemo | None = None


def load_tensors_(tensors: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values, strict=True):
            t.copy_(v)


def batch_rows(local: LocalTraining, client_id: int, rows: np.ndarray, step: int) -> np.ndarray:
    """Which of `rows` the client's batch at a local step holds (its own stream, see streams.py)."""
    rng = streams.local_batch(local.run_seed, local.round_id, client_id, step)
    return rng.choice(rows, size=min(local.batch_size, len(rows)), replace=False)


def local_batch(ctx: ClientContext, local: LocalTraining, client_id: int, indices: np.ndarray, step: int):
    """The client's batch at a local step, drawn from its examples `indices`."""
    return ctx.task.collate(ctx.train, batch_rows(local, client_id, indices, step))


def dense_update(round_id: int, client_id: int, queries: int, num_examples: int, metrics: dict[str, float],
                 final: Sequence[torch.Tensor], start: Sequence[torch.Tensor]) -> ClientUpdate:
    """An uplink carrying the whole update (final - start) as one float32 vector."""
    dense = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)]).cpu().numpy()
    return ClientUpdate(round_id, client_id, np.zeros(0, np.uint64), None, np.zeros((0, queries), np.float32),
                        num_examples, metrics, dense.astype(np.float32))


def client_shift(ctx: ClientContext, local: LocalTraining, indices: np.ndarray) -> torch.Tensor | None:
    """The logit shift of this client's training loss (federation.logit_adjust), or None when off."""
    if local.logit_adjust == 0:
        return None
    if not ctx.task.num_classes:
        raise ValueError("federation.logit_adjust needs a classification task with labels")
    return label_shift(ctx.train.labels[indices], ctx.task.num_classes, local.logit_adjust)


def client_cache(ctx: ClientContext, local: LocalTraining) -> PrefixCache | None:
    """The prefix cache the round plan asks for (pass_fraction below 1), split where this client's model's first
    trainable block is; a model that splits elsewhere than the plan says is refused (its compute would be
    miscounted). A plan charging whole passes gets no cache, but in the simulator a split reading the remembered
    prefixes or body features (`simulation_prefixes`, `Setup.simulated_body`): the charge stays the plan's, only
    the simulator's time is saved."""
    simulated = ctx.prefixes is not None or ctx.body is not None
    if local.pass_fraction >= 1.0 and not simulated:
        return None
    start = first_trainable_layer(ctx.model, ctx.trainable.names)
    cache = None if start is None else PrefixCache(ctx.model, start, ctx.task.full_vocabulary, ctx.prefixes,
                                                   ctx.trainable.named())
    if local.pass_fraction >= 1.0:  # the simulator's own split; the plan's charge stays whole passes
        return cache
    if cache is None or abs(cache.fraction - local.pass_fraction) > 1e-9:
        raise ValueError(f"the round plan charges {local.pass_fraction:.4f} of a full pass per perturbed pass, "
                         "but on this client's model " + ("no block can start a cached pass" if cache is None
                                                          else f"one costs {cache.fraction:.4f}"))
    return cache


def simulation_prefixes(ctx: ClientContext, pass_fraction: float, feature_cache: int,
                        client_indices: Sequence[np.ndarray]) -> PrefixMemo | None:
    """The memo a simulation keeps of its clients' prefixes, when their steps could split the model above a frozen
    bottom (a prefix cache, a round's cached prefixes, or whole passes charged with zo.cache: none, which the
    simulator then splits all the same; not the label head's round features, nor where body features are
    remembered) and the rows of their examples fit the simulator's memory (`simulation_memo`); None otherwise."""
    if ctx.body is not None or not ctx.task.splits_at_prefix or (feature_cache and pass_fraction == 0.0):
        return None
    start = first_trainable_layer(ctx.model, ctx.trainable.names)
    if start is None or (pass_fraction >= 1.0 and start == 0):  # nothing frozen below: nothing to remember
        return None
    cache = PrefixCache(ctx.model, start)
    below = {t.data_ptr() for _, t in prefix_tensors(cache)}
    if any(p.data_ptr() in below for p in ctx.trainable.params):  # a tied tensor trains: the prefix moves
        return None
    examples = np.unique(np.concatenate([np.asarray(i, dtype=np.int64) for i in client_indices]))
    return simulation_memo(cache, sum(len(ctx.train.input_ids[i]) for i in examples))


@dataclass
class RoundFeatures:
    """The examples a client ran through its frozen model this round (zo.cache: features): their last
    hidden states and labels, which every local step draws its batch from."""

    features: torch.Tensor
    labels: torch.Tensor

    def batch(self, local: LocalTraining, client_id: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The features and labels of local step `step`'s batch, drawn from the cached examples as `local_batch`
        draws."""
        rows = torch.as_tensor(batch_rows(local, client_id, np.arange(len(self.labels)), step),
                               device=self.labels.device)
        return self.features[rows], self.labels[rows]

    def step_loss(self, ctx: ClientContext, local: LocalTraining, client_id: int, step: int, cache: PrefixCache,
                  shift: torch.Tensor | None):
        """The loss of local step `step`'s batch, as a function of the trainable head (a ZO step's loss)."""
        features, labels = self.batch(local, client_id, step)
        return ctx.task.feature_loss_fn(ctx.model, cache, features, labels, shift)

    def loss_tensor(self, ctx: ClientContext, local: LocalTraining, client_id: int, step: int, cache: PrefixCache,
                    shift: torch.Tensor | None) -> torch.Tensor:
        """The loss of local step `step`'s batch as a tensor, differentiable in the final norm and the head alone
        (the features are fixed): a first-order step's loss."""
        features, labels = self.batch(local, client_id, step)
        return F.cross_entropy(shifted(ctx.task.feature_logits(ctx.model, cache, features), shift), labels)


@dataclass
class RoundPrefixes:
    """The examples a client ran through its frozen bottom this round (zo.cache: prefix with
    federation.cached_examples): every local step draws its batch from them, as `RoundFeatures` does, and runs only
    the blocks above the split, reading their prefixes from the cache's memo (each computed once, alone)."""

    chosen: np.ndarray
    cache: PrefixCache
    every: Callable[[], float] | None = None  # the loss of all the round's examples, built at the first step

    def step_loss(self, ctx: ClientContext, local: LocalTraining, client_id: int, step: int, cache: PrefixCache,
                  shift: torch.Tensor | None):
        """The loss of local step `step`'s batch, as a function of the trainable top blocks (a ZO step's loss).
        A batch as large as the round's examples is all of them, in the same (sorted) order at every step: one loss
        serves the round, so its prefix is assembled once and the blocks' outputs are kept from step to step while
        their trainable tensors hold their bits (a step on the label head or the final norm runs no block)."""
        if local.batch_size >= len(self.chosen):
            if self.every is None:
                self.every = ctx.task.cached_loss(ctx.model, self.cache, ctx.task.collate(ctx.train, self.chosen),
                                                  shift)
            return self.every
        rows = self.chosen[batch_rows(local, client_id, np.arange(len(self.chosen)), step)]
        return ctx.task.cached_loss(ctx.model, self.cache, ctx.task.collate(ctx.train, rows), shift)


def round_features(ctx: ClientContext, local: LocalTraining, client_id: int, indices: np.ndarray,
                   cache: PrefixCache | None) -> RoundFeatures | RoundPrefixes:
    """Run `local.feature_cache` of the client's examples (a draw of its own stream; all when it has fewer)
    through the frozen part once: the whole body, whose last hidden states the label head reads, when every block
    is frozen; else the bottom below the cache's split, whose rows the round's steps read."""
    if cache is None:
        raise ValueError("federation.cached_examples needs the prefix cached (zo.cache: features or prefix) on a "
                         "decoder whose trainable tensors lie above a frozen bottom")
    rng = streams.round_features(local.run_seed, local.round_id, client_id)
    chosen = np.sort(rng.choice(indices, size=min(local.feature_cache, len(indices)), replace=False))
    if cache.start < len(cache.layers):  # blocks train: keep the chosen examples' prefixes for the round
        if cache.memo is None:  # no simulator memo (a Flower client): the round keeps its own
            cache = PrefixCache(ctx.model, cache.start, ctx.task.full_vocabulary, PrefixMemo(), ctx.trainable.named())
        return RoundPrefixes(chosen, cache)
    if not hasattr(ctx.task, "last_features"):
        raise ValueError("zo.cache: features needs a prompt-classification task with every block frozen and "
                         "the prefix cached")
    features = ctx.task.last_features(cache, ctx.train, chosen, body=ctx.body)
    return RoundFeatures(features, torch.as_tensor(ctx.train.labels[chosen], device=features.device))


def run_zo_client(ctx: ClientContext, start: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
                  local: LocalTraining, seeds: StepSeeds, perturbations: Sequence[Perturbation], *,
                  dense: bool = False) -> tuple[ClientUpdate, list[torch.Tensor]]:
    """Local ZO steps (the round's local optimizer, from a fresh state) from `start` along the given seeds and
    perturbations; returns the uplink (seeds and scalars, or the dense update with `dense`) and the client's final
    trainable tensors."""
    if len(indices) == 0:
        raise ValueError(f"client {client_id} has no training examples")
    tensors = ctx.trainable.tensors()
    load_tensors_(tensors, start)
    clean = [t.clone() for t in start]
    optimizer = local.local_optimizer()
    state = optimizer.init(clean)
    cache = client_cache(ctx, local)
    shift = client_shift(ctx, local, indices)
    features = round_features(ctx, local, client_id, indices, cache) if local.feature_cache else None
    grads, losses = [], []
    for t, (seed, pert) in enumerate(zip(seeds.seeds, perturbations, strict=True)):
        if features is not None:
            loss = features.step_loss(ctx, local, client_id, t, cache, shift)
        else:
            batch = local_batch(ctx, local, client_id, indices, t)
            loss = (ctx.task.cached_loss(ctx.model, cache, batch, shift, body=ctx.body) if cache is not None
                    else lambda b=batch: ctx.task.loss(ctx.model, b, shift))
        state, record = zo_step(tensors, loss, optimizer, state, seed=seed, eps=local.eps, lr=local.lr,
                                queries=local.queries, perturbation=pert, clean=clean, estimator=local.estimator,
                                scalar_bits=local.scalar_bits)
        grads.append(record.grads)
        losses.append(record.loss)
    metrics = {"train_loss": float(np.mean(losses))}
    if dense:
        return dense_update(local.round_id, client_id, local.queries, len(indices), metrics, clean, start), clean
    update = ClientUpdate(
        local.round_id, client_id,
        np.array(seeds.seeds, dtype=np.uint64) if seeds.explicit else np.zeros(0, np.uint64),
        None if seeds.explicit else seeds.base_seed, np.asarray(grads, dtype=np.float32), len(indices), metrics,
        scalar_bits=local.scalar_bits)
    return update, clean
