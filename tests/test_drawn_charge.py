"""A step that moves some trainable tensors is charged what it runs (fl/cost.py): its first pass from the lowest
block changed since the last pass (the lowest trainable block when its batch is new), its other passes from the block
of the lowest tensor it moved. zofed's server charges each client from its draws, and the blocks its clients really
run are those charged."""

from dataclasses import replace

import numpy as np
import pytest
from toy_federation import tiny_federated_config

from zofed.fl.cost import carries_outputs, round_passes, step_passes
from zofed.fl.plan import LocalTraining
from zofed.models.tiny import tiny_causal_lm
from zofed.run.federated import prepare_run, run_federated
from zofed.sim.engine import simulate
from zofed.zo.prefix import PrefixCache, head_fraction, tensor_pass_shares

NORMS = r"layers\.(2|3)\..*norm\.weight$"


def _local(**settings) -> LocalTraining:
    return LocalTraining("zofed", run_seed=0, round_id=0, local_steps=3, lr=0.1, eps=1e-3, queries=8,
                         estimator="forward", **settings)


def test_each_tensor_is_charged_from_its_block_up():
    model = tiny_causal_lm(num_layers=4).model
    names = [n for n, _ in model.named_parameters() if "norm" in n and ("layers.2." in n or "layers.3." in n
                                                                         or n == "model.norm.weight")]
    shares = dict(zip(names, tensor_pass_shares(model, names, num_classes=3), strict=True))
    assert shares["model.layers.2.input_layernorm.weight"] == shares["model.layers.2.post_attention_layernorm.weight"]
    assert shares["model.layers.2.input_layernorm.weight"] == PrefixCache(model, 2).fraction == 0.5
    assert shares["model.layers.3.post_attention_layernorm.weight"] == 0.25
    assert shares["model.norm.weight"] == head_fraction(model, 3)
    # a causal LM's loss reads the vocabulary projection: above the blocks, a pass runs that
    lm = tensor_pass_shares(model, names, output_layer=True)
    assert lm[-1] == PrefixCache(model, 4, output_layer=True).fraction and lm[0] == PrefixCache(model, 2, True).fraction
    assert tensor_pass_shares(model, [*names, "model.embed_tokens.weight"]) == ()  # nothing can be cached


def test_a_step_runs_one_pass_from_the_lowest_block_and_the_others_from_the_moved_tensor():
    cached = _local(pass_fraction=0.5, feature_cache=8, batch_size=8)
    assert step_passes(cached, False, 0.5) == step_passes(cached, False) == 9 * 0.5  # every tensor moved
    assert step_passes(cached, False, 0.25) == 0.5 + 8 * 0.25
    fresh = replace(cached, feature_cache=0)  # each step's batch runs the frozen bottom once
    assert step_passes(fresh, False, 0.25) == 0.5 + 0.5 + 8 * 0.25
    assert step_passes(fresh, False) == 0.5 + 9 * 0.5
    whole = replace(fresh, pass_fraction=1.0)  # nothing cached (zo.cache: none): every pass whole
    assert step_passes(whole, False, 0.25) == step_passes(whole, False) == 9
    # 16 cached examples in batches of 8: each step's batch is new, its first pass from the lowest trainable block
    drawn = replace(cached, feature_cache=16)
    assert round_passes(drawn, False, [0.5, 0.25, 0.001]) == pytest.approx(
        2 * 0.5 + 9 * 0.5 + (0.5 + 8 * 0.25) + (0.5 + 8 * 0.001))
    with pytest.raises(ValueError, match="2 step shares for a round of 3 local steps"):
        round_passes(cached, False, [0.5, 0.25])


def test_steps_on_one_batch_rerun_only_the_blocks_changed_since_the_last_pass():
    """With every step on the round's whole cached batch, the outputs carry: a one-sided step's centre pass runs from
    what the previous step moved, a central step's first pass from the lower of that and what it perturbs."""
    cached = _local(pass_fraction=0.5, feature_cache=8, batch_size=8)
    assert carries_outputs(cached)
    assert round_passes(cached, False, [0.5, 0.25, 0.001]) == pytest.approx(
        1 * 0.5 + (0.5 + 8 * 0.5) + (0.5 + 8 * 0.25) + (0.25 + 8 * 0.001))
    central = replace(cached, estimator="central", queries=1, local_steps=4)
    assert round_passes(central, False, [0.25, 0.001, 0.5, 0.25]) == pytest.approx(
        0.5 + (0.5 + 0.25) + (0.25 + 0.001) + (0.5 + 0.5) + (0.5 + 0.25))
    dense = round_passes(central, False, None)
    assert dense == round_passes(central, False, [0.5] * 4) == pytest.approx(0.5 + 4 * 2 * 0.5)
    assert carries_outputs(replace(cached, tilt=0.5))  # the tilt leans within the drawn block
    # outputs do not carry where a step's batch is new or an optimizer with state moves every tensor
    for other in (replace(cached, feature_cache=16), replace(cached, optimizer="zo-sgd-momentum"),
                  replace(cached, feature_cache=0), replace(cached, pass_fraction=1.0)):
        assert not carries_outputs(other)


@pytest.fixture(scope="module")
def four_blocks(tiny_workspace, tmp_path_factory):
    """The tiny workspace's data with a 4-block model, whose top 2 blocks' norms train."""
    root = tmp_path_factory.mktemp("four-blocks")
    tiny = tiny_causal_lm(seed=1, num_layers=4)
    tiny.model.save_pretrained(root)
    tiny.tokenizer.save_pretrained(root)
    return root


def _config(ws, model, out, *extra):
    """Each step captures its own batch (cached_examples 0) unless `extra` says otherwise."""
    return tiny_federated_config(ws, out, f"model.name={model}", "trainable.mode=patterns",
                                 f"trainable.patterns=['{NORMS}']", "zo.cache=prefix", "zo.queries=2",
                                 "federation.local_steps=6", "federation.rounds=3", "federation.cached_examples=0",
                                 *extra)


def test_zofed_charges_each_client_the_blocks_its_steps_ran(tiny_workspace, four_blocks, tmp_path):
    run = prepare_run(_config(tiny_workspace, four_blocks, tmp_path / "run"))
    server, layers = run.server, run.setup.model.model.layers
    assert run.server.plan.pass_fraction == 0.5 and server.round_plan(0).estimator == "forward"
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):  # every pass through a block runs its MLP (the top one's at the last token)
        layer.mlp.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    history = simulate(run.client_context(), [s.train for s in run.splits], server, 3,
                       client=run.client_role()).history
    steps = 3 * 2 * 6  # rounds x clients x local steps, each on a fresh batch that ran the frozen bottom once
    charged = sum(r["forward_passes_per_client"] * len(r["clients"]) for r in history)
    # in blocks of the 4: per step the bottom's 2 and the top passes' blocks from where each started
    assert 4 * charged == pytest.approx(2 * steps + calls[2] + calls[3])
    dense = server.method.forward_passes(server.round_plan(0))
    assert dense == 6 * (0.5 + 3 * 0.5)  # had every step moved both blocks
    per_client = [r["forward_passes_per_client"] for r in history]
    assert all(6 * (0.5 + 0.5 + 2 * 0.25) <= c <= dense for c in per_client) and len(set(per_client)) > 1
    assert charged < 3 * 2 * dense
    assert history[-1]["forward_passes"] == pytest.approx(charged)


def test_a_resumed_run_carries_the_compute_it_spent(tiny_workspace, four_blocks, tmp_path):
    whole = run_federated(_config(tiny_workspace, four_blocks, tmp_path / "whole"), show_progress=False)
    first = run_federated(_config(tiny_workspace, four_blocks, tmp_path / "cut"), show_progress=False,
                          stop=lambda record: record["round"] == 2)
    assert first["rounds"] == 2 and first["forward_passes"] < whole["forward_passes"]
    resumed = run_federated(_config(tiny_workspace, four_blocks, tmp_path / "cut"), resume=True,
                            show_progress=False)
    assert resumed["forward_passes"] == whole["forward_passes"]
    assert resumed["forward_passes_per_client_round"] == pytest.approx(whole["forward_passes"] / (3 * 2))


def test_a_dense_method_is_charged_its_plan(tiny_workspace, four_blocks, tmp_path):
    results = run_federated(_config(tiny_workspace, four_blocks, tmp_path / "dense", "federation.method=zo-seeds"),
                            show_progress=False)
    # two queries a step with the central estimate: four passes of the top half, after the bottom half
    assert results["forward_passes_per_client_round"] == pytest.approx(6 * (0.5 + 4 * 0.5))


@pytest.mark.parametrize("tilt", [0.0, 0.5])
def test_on_a_round_s_cached_prefixes_the_charge_is_what_runs(tiny_workspace, four_blocks, tmp_path, tilt):
    """With federation.cached_examples the frozen bottom runs once a round, and with a step batch as large as the
    cached examples the blocks' outputs carry from step to step: the blocks run are those charged. A tilt towards
    the server's momentum leans within the drawn block, so it changes nothing of that."""
    run = prepare_run(_config(tiny_workspace, four_blocks, tmp_path / "cached", "federation.cached_examples=8",
                              "zo.queries=4", f"federation.sampling.tilt={tilt}"))
    server, layers = run.server, run.setup.model.model.layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    history = simulate(run.client_context(), [s.train for s in run.splits], server, 3,
                       client=run.client_role()).history
    client_rounds = 3 * 2
    charged = sum(r["forward_passes_per_client"] * len(r["clients"]) for r in history)
    # the bottom half once a round over the 8 cached examples, one batch of 8; the rest in the top blocks
    top_charged = 4 * charged - 2 * client_rounds
    assert carries_outputs(server.round_plan(0))
    assert calls[2] + calls[3] == pytest.approx(top_charged)  # block passes, counted against charged
    assert charged < client_rounds * server.method.forward_passes(server.round_plan(0))


def test_cost_aware_sampling_draws_the_cheap_blocks_more_and_is_charged_less(tiny_workspace, four_blocks, tmp_path):
    """federation.sampling.cost_aware: each client's pi leans to the blocks whose steps run fewer blocks (the final
    norm's run none), so the same rounds cost its clients less."""
    charges, sent = {}, {}
    for aware in (False, True):
        run = prepare_run(_config(tiny_workspace, four_blocks, tmp_path / f"aware-{aware}",
                                  "federation.cached_examples=8", f"federation.sampling.cost_aware={aware}"))
        history = simulate(run.client_context(), [s.train for s in run.splits], run.server, 3,
                           client=run.client_role()).history
        charges[aware] = history[-1]["forward_passes"]
        state = run.server.method_state
        sent[aware] = run.server.method.server_state(run.server, run.server.round_plan(3), 0)[:len(state.sizes)]
        shares = state.shares
    cheapest = int(np.argmin(shares))  # the top block's norms: a step on them runs one block of the two
    assert sent[True][cheapest] > sent[False][cheapest]
    assert sent[True] @ shares < sent[False] @ shares  # a draw's expected share of a pass
    assert charges[True] < charges[False]  # and the three rounds' charge (41.0 against 41.5 passes)
