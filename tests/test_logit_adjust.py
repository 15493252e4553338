"""Logit adjustment against label skew: each client's training loss reads its logits shifted by its own prior."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy_federation import tiny_federated_config, toy_context

from zofed.data.tasks import label_shift
from zofed.fl.methods.first_order import run_first_order_client
from zofed.fl.plan import LocalTraining
from zofed.run.config import ConfigError
from zofed.run.federated_config import federation_plan
from zofed.zo.prefix import PrefixCache, first_trainable_layer

TOP = [r"layers\.1\..*norm\.weight$", r"^model\.norm\.weight$"]


def test_the_shift_is_the_strength_times_the_log_of_add_one_frequencies():
    shift = label_shift(np.array([0, 0, 0, 1]), 3, 2.0)
    expected = [2 * math.log(4 / 7), 2 * math.log(2 / 7), 2 * math.log(1 / 7)]
    assert torch.allclose(shift, torch.tensor(expected))
    with pytest.raises(ValueError, match="span classes 0..3, but the task has 3 classes"):
        label_shift(np.array([0, 3]), 3, 1.0)
    with pytest.raises(ValueError, match="span classes -1..1"):
        label_shift(np.array([-1, 1]), 3, 1.0)


def test_the_shifted_loss_is_cross_entropy_of_shifted_logits_cached_or_not():
    ctx = toy_context(patterns=TOP)
    batch = ctx.task.collate(ctx.train, list(range(16)))
    shift = torch.tensor([0.7, -1.3])
    with torch.no_grad():
        expected = float(F.cross_entropy(ctx.task.logits(ctx.model, batch) + shift, batch.labels))
    assert ctx.task.loss(ctx.model, batch, shift) == pytest.approx(expected, abs=1e-6)
    assert ctx.task.loss(ctx.model, batch, shift) != pytest.approx(ctx.task.loss(ctx.model, batch), abs=1e-3)
    cache = PrefixCache(ctx.model, first_trainable_layer(ctx.model, ctx.trainable.names))
    assert ctx.task.cached_loss(ctx.model, cache, batch, shift)() == pytest.approx(expected, abs=1e-6)


def _margin_gain(strength: float) -> float:
    """How far a client holding only positive examples raises the positive-minus-negative logit margin on a
    balanced batch, after local first-order SGD from the same start."""
    ctx = toy_context(mode="lora")
    start = [t.clone() for t in ctx.trainable.tensors()]
    balanced = ctx.task.collate(ctx.train, list(range(60)))

    def margin() -> float:
        with torch.no_grad():
            logits = ctx.task.logits(ctx.model, balanced)
        return float((logits[:, 1] - logits[:, 0]).mean())

    before = margin()
    positives = np.flatnonzero(ctx.train.labels == 1)
    plan = LocalTraining("fedavg", 1, 0, local_steps=10, lr=0.01, eps=1e-2, batch_size=16, logit_adjust=strength)
    run_first_order_client(ctx, start, 0, positives, plan, local_optimizer="sgd")
    return margin() - before


def test_a_one_class_client_pushes_the_shared_model_towards_its_class_far_less_when_adjusted():
    plain, adjusted = _margin_gain(0.0), _margin_gain(1.0)
    assert plain > 0.3  # unadjusted, the client teaches the model its own prior
    assert 0 < adjusted < 0.2 * plain  # its gradient is ~30x smaller: the shift already explains the prior


def test_the_round_plan_carries_the_strength_and_a_causal_lm_run_refuses_it(tiny_workspace, tmp_path):
    config = tiny_federated_config(tiny_workspace, tmp_path / "run", "federation.logit_adjust=0.5")
    plan = federation_plan(config, num_clients=4)
    local = plan.round(0)
    assert local.logit_adjust == 0.5
    assert LocalTraining.from_config(local.to_config()).logit_adjust == 0.5  # what a Flower client decodes
    with pytest.raises(ConfigError, match="task.type causal-lm has no classes"):
        tiny_federated_config(tiny_workspace, tmp_path / "lm", "federation.logit_adjust=0.5", "task.type=causal-lm",
                              "task.template='{text}'", "task.verbalizer=[]")
    with pytest.raises(ConfigError, match="logit_adjust"):
        tiny_federated_config(tiny_workspace, tmp_path / "neg", "federation.logit_adjust=-1")
