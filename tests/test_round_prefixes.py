"""A round's cached prefixes (zo.cache: prefix with federation.cached_examples): a client runs a few of its examples
through the frozen bottom once a round and takes every local step on them, each perturbed pass over the top blocks
only; the label head recipe's engine, for the model's own weights."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_prefix_memo import _deep_workspace
from toy_federation import tiny_federated_config

from zofed.fl.client import RoundPrefixes
from zofed.fl.cost import round_passes
from zofed.fl.plan import LocalTraining
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run
from zofed.zo.prefix import zo_passes

TOP_LORA = ["trainable.mode=lora", "trainable.lora_r=2", "trainable.lora_layers=[6, 7]", "zo.cache=prefix"]


def test_a_round_s_prefixes_are_charged_once_and_each_step_runs_the_top():
    local = LocalTraining("zofed", 0, 0, local_steps=12, lr=1e-3, eps=1e-3, queries=4, batch_size=8,
                          pass_fraction=0.25, estimator="forward", feature_cache=16)
    assert round_passes(local, first_order=False) == pytest.approx(16 / 8 * 0.75 + 12 * zo_passes(4, "forward") * 0.25)
    with pytest.raises(ValueError, match="ZO steps"):
        round_passes(local, first_order=True)


def test_a_run_on_round_prefixes_learns_draws_only_the_cached_examples_and_replays(tmp_path, monkeypatch):
    import zofed.fl.client as client

    ws = _deep_workspace(tmp_path / "ws")
    drawn: list[tuple[set, set]] = []
    losses = []
    step_loss = RoundPrefixes.step_loss

    def recording(self, ctx, local, client_id, step, cache, shift):
        loss = step_loss(self, ctx, local, client_id, step, cache, shift)
        drawn.append((set(self.chosen.tolist()), set(self.cache.memo.rows)))
        losses.append(loss)
        return loss

    monkeypatch.setattr(client.RoundPrefixes, "step_loss", recording)
    out = tmp_path / "run"
    result = run_federated(tiny_federated_config(ws, out, *TOP_LORA, "federation.cached_examples=4",
                                                 "federation.local_steps=6", "federation.rounds=4",
                                                 "federation.eval_every=1", "optimizer.lr=0.05", "zo.queries=2"),
                           show_progress=False)
    assert len(drawn) == 4 * 2 * 6 and all(len(chosen) == 4 for chosen, _ in drawn)  # rounds x clients x steps
    # a batch (8) as large as the round's examples: one loss serves a client's 6 steps, its prefix built once
    assert [len({id(f) for f in losses[i:i + 6]}) for i in range(0, len(losses), 6)] == [1] * 8
    fraction = 2 / 8  # the tiny model's top 2 of 8 blocks
    most = 4 / 8 * (1 - fraction) + 6 * zo_passes(2, "forward") * fraction
    # each step's first pass runs both top blocks, the others only the top one where it drew that block's adapters
    least = 4 / 8 * (1 - fraction) + 6 * (fraction + (zo_passes(2, "forward") - 1) * fraction / 2)
    assert least <= result["forward_passes_per_client_round"] < most
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    curve = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(set(curve)) == len(curve) == 5  # the top blocks moved every round
    assert replay_run(out).matches  # the server rebuilt from seeds and scalars what the clients stepped


def test_a_client_without_the_simulator_s_memo_steps_the_same_bits(tmp_path, monkeypatch):
    """A Flower client keeps its round's prefixes in a memo of its own; each row is computed alone either way, so
    a run ends where the simulator's run does, bit for bit."""
    import zofed.sim.engine as engine

    ws = _deep_workspace(tmp_path / "ws")
    options = [*TOP_LORA, "federation.cached_examples=4", "federation.local_steps=3", "federation.rounds=2"]
    run_federated(tiny_federated_config(ws, tmp_path / "shared", *options), show_progress=False)
    monkeypatch.setattr(engine, "simulation_prefixes", lambda *args: None)
    run_federated(tiny_federated_config(ws, tmp_path / "own", *options), show_progress=False)
    shared, own = (load_file(str(tmp_path / name / "final" / "trainable.safetensors")) for name in ("shared", "own"))
    assert all(torch.equal(shared[k], own[k]) for k in shared)
    assert any(k.endswith("lora_B.default.weight") and shared[k].any() for k in shared)
