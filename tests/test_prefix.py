"""Frozen-prefix caching: the perturbed passes run only the trainable top blocks and give the full loss."""

import numpy as np
import pytest
import torch
from toy_federation import WORDS

from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm
from zofed.zo.optim import MeZO
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.prefix import PrefixCache, first_trainable_layer, forward_equivalents
from zofed.zo.step import zo_step

TOP_GAINS = [r"layers\.[23]\..*norm\.weight$", r"^model\.norm\.weight$"]


def _setup(patterns=TOP_GAINS, mode="patterns"):
    tiny = tiny_causal_lm(seed=0, num_layers=4)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode=mode, patterns=patterns, lora_r=2))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=24)
    texts = [f"the movie was {WORDS[2 * (1 - y) + int(rng.integers(2))]} " + "w1 " * int(rng.integers(0, 5))
             for y in labels]  # rows of different lengths: the attention mask matters
    data = TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")
    task = make_task(TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"]), tiny.tokenizer, 2)
    batch = task.collate(task.encode(data), list(range(24)))
    return model, trainable, task, batch


def test_the_cached_loss_is_the_full_loss_at_perturbed_weights():
    model, trainable, task, batch = _setup()
    start = first_trainable_layer(model, trainable.names)
    assert start == 2
    cache = PrefixCache(model, start)
    cached = task.cached_loss(model, cache, batch)
    for seed in range(3):
        add_directions_(trainable.tensors(), [(seed, 0.05)], Perturbation())
        assert cached() == pytest.approx(task.loss(model, batch), abs=1e-6)  # the top block at the last token


def test_the_top_llama_block_at_the_last_tokens_alone_gives_the_whole_blocks_rows_there():
    """Queries at each right-padded row's last token, keys and values at all of its tokens, grouped key-value heads
    and LoRA on q and v: the rows the whole block gives at those positions, within float rounding."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from zofed.models.last_position import block_at_last_position, supports_last_position

    model, trainable, task, batch = _setup(mode="lora")
    add_directions_(trainable.tensors(), [(7, 0.5)], Perturbation())  # B moves off zero: LoRA changes q and v
    cache = PrefixCache(model, 3)
    prefix = cache.capture(batch.input_ids, batch.attention_mask)
    top = cache.layers[3]
    assert supports_last_position(top) and top.self_attn.num_key_value_groups == 2
    last = batch.attention_mask.sum(1) - 1
    assert len(set(last.tolist())) > 1  # rows of several lengths
    rows = torch.arange(len(last))
    with torch.no_grad():
        whole = top(prefix.args[0], **prefix.kwargs)[rows, last]
        alone = block_at_last_position(top, prefix.args[0], last, prefix.kwargs["position_embeddings"])
        assert torch.allclose(alone, whole, atol=1e-5, rtol=1e-5)
        split = cache.last_hidden(prefix, batch.attention_mask)
        assert torch.allclose(split, cache.hidden(prefix)[rows, last], atol=1e-5, rtol=1e-5)
    assert not supports_last_position(BertLayer(BertConfig(hidden_size=32, num_attention_heads=4,
                                                           intermediate_size=64)))
    top.self_attn.attention_dropout = 0.1  # dropout in effect: the block runs whole
    assert not supports_last_position(top.train())


def test_a_pass_reuses_the_outputs_of_blocks_whose_trainable_tensors_kept_their_bits():
    """With the trainable tensors named, the cached loss runs only the blocks from the lowest one a perturbation
    touched (none when only the final norm moved), and gives the loss a fresh cache gives, bit for bit."""
    patterns = [r"layers\.[23]\..*norm\.weight$", r"^model\.norm\.weight$"]
    model, trainable, task, batch = _setup(patterns=patterns)
    watched = list(zip(trainable.names, trainable.params, strict=True))
    reusing = task.cached_loss(model, PrefixCache(model, 2, trainable=watched), batch)
    calls = []
    model.model.layers[2].register_forward_pre_hook(lambda *args: calls.append(2))
    by_name = dict(zip(trainable.names, trainable.tensors(), strict=True))
    lowest = [n for n in trainable.names if "layers.2." in n][0]
    reusing()  # the first pass runs every block
    for name, ran in [("model.norm.weight", 0), (lowest, 1), ("model.norm.weight", 0), (lowest, 1), (None, 0)]:
        calls.clear()
        if name is not None:
            by_name[name].add_(0.05 * torch.randn(by_name[name].shape, generator=torch.Generator().manual_seed(len(
                name))))
        value = reusing()
        assert len(calls) == ran
        assert value == task.cached_loss(model, PrefixCache(model, 2), batch)()


def test_a_pass_that_changes_only_the_top_blocks_mlp_side_reuses_its_attention():
    """The top block's keys and values (all positions) run again only when its input norm or attention changed;
    a pass that moved only its post-attention norm runs the MLP side alone and gives a fresh cache's bits."""
    model, trainable, task, batch = _setup(patterns=[r"layers\.3\..*norm\.weight$"])
    watched = list(zip(trainable.names, trainable.params, strict=True))
    reusing = task.cached_loss(model, PrefixCache(model, 3, trainable=watched), batch)
    keys, mlps = [], []
    model.model.layers[3].self_attn.k_proj.register_forward_pre_hook(lambda *args: keys.append(1))
    model.model.layers[3].mlp.register_forward_pre_hook(lambda *args: mlps.append(1))
    by_name = dict(zip(trainable.names, trainable.tensors(), strict=True))
    after, before = "model.layers.3.post_attention_layernorm.weight", "model.layers.3.input_layernorm.weight"
    reusing()
    for i, (name, attended) in enumerate([(after, 0), (after, 0), (before, 1), (after, 0), (before, 1)]):
        keys.clear(), mlps.clear()
        by_name[name].mul_(1 + 0.1 * torch.randn(by_name[name].shape, generator=torch.Generator().manual_seed(i)))
        value = reusing()
        assert (len(keys), len(mlps)) == (attended, 1)
        assert value == task.cached_loss(model, PrefixCache(model, 3), batch)()


def test_a_zo_step_on_the_cached_loss_is_the_step_on_the_full_loss():
    runs = []
    for use_cache in (False, True):
        model, trainable, task, batch = _setup()
        tensors = trainable.tensors()
        loss = task.cached_loss(model, PrefixCache(model, 2), batch) if use_cache else (
            lambda task=task, model=model, batch=batch: task.loss(model, batch))
        state = MeZO().init(tensors)
        records = []
        for seed in range(3):
            state, record = zo_step(tensors, loss, MeZO(), state, seed=seed, eps=1e-2, lr=1e-2)
            records.append(record.grads)
        runs.append((records, [t.clone() for t in tensors]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_where_a_model_can_be_split_and_what_a_step_costs():
    model, trainable, _, _ = _setup(patterns=[r"^model\.norm\.weight$"])
    assert first_trainable_layer(model, trainable.names) == 4  # only the final norm: every block is frozen
    assert PrefixCache(model, 4).fraction == 0.0
    model, trainable, _, _ = _setup(patterns=[r"embed_tokens", r"layers\.3\..*norm\.weight$"])
    assert first_trainable_layer(model, trainable.names) is None  # the embeddings sit below every block
    model, trainable, _, _ = _setup(mode="lora")  # LoRA on every block's q and v
    assert first_trainable_layer(model, trainable.names) == 0
    assert forward_equivalents(0.25, 4) == pytest.approx(0.75 + 2.0)  # 2.75 instead of 8
    assert forward_equivalents(1.0, 1) == 2.0
    with pytest.raises(ValueError, match="4 blocks"):
        PrefixCache(model, 5)


def test_the_cached_loss_with_only_the_final_norm_trainable_matches_too():
    model, trainable, task, batch = _setup(patterns=[r"^model\.norm\.weight$"])
    cached = task.cached_loss(model, PrefixCache(model, 4), batch)
    add_directions_(trainable.tensors(), [(3, 0.1)], Perturbation())
    assert cached() == task.loss(model, batch)


def test_a_federated_and_a_centralized_run_with_the_cache_end_where_they_do_without_it(tiny_workspace, tmp_path):
    """The cached loss is the full loss (on this tiny model to the bit, the top block's last-token shortcut
    included), so a run with `zo.cache: prefix`, each step capturing its own batch, ends bit-identical to one
    without; it is charged (1 - f) + 2 q f forward passes a step instead of 2 q (here f = 1/2: the top block of
    two)."""
    from safetensors.torch import load_file
    from toy_federation import tiny_federated_config

    from zofed.run.config import FinetuneConfig, load_config
    from zofed.run.federated import run_federated
    from zofed.run.finetune import finetune

    top = ["trainable.mode=patterns", "trainable.patterns=['layers\\.1\\..*norm\\.weight$']",
           "federation.method=zo-seeds"]
    results = {}
    for cached in (False, True):
        out = tmp_path / f"fed-{cached}"
        results[cached] = run_federated(tiny_federated_config(tiny_workspace, out, *top,
                                                              f"zo.cache={'prefix' if cached else 'none'}",
                                                              *(["federation.cached_examples=0"] if cached else [])),
                                        show_progress=False)
        results[cached]["final"] = load_file(str(out / "final" / "trainable.safetensors"))
    assert all(torch.equal(results[False]["final"][k], results[True]["final"][k]) for k in results[True]["final"])
    assert results[False]["forward_passes_per_client_round"] == 2 * 2  # 2 local steps of 2 passes
    assert results[True]["forward_passes_per_client_round"] == 2 * (0.5 + 2 * 0.5)

    base = [f"model.name={tiny_workspace / 'model'}", f"data.source={tiny_workspace / 'train.jsonl'}",
            f"data.test_source={tiny_workspace / 'test.jsonl'}", "task.template='review : {text} . sentiment :'",
            "task.verbalizer=[negative, positive]", "train.steps=4", "train.batch_size=8", "zo.eps=0.01",
            "optimizer.lr=0.02", "trainable.mode=patterns", "trainable.patterns=['layers\\.1\\..*norm\\.weight$']"]
    central = {}
    for cached in (False, True):
        config = load_config(None, [*base, f"out_dir={tmp_path / f'c-{cached}'}",
                                    f"zo.cache={'prefix' if cached else 'none'}"], schema=FinetuneConfig)
        central[cached] = finetune(config, show_progress=False)
    assert central[False]["test"] == central[True]["test"]
    assert (central[False]["forward_passes"], central[True]["forward_passes"]) == (4 * 2, 4 * 1.5)


def test_the_cache_is_refused_where_the_model_cannot_be_split(tiny_workspace, tmp_path):
    from toy_federation import tiny_federated_config

    from zofed.run.config import ConfigError
    from zofed.run.federated import run_federated

    with pytest.raises(ConfigError, match="none in the embeddings"):
        run_federated(tiny_federated_config(tiny_workspace, tmp_path / "x", "trainable.mode=patterns",
                                            "trainable.patterns=[embed_tokens]", "zo.cache=prefix"),
                      show_progress=False)


def test_the_causal_lm_loss_on_a_cache_below_top_block_lora_is_the_full_loss():
    tiny = tiny_causal_lm(seed=0, num_layers=4)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode="lora", lora_r=2, lora_layers=[-2, 3]))
    assert {name.split(".layers.")[1].split(".")[0] for name in trainable.names} == {"2", "3"}
    start = first_trainable_layer(model, trainable.names)
    assert start == 2
    task = make_task(TaskConfig(type="causal-lm", prompt_format="template"), tiny.tokenizer, None)
    records = [{"instruction": f"w{i} is", "context": "", "response": "w3 " * (1 + i % 4)} for i in range(6)]
    data = task.encode(TextDataset(records, None, None, "toy"))
    batch = task.collate(data, list(range(6)))
    cache = PrefixCache(model, start, output_layer=task.full_vocabulary)
    # a cached pass runs blocks 2 and 3 and the vocabulary projection: its share of the weights, not of the blocks
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in model.get_base_model().model.layers]
    head = model.get_base_model().lm_head.weight.numel()
    assert cache.fraction == pytest.approx((blocks[2] + blocks[3] + head) / (sum(blocks) + head))
    assert cache.fraction > 0.5 == PrefixCache(model, start).fraction
    cached = task.cached_loss(model, cache, batch)
    for seed in range(3):  # LoRA's B starts at zero: perturbed, every adapter changes the loss
        add_directions_(trainable.tensors(), [(seed, 0.05)], Perturbation())
        assert cached() == task.loss(model, batch)
    with pytest.raises(ValueError, match="logit shift"):
        task.cached_loss(model, PrefixCache(model, start), batch, torch.zeros(2))


def test_lora_layers_out_of_range_are_refused():
    from zofed.models.catalog import ModelLoadError

    with pytest.raises(ValueError, match="trainable.mode is patterns"):
        TrainableConfig(mode="patterns", lora_layers=[-1])
    with pytest.raises(ModelLoadError, match=r"has 4 blocks.*\[-4, 3\]"):
        select_trainable(tiny_causal_lm(seed=0, num_layers=4).model,
                         TrainableConfig(mode="lora", lora_r=2, lora_layers=[4]))
