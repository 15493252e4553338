"""A remembered body-feature row is a function of its example alone, not of the batch that first computed it: so a
run remembering features ends bit for bit the same whether it ran in one sitting or two, with or without a store
of rows from an earlier run (zo.cache: features, ZOFED_FEATURE_STORE)."""

import json

import numpy as np
import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config, toy_context

from zofed.data.body_features import BodyFeatures
from zofed.data.tasks import Encoded
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.run.federated import run_federated
from zofed.run.metrics import MetricsLog
from zofed.zo.prefix import PrefixCache, first_trainable_layer

ROWS = np.arange(48)


def _ragged_head_task():
    """The toy task with its label head trainable and every block frozen, on examples of many lengths (so that
    batches pad)."""
    ctx = toy_context()
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="none", label_head=True),
                                        ctx.task.label_token_ids)
    whole = PrefixCache(model, first_trainable_layer(model, trainable.names))
    ragged = Encoded([ids[i % 5:] for i, ids in enumerate(ctx.train.input_ids)], ctx.train.labels)
    return ctx.task, whole, ragged


def _alone(task, whole, data, i) -> torch.Tensor:
    return task.last_features(whole, data, [i], body=BodyFeatures(whole))[0]


def test_a_remembered_row_is_the_row_its_example_gives_alone_bit_for_bit():
    task, whole, data = _ragged_head_task()
    assert len({len(data.input_ids[i]) for i in ROWS}) >= 4  # the batches below pad
    evaluated = task.last_features(whole, data, ROWS, body=BodyFeatures(whole))  # an evaluation's path: many at once
    memo = BodyFeatures(whole)
    trained = torch.cat([task._batch_rows(memo, task.collate(data, ROWS[k:k + 8])) for k in range(0, len(ROWS), 8)])
    alone = torch.stack([_alone(task, whole, data, i) for i in ROWS])
    assert torch.equal(evaluated, alone)
    assert torch.equal(trained, alone)  # a training loss's path: the padded batch a client draws


def _ragged_data(path, n: int, seed: int) -> None:
    """Reviews of 1 to 12 filler words: a batch of them pads its rows to a wide range of lengths."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            label = int(rng.integers(2))
            filler = " ".join(f"w{int(i)}" for i in rng.integers(0, 20, size=int(rng.integers(1, 13))))
            f.write(json.dumps({"text": f"the movie {filler} was {'good' if label else 'bad'}", "label": label}) + "\n")


def _run(ws, out, *extra):
    head = ("trainable.mode=none", "trainable.label_head=true", "federation.method=zofed", "zo.queries=2",
            "optimizer.lr=0.05", "federation.eval_every=2", "zo.cache=features",
            "federation.rounds=4", f"data.source={ws / 'ragged.jsonl'}", f"data.test_source={ws / 'ragged-test.jsonl'}")
    return tiny_federated_config(ws, out, *head, *extra)


def _two_sittings(ws, out, *extra) -> None:
    run_federated(_run(ws, out, "federation.rounds=2", *extra), show_progress=False)
    run_federated(_run(ws, out, *extra), resume=True, show_progress=False)


def _final(out):
    losses = [r["train_loss"] for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]
    return load_file(str(out / "final" / "trainable.safetensors")), losses


def test_a_run_remembering_features_resumes_bit_for_bit_with_and_without_a_store(tiny_workspace, tmp_path,
                                                                                 monkeypatch):
    ws, store = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    (ws / "model").symlink_to(tiny_workspace / "model")
    _ragged_data(ws / "ragged.jsonl", 200, 0)
    _ragged_data(ws / "ragged-test.jsonl", 40, 1)
    monkeypatch.setenv("ZOFED_FEATURE_STORE", str(store))
    run_federated(_run(ws, tmp_path / "whole"), show_progress=False)
    _two_sittings(ws, tmp_path / "warm")  # every row read from the store
    monkeypatch.delenv("ZOFED_FEATURE_STORE")
    _two_sittings(ws, tmp_path / "resumed")  # no store: the second sitting computes its rows afresh
    (whole, whole_losses) = _final(tmp_path / "whole")
    for name in ("resumed", "warm"):
        tensors, losses = _final(tmp_path / name)
        assert set(tensors) == set(whole) and all(torch.equal(tensors[k], whole[k]) for k in whole), name
        assert losses == whole_losses, name
