"""Cached features (zo.cache: features): with every block frozen, a client runs its examples through the model once
a round and steps its label head on their last hidden states; the in-process simulator remembers each example's
row across rounds and runs (ZOFED_FEATURE_STORE), which changes no bit of a run."""

import json
from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import recompute_features, tiny_federated_config, toy_context

from zofed.data.body_features import ROWS_ALONE, BodyFeatures, fingerprint
from zofed.data.tasks import Encoded
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run
from zofed.zo.prefix import PrefixCache, first_trainable_layer

HEAD = ("trainable.mode=none", "trainable.label_head=true", "zo.cache=features")


def _head_context():
    ctx = toy_context()
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="none", label_head=True),
                                        ctx.task.label_token_ids)
    with torch.no_grad():  # a head away from the zero-shot rows, so the loss reads it
        trainable.tensors()[0].add_(0.3 * torch.randn_like(trainable.tensors()[0]))
    return ctx, model, trainable


def test_the_loss_on_cached_features_is_the_full_forward_loss():
    ctx, model, trainable = _head_context()
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    rows = np.arange(5, 29)  # three batches of 8, with prompts of several lengths
    features = ctx.task.last_features(cache, ctx.train, rows)
    assert features.shape == (24, model.config.hidden_size)
    # each row comes back in its example's place, the bits it gives alone whatever else is asked with it
    ragged = Encoded([ids[i % 3:] for i, ids in enumerate(ctx.train.input_ids)], ctx.train.labels)
    together = ctx.task.last_features(cache, ragged, rows)
    for k in (0, 7, 10, 23):
        assert torch.equal(together[k], ctx.task.last_features(cache, ragged, rows[k:k + 1])[0])
    assert not torch.allclose(together[0], together[1], atol=1e-3)
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
        ctx.task.last_features(PrefixCache(model, 1), ctx.train, rows)


def test_a_step_s_feature_loss_reads_the_weights_of_each_call_a_trainable_final_norm_included():
    """A step's loss function keeps its normed features between queries only while the norm stays bit for bit
    the same: moving the head or the norm in place (as the ZO engine does) must show in the next reading."""
    ctx = toy_context()
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="patterns", patterns=[r"^model\.norm\."],
                                                                   label_head=True),
                                        ctx.task.label_token_ids)
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    rows = np.arange(3, 11)
    features = ctx.task.last_features(cache, ctx.train, rows)
    labels, shift = torch.as_tensor(ctx.train.labels[rows]), torch.tensor([0.2, -0.3])
    loss = ctx.task.feature_loss_fn(model, cache, features, labels, shift)
    first = loss()
    assert loss() == first == ctx.task.feature_loss(model, cache, features, labels, shift)
    by_name = dict(zip(trainable.names, trainable.tensors(), strict=True))
    norm, head = by_name["model.norm.weight"], by_name["label_head"]
    for tensor, change in ((norm, lambda t: t.mul_(1.5).add_(0.1)), (head, lambda t: t.mul_(-1))):
        with torch.no_grad():
            change(tensor)
        now = ctx.task.feature_loss(model, cache, features, labels, shift)  # a fresh evaluation
        assert loss() == now and abs(now - first) > 1e-4
        first = now


def test_a_run_on_cached_features_charges_them_once_a_round_learns_and_replays(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    config = tiny_federated_config(tiny_workspace, out, *HEAD, "federation.method=zofed", "zo.queries=8",
                                   "federation.cached_examples=20", "federation.local_steps=25", "optimizer.lr=0.05",
                                   "federation.rounds=4")
    results = run_federated(config, show_progress=False)
    # 20 examples in batches of 8 a client round, and 25 steps of 8 one-sided queries (9 passes) over the head alone
    # (its share of a full pass: the final norm and 2 label rows of the tiny Llama, 96 of 18,624 multiply-adds)
    per_client = 20 / 8 + 25 * 9 * (32 * 3 / (2 * 9280 + 32 * 2))
    assert results["forward_passes_per_client_round"] == pytest.approx(per_client)
    assert results["forward_passes"] == pytest.approx(4 * 2 * per_client)
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["accepted"] == 2 for r in rounds)
    # the watched examples, not the train loss: each round's train loss is over other clients' examples
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"]
    assert replay_run(out).matches  # the server rebuilt from seeds and scalars what the clients stepped


def test_cached_features_are_refused_where_they_cannot_be_the_model_s_input(tiny_workspace, tmp_path):
    with pytest.raises(ConfigError, match="cached_examples=8 .* this run has zo.cache: none"):
        tiny_federated_config(tiny_workspace, tmp_path / "a", "trainable.mode=none", "trainable.label_head=true",
                              "zo.cache=none", "federation.cached_examples=8")
    for trains in (["trainable.mode=patterns", "trainable.patterns=['layers\\.1\\..*norm\\.weight$']"],
                   ["trainable.mode=lora"]):
        config = tiny_federated_config(tiny_workspace, tmp_path / "b", *trains, "zo.cache=features")
        with pytest.raises(ConfigError, match="zo.cache: features needs .*body is frozen"):
            run_federated(config, show_progress=False)
    with pytest.raises(ConfigError, match="zo.cache: features caches what a prompt classifier's head reads"):
        tiny_federated_config(tiny_workspace, tmp_path / "c", "task.type=causal-lm", "zo.cache=features")


def test_evaluating_a_frozen_body_runs_each_example_through_it_once_per_run():
    ctx, model, trainable = _head_context()
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    seen = []  # examples that went through the blocks
    cache.backbone.register_forward_pre_hook(lambda m, args, kwargs: seen.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)
    rows, more = np.arange(0, 24), np.arange(16, 40)
    full = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert sum(seen) == 24
    memo = BodyFeatures(cache)
    remembered = ctx.task.evaluate(model, ctx.train, 8, rows, body=memo)
    assert remembered["accuracy"] == full["accuracy"]
    assert remembered["loss"] == pytest.approx(full["loss"], abs=1e-5)
    assert sum(seen) == 24 + _distinct(ctx, rows)  # an example repeated word for word runs once
    ctx.task.evaluate(model, ctx.train, 8, more, body=memo)  # only the examples not seen before run the blocks
    known = 24 + _distinct(ctx, rows, more)
    assert sum(seen) == known
    with torch.no_grad():  # a new head is read from the remembered features at once
        trainable.tensors()[0].mul_(-1)
    moved = ctx.task.evaluate(model, ctx.train, 8, rows, body=memo)
    assert sum(seen) == known
    fresh = ctx.task.evaluate(model, ctx.train, 8, rows)
    assert abs(fresh["loss"] - full["loss"]) > 1e-3
    assert moved["accuracy"] == fresh["accuracy"]
    assert moved["loss"] == pytest.approx(fresh["loss"], abs=1e-5)
    assert sum(seen) == known + 24
    with pytest.raises(ValueError, match="every block frozen"):  # blocks above the cut may train: no memory
        BodyFeatures(PrefixCache(model, 1))


def _distinct(ctx, *rows) -> int:
    """How many different token sequences the examples `rows` hold (the toy data repeats some sentences)."""
    return len({tuple(ctx.train.input_ids[i]) for r in rows for i in r})


def _blocks_seen(model) -> list[int]:
    """A list that grows by the batch size each time the model's body runs."""
    seen: list[int] = []
    PrefixCache(model, 0).backbone.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(len(kwargs["input_ids"])), with_kwargs=True)
    return seen


def test_remembered_body_features_give_the_full_forward_losses_and_run_each_example_once():
    ctx, model, trainable = _head_context()
    rows, overlapping = np.arange(0, 16), np.arange(8, 24)
    shift = torch.tensor([0.2, -0.5])
    full = [ctx.task.loss(model, ctx.task.collate(ctx.train, r), shift) for r in (rows, overlapping)]
    seen = _blocks_seen(model)
    whole = PrefixCache(model, first_trainable_layer(model, trainable.names))
    memo = BodyFeatures(whole)

    def remembered(r: np.ndarray) -> float:
        return ctx.task.cached_loss(model, whole, ctx.task.collate(ctx.train, r), shift, body=memo)()

    assert remembered(rows) == pytest.approx(full[0], abs=1e-5)
    assert sum(seen) == _distinct(ctx, rows)
    assert remembered(rows) == pytest.approx(full[0], abs=1e-5)
    assert remembered(overlapping) == pytest.approx(full[1], abs=1e-5)
    assert sum(seen) == _distinct(ctx, rows, overlapping)  # only the examples not seen before ran the body
    cached = ctx.task.cached_loss(model, whole, ctx.task.collate(ctx.train, rows), shift, body=memo)
    features = ctx.task.last_features(whole, ctx.train, overlapping, body=memo)
    assert sum(seen) == _distinct(ctx, rows, overlapping)
    with torch.no_grad():  # the head is read afresh from the remembered rows
        trainable.tensors()[0].mul_(-1)
    moved = ctx.task.loss(model, ctx.task.collate(ctx.train, rows), shift)
    assert abs(moved - full[0]) > 1e-3
    assert cached() == pytest.approx(moved, abs=1e-5)
    labels = torch.as_tensor(ctx.train.labels[overlapping])
    assert ctx.task.feature_loss(model, whole, features, labels) == pytest.approx(
        ctx.task.loss(model, ctx.task.collate(ctx.train, overlapping)), abs=1e-5)


def test_a_features_store_is_shared_by_runs_of_the_same_body_only(tmp_path):
    ctx, model, trainable = _head_context()
    whole = PrefixCache(model, first_trainable_layer(model, trainable.names))
    mark = fingerprint(model, trainable.names)
    first, second = BodyFeatures(whole, tmp_path, mark), BodyFeatures(whole, tmp_path, mark)
    ids = ctx.train.input_ids
    run = partial(ctx.task._features_alone, whole)  # the task's own row computation (each example alone)
    a = first.lookup([ids[i] for i in range(10)], run)
    second.lookup([ids[i] for i in range(5, 20)], run)
    first.save()
    second.save()  # side by side: the second run merges its rows into the file the first wrote
    with torch.no_grad():  # training the head does not change the body, nor the fingerprint
        trainable.tensors()[0].add_(1.0)
    assert fingerprint(model, trainable.names) == mark
    later = BodyFeatures(whole, tmp_path, mark)
    assert len(later) == _distinct(ctx, range(20)) and later.computed == 0
    refuse = lambda ids: pytest.fail("a stored row was computed again")  # noqa: E731
    assert torch.equal(later.lookup([ids[i] for i in range(10)], refuse), a)
    assert later.computed == 0
    with torch.no_grad():  # another body is another store
        whole.backbone.layers[0].input_layernorm.weight.add_(0.1)
    assert fingerprint(model, trainable.names) != mark
    (tmp_path / f"{mark}.{ROWS_ALONE}.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="cannot be read"):
        BodyFeatures(whole, tmp_path, mark)


def test_a_run_remembering_body_features_ends_bit_for_bit_as_a_recomputing_run(tiny_workspace, tmp_path,
                                                                               monkeypatch):
    """The simulator remembers body features by itself with zo.cache: features; a run whose clients compute their
    round features afresh (as Flower's do), and one reading a store a first run filled, end with the same bits."""
    head = (*HEAD, "federation.method=zofed", "zo.queries=2", "optimizer.lr=0.05", "federation.eval_every=1",
            "federation.local_steps=6")
    store = tmp_path / "store"
    monkeypatch.setenv("ZOFED_FEATURE_STORE", str(store))
    seen = []  # how many examples the body ran in each run
    original = BodyFeatures.save
    monkeypatch.setattr(BodyFeatures, "save", lambda self: (seen.append(self.computed), original(self))[1])
    runs = {}
    for name in ("cold", "warm", "recomputed"):
        if name == "recomputed":
            monkeypatch.delenv("ZOFED_FEATURE_STORE")
            recompute_features(monkeypatch)
        out = tmp_path / name
        results = run_federated(tiny_federated_config(tiny_workspace, out, *head), show_progress=False)
        log = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (results, [r.get("train_loss") for r in log], [r.get("eval_loss") for r in log],
                      load_file(str(out / "final" / "trainable.safetensors")))
    cold = runs["cold"]
    for name in ("warm", "recomputed"):
        other = runs[name]
        assert other[0]["forward_passes"] == cold[0]["forward_passes"]  # a client's compute is counted as it runs
        assert other[1] == cold[1] and other[2] == cold[2], name
        assert all(torch.equal(other[3][k], cold[3][k]) for k in cold[3]), name
    assert len(list(store.glob("*.safetensors"))) == 1
    assert seen[0] > 0 and seen[1] == 0  # the second run read every row from the first run's store
    assert replay_run(tmp_path / "warm").matches
