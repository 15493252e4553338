"""A task reads a model and never changes it: the label head is the trainable selection's to attach
(models/selection.py), and only when trainable.label_head asks for it. Where remembered body features stand in for
the body, the caller hands the memo over; the task keeps no state that changes what its methods compute."""

import numpy as np
import pytest
import torch
from toy_federation import WORDS, tiny_federated_config

from zofed.data.body_features import BodyFeatures
from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import LABEL_HEAD, TrainableConfig, label_head_rows, select_trainable, unwrap
from zofed.models.tiny import tiny_causal_lm
from zofed.zo.prefix import PrefixCache, first_trainable_layer


def _data() -> TextDataset:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=24)
    texts = [f"the movie was {WORDS[2 * (1 - y) + int(rng.integers(2))]} " + "w1 " * int(rng.integers(0, 4))
             for y in labels]
    return TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")


def _state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """Every tensor of the model (parameters and buffers, by name) and every module (name and type)."""
    tensors = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return tensors, [(n, type(m).__name__) for n, m in model.named_modules()]


def _assert_unchanged(model: torch.nn.Module, before) -> None:
    tensors, modules = _state(model)
    assert modules == before[1]
    assert list(tensors) == list(before[0])
    assert all(torch.equal(tensors[n], before[0][n]) for n in tensors)


def _task_state(task) -> dict[str, int]:
    """What the task object holds: each attribute's identity (a method that stored a memo or flag would show)."""
    return {k: id(v) for k, v in vars(task).items()}


@pytest.mark.parametrize("label_head", [False, True])
def test_making_and_using_a_task_leaves_the_model_and_the_task_as_they_were(label_head):
    tiny = tiny_causal_lm(seed=0, num_layers=2)
    config = TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"])
    if label_head:  # the selection attaches the head before the task reads the model
        model, trainable = select_trainable(tiny.model, TrainableConfig(mode="none", label_head=True),
                                            make_task(config, tiny.tokenizer, 2).label_token_ids)
    else:
        model, trainable = select_trainable(tiny.model, TrainableConfig(mode="patterns", patterns=[r"^model\.norm\."]))
    before = _state(model)
    task = make_task(config, tiny.tokenizer, 2)
    _assert_unchanged(model, before)
    task_before = _task_state(task)
    data = task.encode(_data())
    batch = task.collate(data, np.arange(16))
    whole = PrefixCache(model, first_trainable_layer(model, trainable.names))
    memo = BodyFeatures(whole)
    features = task.last_features(whole, data, np.arange(8))
    shift = torch.tensor([0.3, -0.2])
    plain = task.loss(model, batch, shift)
    assert task.loss_tensor(model, batch, shift).item() == pytest.approx(plain)
    assert task.cached_loss(model, whole, batch, shift)() == pytest.approx(plain, abs=1e-5)
    assert task.cached_loss(model, whole, batch, shift, body=memo)() == pytest.approx(plain, abs=1e-5)
    assert torch.equal(task.last_features(whole, data, np.arange(8), body=memo), features)
    task.feature_loss(model, whole, features, torch.as_tensor(data.labels[:8]), shift)
    evaluated = task.evaluate(model, data, 8)
    remembered = task.evaluate(model, data, 8, body=memo)
    assert remembered["accuracy"] == evaluated["accuracy"]
    assert remembered["loss"] == pytest.approx(evaluated["loss"], abs=1e-5)
    # a run that remembered features does not change what a later plain call computes
    assert task.loss(model, batch, shift) == plain
    assert task.evaluate(model, data, 8) == evaluated
    _assert_unchanged(model, before)
    assert _task_state(task) == task_before


def test_the_head_exists_only_when_the_selection_asks_for_it():
    ids = make_task(TaskConfig(verbalizer=["negative", "positive"]), tiny_causal_lm(seed=0).tokenizer, 2)
    ids = ids.label_token_ids
    for mode in ("all", "none", "lora"):
        tiny = tiny_causal_lm(seed=0, num_layers=2)
        rows = tiny.model.get_output_embeddings().weight[ids].detach().clone()
        config = TrainableConfig(mode=mode, lora_r=2, also_train=[] if mode != "none" else [r"^model\.norm\."])
        model, trainable = select_trainable(tiny.model, config, ids)  # the ids alone add nothing
        assert label_head_rows(unwrap(model)) is None
        assert not any(LABEL_HEAD in n for n, _ in model.named_parameters())
        tiny = tiny_causal_lm(seed=0, num_layers=2)
        model, trainable = select_trainable(tiny.model, config.model_copy(update={"label_head": True}), ids)
        head = [n for n, _ in model.named_parameters() if LABEL_HEAD in n]
        assert len(head) == 1 and head[0] in trainable.names, mode
        assert torch.equal(label_head_rows(unwrap(model)), rows)  # it starts as the zero-shot rows
    tiny = tiny_causal_lm(seed=0, num_layers=2)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode="none", label_head=True,
                                                                    label_head_per_class=True), ids)
    assert trainable.names == [f"{LABEL_HEAD}.0", f"{LABEL_HEAD}.1"]
    with pytest.raises(ValueError, match="already has a label head"):
        select_trainable(model, TrainableConfig(mode="none", label_head=True), ids)


@pytest.mark.parametrize("label_head", [False, True])
def test_a_run_s_model_has_a_head_exactly_when_its_config_asks(tiny_workspace, tmp_path, label_head):
    from zofed.run.setup import build_model

    config = tiny_federated_config(tiny_workspace, tmp_path / "run", "trainable.mode=none" if label_head else
                                   "trainable.mode=lora", f"trainable.label_head={str(label_head).lower()}")
    model, trainable, _ = build_model(config, 2, torch.device("cpu"))
    assert (label_head_rows(unwrap(model)) is not None) == label_head
    assert any(LABEL_HEAD in n for n in trainable.names) == label_head
