"""The causal-lm losses run the vocabulary projection only at the positions they score (the response tokens) and
give the loss, the evaluation and the gradients that the projection of every position gives."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import TrainableConfig, select_trainable, unwrap
from zofed.models.tiny import tiny_causal_lm
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.prefix import PrefixCache, first_trainable_layer

# Prompts of different lengths, responses of 1-4 words; with max_length 12 the last prompt fills its row, so that row
# scores nothing, and padding sits after the shorter rows.
RECORDS = [{"instruction": "w1 " * (1 + i % 3) + "is", "context": "the movie" if i % 2 else "",
            "response": "w3 w4 " * (i % 2) + "good"} for i in range(5)]
RECORDS.append({"instruction": "w5 " * 12, "context": "", "response": "bad"})


KINDS = ["tied", "untied", "lora", "capped"]


def _untied(seed: int = 0) -> LlamaForCausalLM:
    config = copy.deepcopy(tiny_causal_lm(seed=seed, num_layers=4).model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _capped(seed: int = 0) -> Gemma2ForCausalLM:
    """A tiny Gemma 2, whose forward caps the logits after the projection (tightly here, so the cap matters)."""
    config = Gemma2Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                          final_logit_softcapping=2.0, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(config)


def _model(kind: str) -> tuple[torch.nn.Module, list[torch.nn.Parameter], int]:
    """The model, the tensors a first-order client would train, and the block a prefix cache may start at."""
    tiny = tiny_causal_lm(seed=0, num_layers=4)
    if kind == "lora":
        model, trainable = select_trainable(tiny.model, TrainableConfig(mode="lora", lora_r=2, lora_layers=[2, 3]))
        add_directions_(trainable.tensors(), [(7, 0.1)], Perturbation())  # LoRA's B starts at zero: make it count
        return model, trainable.params, first_trainable_layer(model, trainable.names)
    model = {"tied": lambda: tiny.model, "untied": _untied, "capped": _capped}[kind]()
    return model, list(model.parameters()), 2


def _task_and_batch():
    task = make_task(TaskConfig(type="causal-lm", prompt_format="template", template="{instruction} {context} :",
                                max_length=12), tiny_causal_lm().tokenizer, None)
    data = task.encode(TextDataset(RECORDS, None, None, "toy"))
    return task, data, task.collate(data, list(range(len(RECORDS))))


def _full_projection(model, batch, reduction="mean") -> torch.Tensor:
    """The loss as it was: logits at every position, the unscored ones ignored."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=-100,
                           reduction=reduction)


def test_the_batch_scores_some_positions_and_skips_a_whole_row():
    _, _, batch = _task_and_batch()
    scored = batch.labels[:, 1:] != -100
    assert 0 < int(scored.sum()) < scored.numel() // 3
    assert not scored[-1].any() and scored[:-1].any(dim=1).all()
    assert (batch.attention_mask == 0).any()


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_layer_runs_on_the_scored_positions_only(kind):
    model, _, start = _model(kind)
    task, _, batch = _task_and_batch()
    rows = []
    handle = unwrap(model).get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        task.loss(model, batch)
        task.cached_loss(model, PrefixCache(model, start, output_layer=True), batch)()
    finally:
        handle.remove()
    assert rows == [int((batch.labels[:, 1:] != -100).sum())] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_the_losses_and_the_evaluation_equal_the_full_projection(kind):
    model, _, start = _model(kind)
    task, data, batch = _task_and_batch()
    with torch.no_grad():
        reference = float(_full_projection(model, batch))
        total = 0.0
        for rows in ([0, 1, 2, 3], [4, 5]):  # evaluate's batches of 4: its sum over both, over its token count
            total += float(_full_projection(model, task.collate(data, rows), reduction="sum"))
        new = float(task.loss_tensor(model, batch))
    count = int((batch.labels[:, 1:] != -100).sum())
    assert new == pytest.approx(reference, rel=1e-6)
    assert task.cached_loss(model, PrefixCache(model, start, output_layer=True), batch)() == pytest.approx(
        reference, rel=1e-6)
    assert task.evaluate(model, data, batch_size=4)["loss"] == pytest.approx(total / count, rel=1e-6)
    assert total / count == pytest.approx(reference, rel=1e-6)  # the same mean, summed in two batches


@pytest.mark.parametrize("kind", KINDS)
def test_the_loss_tensor_gradients_equal_the_full_projection(kind):
    model, params, _ = _model(kind)
    task, _, batch = _task_and_batch()
    for p in params:
        p.requires_grad_(True)
    grads = []
    for loss in (lambda: task.loss_tensor(model, batch), lambda: _full_projection(model, batch)):
        grads.append(torch.autograd.grad(loss(), params))
    assert any(float(g.abs().max()) > 0 for g in grads[0])
    for new, old in zip(*grads, strict=True):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-7)
