"""The label head: a prompt-classification task's own trainable copy of the verbalizer's output rows."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import WORDS, tiny_federated_config

from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.catalog import ModelLoadError
from zofed.models.selection import LABEL_HEAD, TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm
from zofed.zo.optim import MeZO
from zofed.zo.prefix import PrefixCache, first_trainable_layer, forward_equivalents
from zofed.zo.step import zo_step


def _toy(mode="none", label_head=True, patterns=()):
    tiny = tiny_causal_lm(seed=0, num_layers=3)
    task = make_task(TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"]), tiny.tokenizer, 2)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode=mode, patterns=list(patterns),
                                                                    label_head=label_head), task.label_token_ids)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=32)
    texts = [f"the movie was {WORDS[2 * (1 - y) + int(rng.integers(2))]} " + "w1 " * int(rng.integers(0, 4))
             for y in labels]
    data = TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")
    return tiny, model, trainable, task, task.collate(task.encode(data), list(range(32)))


def test_the_head_starts_as_the_zero_shot_classifier_and_is_all_that_moves():
    _, model, trainable, task, batch = _toy()
    assert trainable.names == [LABEL_HEAD]
    hidden = model.config.hidden_size
    assert trainable.numel() == 2 * hidden
    rows = model.get_output_embeddings().weight[task.label_token_ids]
    assert torch.equal(getattr(model, LABEL_HEAD), rows)  # a copy of the rows the logits read without it
    plain = tiny_causal_lm(seed=0, num_layers=3).model  # the same model without a head: the same logits
    assert torch.equal(task.logits(model, batch), task.logits(plain, batch))
    embedding_before = model.get_input_embeddings().weight.clone()
    tensors = trainable.tensors()
    state = MeZO().init(tensors)
    for seed in range(4):
        state, _ = zo_step(tensors, lambda: task.loss(model, batch), MeZO(), state, seed=seed, eps=1e-2, lr=0.5)
    assert not torch.equal(getattr(model, LABEL_HEAD), rows)  # the head moved...
    assert torch.equal(model.get_input_embeddings().weight, embedding_before)  # ... the tied embedding did not


def test_the_logits_read_the_head_so_moving_it_changes_the_loss():
    _, model, trainable, task, batch = _toy()
    before = task.loss(model, batch)
    with torch.no_grad():
        getattr(model, LABEL_HEAD)[1] += 0.5 * getattr(model, LABEL_HEAD)[0]
    assert task.loss(model, batch) != before


def test_a_head_alone_caches_the_whole_backbone_and_a_step_costs_one_pass_whatever_the_queries():
    _, model, trainable, task, batch = _toy()
    start = first_trainable_layer(model, trainable.names)
    assert start == 3  # above every block: the perturbed passes run only the final norm and the head
    cache = PrefixCache(model, start)
    assert cache.fraction == 0.0
    assert forward_equivalents(cache.fraction, 16) == 1.0
    cached = task.cached_loss(model, cache, batch)
    with torch.no_grad():
        getattr(model, LABEL_HEAD).mul_(1.5)
    assert cached() == task.loss(model, batch)


def test_the_head_adds_to_a_pattern_selection_and_to_lora():
    _, _, trainable, _, _ = _toy(mode="patterns", patterns=[r"^model\.norm\.weight$"])
    assert trainable.names == ["model.norm.weight", LABEL_HEAD]
    _, _, trainable, _, _ = _toy(mode="lora")
    assert trainable.names[-1].endswith(LABEL_HEAD) and any("lora_" in n for n in trainable.names)


def test_mode_none_without_a_head_and_a_head_without_a_verbalizer_are_refused():
    tiny = tiny_causal_lm(seed=0, num_layers=2)
    with pytest.raises(ModelLoadError, match="selects nothing"):
        select_trainable(tiny.model, TrainableConfig(mode="none"))
    with pytest.raises(ModelLoadError, match="prompt-classification"):  # no task attached a head
        select_trainable(tiny_causal_lm(seed=0, num_layers=2).model, TrainableConfig(mode="none", label_head=True))


def test_a_federated_run_trains_saves_and_reloads_the_head(tiny_workspace, tmp_path):
    """Clients move only the head; the server rebuilds it exactly (the final tensors are what `zofed eval`
    loads back), and a step costs one pass with the backbone cached."""
    from zofed.run.federated import run_federated
    from zofed.run.setup import load_run

    out = tmp_path / "head"
    config = tiny_federated_config(tiny_workspace, out, "trainable.mode=none", "trainable.label_head=true",
                                   "zo.cache=prefix", "federation.cached_examples=0", "zo.queries=8",
                                   "optimizer.lr=0.5")  # each step runs its own batch through the backbone
    results = run_federated(config, show_progress=False)
    assert results["forward_passes_per_client_round"] == 2 * 1.0  # 2 local steps, 8 queries each, 1 pass a step
    final = load_file(str(out / "final" / "trainable.safetensors"))
    assert list(final) == [LABEL_HEAD]
    setup = load_run(out)
    assert torch.equal(getattr(setup.model, LABEL_HEAD), final[LABEL_HEAD])
    fresh = make_task(config.task, setup.task.tokenizer, 2)
    start = setup.model.get_output_embeddings().weight[fresh.label_token_ids]
    assert not torch.equal(final[LABEL_HEAD], start)  # it trained
    again = setup.task.evaluate(setup.model, setup.test, 32)
    assert again["accuracy"] == pytest.approx(results["test"]["accuracy"])


def test_a_head_for_an_encoder_task_is_a_config_error(tiny_workspace, tmp_path):
    from zofed.run.config import ConfigError
    from zofed.run.federated import run_federated

    config = tiny_federated_config(tiny_workspace, tmp_path / "x", "trainable.label_head=true",
                                   "task.type=causal-lm")
    with pytest.raises(ConfigError, match="label_head"):
        run_federated(config, show_progress=False)


def test_a_per_class_head_is_one_block_a_class_with_the_same_logits(tiny_workspace, tmp_path):
    from zofed.fl.personal import tensor_blocks
    from zofed.run.federated import run_federated
    from zofed.run.setup import load_run

    _, one_model, _, task, batch = _toy()
    tiny = tiny_causal_lm(seed=0, num_layers=3)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode="none", label_head=True,
                                                                    label_head_per_class=True), task.label_token_ids)
    assert trainable.names == [f"{LABEL_HEAD}.0", f"{LABEL_HEAD}.1"]
    assert [p.shape for p in trainable.params] == [(model.config.hidden_size,)] * 2
    assert torch.equal(task.logits(model, batch), task.logits(one_model, batch))  # both start at zero-shot
    assert tensor_blocks(trainable.params).tolist() == [0, 1]  # zofed's sampling chooses among the classes
    with pytest.raises(ValueError, match="label_head=true"):
        TrainableConfig(label_head_per_class=True)

    out = tmp_path / "run"
    run_federated(tiny_federated_config(tiny_workspace, out, "trainable.mode=none", "trainable.label_head=true",
                                        "trainable.label_head_per_class=true", "optimizer.lr=0.01"))
    final = load_file(str(out / "final" / "trainable.safetensors"))
    assert sorted(final) == [f"{LABEL_HEAD}.0", f"{LABEL_HEAD}.1"]
    setup = load_run(out)
    start = setup.model.get_output_embeddings().weight[setup.task.label_token_ids]
    assert all(not torch.equal(final[f"{LABEL_HEAD}.{k}"], start[k]) for k in range(2))  # both rows moved
    from transformers import AutoModelForCausalLM

    from zofed.run.export import export_run

    export_run(out, tmp_path / "hf")  # the rows fold back into one untied output embedding
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    test = setup.task.collate(setup.test, list(range(8)))
    with torch.no_grad():
        logits = plain(input_ids=test.input_ids, attention_mask=test.attention_mask).logits
    last = test.attention_mask.sum(1) - 1
    words = logits[torch.arange(len(last)), last][:, setup.task.label_token_ids]
    assert torch.allclose(words, setup.task.logits(setup.model, test), atol=1e-5)


def test_top_norms_add_the_top_blocks_norm_gains_and_the_final_norm_and_the_split_sits_below_them():
    tiny = tiny_causal_lm(num_layers=4)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode="none", label_head=True, top_norms=1),
                                        [5, 6])
    assert trainable.names == ["model.layers.3.input_layernorm.weight",
                               "model.layers.3.post_attention_layernorm.weight", "model.norm.weight", LABEL_HEAD]
    assert first_trainable_layer(model, trainable.names) == 3
    _, two = select_trainable(tiny_causal_lm(num_layers=4).model, TrainableConfig(mode="none", top_norms=2))
    assert [n.split(".")[2] for n in two.names[:4]] == ["2", "2", "3", "3"] and two.names[4] == "model.norm.weight"
    with pytest.raises(ModelLoadError, match="top_norms 5: this model has 4 blocks"):
        select_trainable(tiny_causal_lm(num_layers=4).model, TrainableConfig(mode="none", top_norms=5))
