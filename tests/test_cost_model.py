"""The client-compute rule (fl/cost.py): one count in full forward passes for ZO and first-order clients, and
FedAvg's clients stepping the label head on cached features."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import recompute_features, tiny_federated_config, toy_context

from zofed.fl.client import ClientContext
from zofed.fl.cost import first_order_step, head_step, round_passes, step_passes
from zofed.fl.methods import get_method
from zofed.fl.methods.first_order import run_first_order_client
from zofed.fl.plan import LocalTraining
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm, tiny_encoder
from zofed.run.config import ConfigError
from zofed.run.federated import prepare_run, run_federated
from zofed.zo.prefix import PrefixCache, backward_fraction, first_trainable_layer, head_fraction

# The tiny Llama (hidden 32, 2 blocks): a block holds q 32x32, k and v 32x16, o 32x32, gate and up 32x64, down
# 64x32 and two norms of 32, so 9,280 weights; the label head of 2 classes runs the final norm and 2 rows.
TINY_BLOCK = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
TINY_HEAD = 32 * (2 + 1) / (2 * TINY_BLOCK + 32 * 2)
HEAD_RUN = ("federation.recipe=head", "trainable.mode=none")  # the fixture's config picks LoRA; the recipe keeps it


def _local(**settings) -> LocalTraining:
    return LocalTraining("fedavg", run_seed=0, round_id=0, local_steps=48, lr=0.1, eps=1e-3, **settings)


def _patterns(num_layers: int, blocks: range) -> tuple[torch.nn.Module, list[str]]:
    model = tiny_causal_lm(num_layers=num_layers).model
    chosen = "|".join(str(b) for b in blocks)
    _, trainable = select_trainable(model, TrainableConfig(mode="patterns",
                                                           patterns=[rf"layers\.({chosen})\..*norm\.weight$"]))
    return model, trainable.names


def test_a_first_order_step_is_a_forward_and_a_backward_through_what_trains():
    lora = toy_context(mode="lora")  # adapters on q and v of every block: the backward runs the whole model
    assert backward_fraction(lora.model, lora.trainable.names) == 1.0
    assert round_passes(_local(backward_fraction=1.0), first_order=True) == 48 * 3.0
    model, names = _patterns(30, range(26, 30))  # the top 4 blocks' norms
    assert first_trainable_layer(model, names) == 26
    assert backward_fraction(model, names) == pytest.approx(4 / 30)
    assert first_order_step(backward_fraction(model, names)) == pytest.approx(1 + 8 / 30)
    # the vocabulary projection counts where a causal LM's loss reads it
    with_vocab = backward_fraction(model, names, output_layer=True)
    assert with_vocab == pytest.approx(PrefixCache(model, 26, output_layer=True).fraction) and with_vocab > 4 / 30
    # anything in the embeddings, or a model that cannot be split, back-propagates through the whole of it
    everything = toy_context(mode="all")
    assert any("embed" in n for n in everything.trainable.names)
    assert backward_fraction(everything.model, everything.trainable.names) == 1.0
    encoder = tiny_encoder().model
    assert backward_fraction(encoder, [n for n, _ in encoder.named_parameters()]) == 1.0
    assert head_fraction(encoder, 2) == 0.0


def test_the_label_head_s_share_is_its_multiply_adds_at_one_position():
    ctx = toy_context()
    assert head_fraction(ctx.model, 2) == pytest.approx(TINY_HEAD)
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="none", label_head=True),
                                        ctx.task.label_token_ids)
    # every block frozen: back-propagation runs the final norm and the label rows alone
    assert backward_fraction(model, trainable.names, output_layer=False, num_classes=2) == pytest.approx(TINY_HEAD)
    deeper = tiny_causal_lm(num_layers=30).model
    assert head_fraction(deeper, 4) == pytest.approx(32 * 5 / (30 * TINY_BLOCK + 32 * 4))


def test_steps_on_cached_features_cost_their_head_for_zo_and_first_order_alike():
    head = 3e-5
    cached = _local(feature_cache=8, batch_size=8, queries=8, estimator="forward", head_fraction=head,
                    pass_fraction=0.0, backward_fraction=head)
    zo = round_passes(cached, first_order=False)
    assert zo == pytest.approx(8 / 8 + 48 * (8 + 1) * head)  # the body once, then 9 head passes a step
    assert round_passes(replace(cached, estimator="central"), first_order=False) == pytest.approx(1 + 48 * 16 * head)
    assert round_passes(cached, first_order=True) == pytest.approx(1 + 48 * 3 * head)
    assert step_passes(cached, True) == head_step(head, True, 8, "forward") == pytest.approx(3 * head)
    assert round_passes(replace(cached, feature_cache=20), first_order=True) == pytest.approx(20 / 8 + 144 * head)
    # every method counts by the rule, ZO and first-order alike
    assert get_method("zofed").forward_passes(cached) == zo
    assert get_method("fedavg").forward_passes(cached) == get_method("fedadam").forward_passes(cached)
    assert get_method("fedavg").forward_passes(cached) == pytest.approx(1 + 144 * head)
    # a plan round-trips the shares through the downlink's config (the Flower backend's path)
    assert LocalTraining.from_config(cached.to_config()) == cached


def test_a_first_order_client_steps_the_head_on_the_round_s_cached_features():
    ctx = toy_context()
    model, trainable = select_trainable(ctx.model, TrainableConfig(mode="none", label_head=True),
                                        ctx.task.label_token_ids)
    ctx = ClientContext(model, trainable, ctx.task, ctx.train)
    cache = PrefixCache(model, first_trainable_layer(model, trainable.names))
    local = LocalTraining("fedavg", run_seed=3, round_id=0, local_steps=30, lr=0.05, eps=1e-3, batch_size=8,
                          pass_fraction=cache.fraction, feature_cache=24)
    start = [t.clone() for t in trainable.tensors()]
    rows = np.arange(0, 120, 2)
    blocks = []  # examples that go through the blocks
    cache.backbone.register_forward_pre_hook(lambda m, args, kwargs: blocks.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)
    update, final = run_first_order_client(ctx, start, 0, rows, local, "sgd")
    assert sum(blocks) == 24  # the round's cached examples ran the body once; the 30 steps ran the head alone
    assert not torch.equal(final[0], start[0]) and torch.allclose(torch.from_numpy(update.dense),
                                                                  (final[0] - start[0]).reshape(-1))
    assert all(not p.requires_grad and p.grad is None for p in trainable.params)
    with torch.no_grad():  # the head it learned fits the client's examples better than the start
        def loss(head):
            trainable.tensors()[0].copy_(head)
            return ctx.task.loss(model, ctx.task.collate(ctx.train, rows))
        assert loss(final[0]) < loss(start[0])


def _records(out) -> tuple[dict, list[dict]]:
    """A run's evaluation of its starting model and its rounds' records."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return records[0], [r for r in records if r["event"] == "round"]


def test_fedavg_on_cached_features_with_the_head_recipe_moves_the_head_and_reports_the_rule(tiny_workspace, tmp_path):
    fedavg = (*HEAD_RUN, "federation.method=fedavg", "federation.first_order_optimizer=sgd",
              "federation.first_order_lr=0.1", "federation.local_steps=12", "federation.rounds=4",
              "federation.eval_every=1")
    plan = prepare_run(tiny_federated_config(tiny_workspace, tmp_path / "plan", *fedavg)).server
    start = plan.tensors[0].clone()
    local = plan.round_plan(0)
    assert (local.feature_cache, local.batch_size, local.pass_fraction, local.scalar_bits) == (8, 8, 0.0, 16)
    assert local.head_fraction == pytest.approx(TINY_HEAD) and local.backward_fraction == pytest.approx(TINY_HEAD)
    out = tmp_path / "fedavg-head"
    results = run_federated(tiny_federated_config(tiny_workspace, out, *fedavg), show_progress=False)
    # 8 cached examples in one batch of 8, then 12 steps of a forward and a backward over the head
    per_client = 8 / 8 + 12 * 3 * TINY_HEAD
    assert results["forward_passes_per_client_round"] == pytest.approx(per_client)
    assert results["forward_passes"] == pytest.approx(4 * 2 * per_client)
    begin, rounds = _records(out)
    assert [r["forward_passes"] for r in rounds] == pytest.approx([(k + 1) * 2 * per_client for k in range(4)])
    # on the toy federation (2 of 4 skewed clients a round) the eval loss bounces round to round; that a client's
    # steps lower its own loss is the client test's (above)
    assert all(np.isfinite(r["eval_loss"]) for r in [begin, *rounds])
    head = load_file(str(out / "final" / "trainable.safetensors"))
    assert list(head) == ["label_head"] and not torch.allclose(head["label_head"].reshape(-1), start)
    # the dense head goes up as float32 whatever scalar_bits says (it narrows ZO scalars only)
    assert results["bytes_up_per_client_round"] > 2 * 32 * 4


@pytest.mark.parametrize(("method", "passes"), [("zofed", 8 + 1), ("fedavg", 3)])
def test_a_head_run_reports_the_rule_s_passes(tiny_workspace, tmp_path, method, passes):
    """zofed's head recipe (8 one-sided queries a step) and FedAvg on the same cached features."""
    results = run_federated(tiny_federated_config(tiny_workspace, tmp_path / method, *HEAD_RUN,
                                                  f"federation.method={method}", "federation.rounds=2"),
                            show_progress=False)
    assert results["forward_passes_per_client_round"] == pytest.approx(1 + 2 * passes * TINY_HEAD)
    assert results["forward_passes"] == pytest.approx(2 * 2 * (1 + 2 * passes * TINY_HEAD))


def test_fedavg_reads_remembered_features_like_a_recomputing_run(tiny_workspace, tmp_path, monkeypatch):
    head = (*HEAD_RUN, "federation.method=fedavg", "federation.first_order_optimizer=sgd",
            "federation.first_order_lr=0.1", "federation.local_steps=6")
    runs = {}
    for name in ("remembered", "recomputed"):
        if name == "recomputed":
            recompute_features(monkeypatch)
        out = tmp_path / name
        runs[name] = (run_federated(tiny_federated_config(tiny_workspace, out, *head), show_progress=False),
                      _records(out)[1], load_file(str(out / "final" / "trainable.safetensors"))["label_head"])
    (plain, plain_log, plain_head), (fast, fast_log, fast_head) = runs["recomputed"], runs["remembered"]
    assert fast["forward_passes"] == plain["forward_passes"]
    assert [r["train_loss"] for r in fast_log] == [r["train_loss"] for r in plain_log]  # the same bits
    assert torch.equal(fast_head, plain_head)


def test_first_order_cached_features_are_refused_where_blocks_train(tiny_workspace, tmp_path):
    config = tiny_federated_config(tiny_workspace, tmp_path / "x", "zo.cache=features", "federation.method=fedavg",
                                   "trainable.mode=patterns", "trainable.patterns=['layers\\.1\\..*norm\\.weight$']",
                                   "federation.cached_examples=8")
    with pytest.raises(ConfigError, match="zo.cache: features needs .* frozen"):
        run_federated(config, show_progress=False)


def test_fedavg_on_the_head_runs_alike_on_the_flower_backend(tiny_workspace, tmp_path):
    """The round plan, its shares and cached features included, travels to Flower's clients in the downlink."""
    pytest.importorskip("flwr", reason="the Flower backend needs flwr (pip install 'zofed[flower]')")
    from zofed.flower.simulation import run_flower_simulation

    fedavg = (*HEAD_RUN, "federation.method=fedavg", "federation.first_order_optimizer=sgd",
              "federation.first_order_lr=0.1", "federation.rounds=2")
    flower = run_flower_simulation(tiny_federated_config(tiny_workspace, tmp_path / "flower", *fedavg),
                                   show_progress=False)
    local = run_federated(tiny_federated_config(tiny_workspace, tmp_path / "local", *fedavg), show_progress=False)
    assert flower["forward_passes"] == pytest.approx(2 * 2 * (1 + 2 * 3 * TINY_HEAD)) == local["forward_passes"]
    assert flower["test"] == local["test"]
    heads = [load_file(str(tmp_path / name / "final" / "trainable.safetensors"))["label_head"]
             for name in ("flower", "local")]
    assert torch.equal(*heads)
