"""The packaged built-in models load with the hub switched off and take real ZO steps."""

import pytest
import torch

from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.registry import load_model
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.zo.optim import make_optimizer
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.step import zo_step

pytestmark = pytest.mark.integration
TWEETS = TextDataset([{"text": t} for t in ["I love this car, so smooth", "worst traffic ever, I hate it",
                                             "the bus arrives at noon", "this phone is great"]],
                     [2, 0, 1, 2], ["negative", "neutral", "positive"], "tweets-sample")


@pytest.fixture
def smollm2(smollm2_cache, monkeypatch, all_threads):
    monkeypatch.setenv("ZOFED_CACHE", str(smollm2_cache))
    return load_model("smollm2-135m")


def _prompt_task(tokenizer):
    config = TaskConfig(template="Tweet: {text}\nSentiment:", verbalizer=[" negative", " neutral", " positive"])
    return make_task(config, tokenizer, 3)


def test_smollm2_lora_takes_a_zo_step(smollm2):
    model, trainable = select_trainable(smollm2.model, TrainableConfig(mode="lora"))
    task = _prompt_task(smollm2.tokenizer)
    batch = task.collate(task.encode(TWEETS), [0, 1, 2, 3])
    lora_b = [p for n, p in zip(trainable.names, trainable.params, strict=True) if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) == 0.0 for p in lora_b)  # LoRA starts as the identity
    opt = make_optimizer("mezo")
    state, record = zo_step(trainable.tensors(), lambda: task.loss(model, batch), opt, opt.init(trainable.tensors()),
                            seed=3, eps=1e-2, lr=1e-3)
    assert record.grads[0] != 0.0 and torch.isfinite(torch.tensor(record.loss))
    assert any(float(p.abs().max()) > 0.0 for p in lora_b)  # the update moved the adapters
    assert all(p.grad is None for p in model.parameters())


def test_smollm2_all_parameters_perturb_and_restore_exactly(smollm2):
    model, trainable = select_trainable(smollm2.model, TrainableConfig(mode="all"))
    assert trainable.numel() == 134_515_008
    tensors = trainable.tensors()
    probe = [t[:1000].clone() for t in tensors]
    task = _prompt_task(smollm2.tokenizer)
    batch = task.collate(task.encode(TWEETS), [0, 1, 2, 3])
    before = task.loss(model, batch)
    add_directions_(tensors, [(7, 1e-3)], Perturbation())
    moved = task.loss(model, batch)
    add_directions_(tensors, [(7, -1e-3)], Perturbation())
    assert moved != before
    assert max(float((t[:1000] - p).abs().max()) for t, p in zip(tensors, probe, strict=True)) <= 1e-6
    assert abs(task.loss(model, batch) - before) < 1e-4


def test_minilm_encoder_takes_a_zo_step(all_threads):
    loaded = load_model("minilm-l6", kind="encoder", num_labels=3)
    # The fresh head is the same on every load (federated parties, reruns) and leaves the global RNG alone.
    rng_before = torch.random.get_rng_state()
    again = load_model("minilm-l6", kind="encoder", num_labels=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.equal(loaded.model.classifier.weight, again.model.classifier.weight)
    other = load_model("minilm-l6", kind="encoder", num_labels=3, head_seed=1)
    assert not torch.equal(loaded.model.classifier.weight, other.model.classifier.weight)
    model, trainable = select_trainable(loaded.model, TrainableConfig(mode="all"))
    task = make_task(TaskConfig(type="encoder-classification"), loaded.tokenizer, 3)
    batch = task.collate(task.encode(TWEETS), [0, 1, 2, 3])
    start = [t.clone() for t in trainable.tensors()]
    opt = make_optimizer("zo-adam")
    state, record = zo_step(trainable.tensors(), lambda: task.loss(model, batch), opt, opt.init(start),
                            seed=1, eps=1e-3, lr=1e-4)
    assert state.step == 1 and record.grads[0] != 0.0
    assert any(not torch.equal(t, s) for t, s in zip(trainable.tensors(), start, strict=True))
