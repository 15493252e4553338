"""Cached features (federation.feature_cache): with every block frozen, a client runs its examples through the
model once a round and steps its label head on their last hidden states."""

import json

import numpy as np
import pytest
import torch
from toy_federation import tiny_federated_config, toy_context

from zofed.models.selection import TrainableConfig, select_trainable
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run
from zofed.zo.prefix import PrefixCache, first_trainable_layer

HEAD = ("trainable.mode=none", "trainable.label_head=true", "zo.prefix_cache=true")


def _head_context():
    ctx = toy_context()
    ctx.task.attach_label_head(ctx.model)
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="none", label_head=True))
    with torch.no_grad():  # a head away from the zero-shot rows, so the loss reads it
        trainable.tensors()[0].add_(0.3 * torch.randn_like(trainable.tensors()[0]))
    return ctx, model, trainable


def test_the_loss_on_cached_features_is_the_full_forward_loss():
    ctx, model, trainable = _head_context()
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    rows = np.arange(5, 29)  # three batches of 8, with prompts of several lengths
    features = ctx.task.last_features(cache, ctx.train, rows, batch_size=8)
    assert features.shape == (24, model.config.hidden_size)
    labels = torch.as_tensor(ctx.train.labels[rows])
    shift = torch.tensor([0.4, -0.9])
    full = ctx.task.loss(model, ctx.task.collate(ctx.train, rows), shift)
    assert ctx.task.feature_loss(model, cache, features, labels, shift) == pytest.approx(full, abs=1e-5)
    with torch.no_grad():  # the features do not hold the head: a new head reads them at once
        trainable.tensors()[0].mul_(-1)
    moved = ctx.task.loss(model, ctx.task.collate(ctx.train, rows), shift)
    assert abs(moved - full) > 1e-3
    assert ctx.task.feature_loss(model, cache, features, labels, shift) == pytest.approx(moved, abs=1e-5)
    with pytest.raises(ValueError, match="every block frozen"):
        ctx.task.last_features(PrefixCache(model, 1), ctx.train, rows, batch_size=8)


def test_a_run_on_cached_features_charges_them_once_a_round_learns_and_replays(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    config = tiny_federated_config(tiny_workspace, out, *HEAD, "federation.method=zofed", "zo.queries=8",
                                   "federation.feature_cache=20", "federation.local_steps=25", "optimizer.lr=0.05",
                                   "federation.rounds=4")
    results = run_federated(config, show_progress=False)
    # 20 examples in batches of 8 a client round, and 25 steps over the head alone on top
    assert results["forward_passes_per_client_round"] == pytest.approx(20 / 8)
    assert results["forward_passes"] == pytest.approx(4 * 2 * 20 / 8)
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["accepted"] == 2 for r in rounds)
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]
    assert replay_run(out).matches  # the server rebuilt from seeds and scalars what the clients stepped


def test_cached_features_are_refused_where_they_cannot_be_the_model_s_input(tiny_workspace, tmp_path):
    with pytest.raises(ConfigError, match="needs zo.prefix_cache=true"):
        tiny_federated_config(tiny_workspace, tmp_path / "a", "trainable.mode=none", "trainable.label_head=true",
                              "federation.feature_cache=8")
    config = tiny_federated_config(tiny_workspace, tmp_path / "b", "trainable.mode=patterns", "zo.prefix_cache=true",
                                   "trainable.patterns=['layers\\.1\\..*norm\\.weight$']", "federation.feature_cache=8")
    with pytest.raises(ConfigError, match="needs every block of the model frozen"):
        run_federated(config, show_progress=False)
    config = tiny_federated_config(tiny_workspace, tmp_path / "c", *HEAD, "federation.method=fedavg",
                                   "federation.feature_cache=8")
    with pytest.raises(ConfigError, match="fedavg back-propagates"):
        run_federated(config, show_progress=False)


def test_evaluating_a_frozen_body_runs_each_example_through_it_once_per_run():
    ctx, model, trainable = _head_context()
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    seen = []  # examples that went through the blocks
    cache.backbone.register_forward_pre_hook(lambda m, args, kwargs: seen.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)
    rows, more = np.arange(0, 24), np.arange(16, 40)
    full = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert sum(seen) == 24
    ctx.task.evaluate_from_features(cache)
    remembered = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert remembered["accuracy"] == full["accuracy"]
    assert remembered["loss"] == pytest.approx(full["loss"], abs=1e-5)
    assert sum(seen) == 48
    ctx.task.evaluate(model, ctx.train, 8, more)  # only the 16 examples not seen before run the blocks
    assert sum(seen) == 64
    with torch.no_grad():  # a new head is read from the remembered features at once
        trainable.tensors()[0].mul_(-1)
    moved = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert sum(seen) == 64
    ctx.task.evaluate_from_features(None)
    fresh = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert abs(fresh["loss"] - full["loss"]) > 1e-3
    assert moved["accuracy"] == fresh["accuracy"]
    assert moved["loss"] == pytest.approx(fresh["loss"], abs=1e-5)
    assert sum(seen) == 88
    ctx.task.evaluate_from_features(PrefixCache(model, 1))  # blocks above the cut may train: no memory
    ctx.task.evaluate(model, ctx.train, 8, rows)
    ctx.task.evaluate(model, ctx.train, 8, rows)
    assert sum(seen) == 88 + 2 * 24
