"""Clients that lie (fl/attacks.py): who attacks, what each attack sends, and that it reaches the server through
the client role on the in-process engine and in a whole configured run."""

import json

import numpy as np
import pytest
import torch
from toy_federation import tiny_federated_config, toy_clients, toy_context

from zofed.fl.attacks import Attack
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import ClientUpdate, decode
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.server_opt import make_server_optimizer
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.sim.engine import simulate


def test_a_seeded_share_of_the_clients_attacks():
    attack = Attack.chosen("sign-flip", 0.2, 10, seed=3)
    assert len(attack.clients) == 2 and attack == Attack.chosen("sign-flip", 0.2, 10, seed=3)
    assert len(Attack.chosen("scale", 0.15, 10, seed=0).clients) == 2  # rounded up
    assert Attack.chosen("none", 0.0, 10, seed=0) is None
    draws = {frozenset(Attack.chosen("random", 0.3, 10, seed=s).clients) for s in range(6)}
    assert len(draws) > 1  # the run seed picks them


def test_each_attack_rewrites_the_uplinks_numbers():
    grads = np.array([[1.0, -2.0], [3.0, 0.5]], np.float32)
    update = ClientUpdate(2, 5, np.zeros(0, np.uint64), 9, grads, 10, {"train_loss": 1.0})
    flip = Attack("sign-flip", frozenset({5})).tamper(update, 2, 5)
    assert np.array_equal(flip.grads, -grads) and flip.base_seed == 9 and flip.num_examples == 10
    assert np.array_equal(Attack("scale", frozenset({5}), scale=100).tamper(update, 2, 5).grads, grads * 100)
    noise = Attack("random", frozenset({5}), seed=1)
    random = noise.tamper(update, 2, 5)
    assert random.grads.dtype == np.float32 and not np.allclose(random.grads, grads)
    assert np.array_equal(random.grads, noise.tamper(update, 2, 5).grads)  # seeded by (run, round, client)
    assert not np.array_equal(random.grads, noise.tamper(update, 3, 5).grads)
    many = ClientUpdate(2, 5, np.zeros(0, np.uint64), 9, np.full((400, 4), 2.0, np.float32), 10, {})
    assert np.sqrt(np.mean(noise.tamper(many, 2, 5).grads ** 2)) == pytest.approx(2.0, rel=0.05)  # the same RMS
    dense = ClientUpdate(2, 5, np.zeros(0, np.uint64), None, np.zeros((0, 1), np.float32), 10, {},
                         dense=np.ones(3, np.float32))
    assert np.array_equal(Attack("sign-flip", frozenset({5})).tamper(dense, 2, 5).dense, -np.ones(3))
    assert Attack("label-flip", frozenset({5})).tamper(update, 2, 5) is update  # it lies in its data instead


def _simulated(attack, rounds=2):
    """Three zo-seeds rounds of 3 of 6 toy clients; the server's record of each round and the uplinks sent."""
    ctx = toy_context(mode="lora")
    plan = FederationPlan("zo-seeds", 6, 3, 2, lr=1e-2, eps=1e-2, run_seed=4, batch_size=8)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks, make_server_optimizer("adam", lr=1e-2))
    sent, history = {}, []
    role = ClientRole(ctx, attack=attack, num_classes=2)
    simulate(ctx, toy_clients(), server, rounds, client=role, on_round=history.append,
             tamper=lambda r, c, data: sent.setdefault((r, c), data))
    return history, sent


def test_attackers_lie_through_the_client_role_and_the_honest_clients_do_not_change():
    honest, honest_sent = _simulated(None)
    attack = Attack("label-flip", frozenset({0, 1, 2}))
    _, lied = _simulated(attack)
    for (round_id, client), data in honest_sent.items():
        same = lied[(round_id, client)] == data
        # the first round's uplinks come from the same starting model; label-flippers train on other labels
        if round_id == 0:
            assert same != (client in attack.clients), (round_id, client)
    flipped = decode(lied[(0, min(c for r, c in lied if r == 0 and c in attack.clients))])
    assert np.isfinite(flipped.grads).all()


def test_a_stale_client_resends_its_last_uplink_and_the_server_rejects_it():
    stale = Attack("stale", frozenset(range(6)))  # every client re-sends
    history, sent = _simulated(stale, rounds=4)
    seen: dict[int, int] = {}
    for round_id in range(4):
        record = history[round_id]
        repeat = [c for c in record["clients"] if c in seen]
        assert len(record["rejected"]) == len(repeat)  # every second time a client is sampled, its uplink is old
        assert all("round" in r["reason"] for r in record["rejected"])
        for c in record["clients"]:
            if c in seen:
                assert decode(sent[(round_id, c)]).round_id == seen[c]
            seen[c] = round_id


def test_a_configured_attack_runs_and_bad_attack_settings_are_refused(tiny_workspace, tmp_path):
    out = tmp_path / "attacked"
    config = tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds", "attack.kind=sign-flip",
                                   "attack.fraction=0.5")
    plain = tiny_federated_config(tiny_workspace, tmp_path / "plain", "federation.method=zo-seeds")
    attacked = run_federated(config, show_progress=False)
    honest = run_federated(plain, show_progress=False)
    assert attacked["eval_accuracy_final"] is not None
    from safetensors.torch import load_file

    a, b = load_file(out / "final" / "trainable.safetensors"), load_file(tmp_path / "plain/final/trainable.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the liars moved the model elsewhere
    assert json.loads((out / "results.json").read_text())["rounds"] == honest["rounds"]
    for bad, message in ((["attack.kind=scale"], "needs both attack.kind and attack.fraction"),
                         (["attack.fraction=0.2"], "needs both attack.kind and attack.fraction"),
                         (["attack.kind=sign-flip", "attack.fraction=0.2", "attack.scale=5"],
                          "attack.scale is a setting of attack.kind scale")):
        with pytest.raises(ConfigError, match=message):
            tiny_federated_config(tiny_workspace, tmp_path / "bad", *bad)


def test_a_seed_grinder_keeps_its_scalars_and_lists_seeds_that_push_its_target():
    from zofed.fl.attacks import target_push
    from zofed.fl.protocol import step_seeds
    from zofed.zo.noise import NoiseSource

    grads = np.random.default_rng(0).normal(size=(40, 2)).astype(np.float32)
    update = ClientUpdate(2, 5, np.zeros(0, np.uint64), 9, grads, 10, {"train_loss": 1.0})
    grind = Attack("seed-grind", frozenset({5}), seed=1)
    lie = grind.tamper(update, 2, 5)
    assert lie.base_seed is None and lie.seeds.shape == (40,) and np.array_equal(lie.grads, grads)
    assert np.array_equal(lie.seeds, grind.tamper(update, 2, 5).seeds)  # seeded by (run, round, client)
    source = NoiseSource("rademacher")
    pushed = [target_push(source, int(s), g) for s, g in zip(lie.seeds, grads.tolist(), strict=True)]
    honest = [target_push(source, int(s), g) for s, g in zip(step_seeds(update), grads.tolist(), strict=True)]
    # each step's seed is the best of 16 for the target, the honest one a fair draw: the target moves far more
    assert all(p > 0 for p in pushed) and sum(pushed) > 5 * abs(sum(honest)), (sum(pushed), sum(honest))
    dense = ClientUpdate(2, 5, np.zeros(0, np.uint64), None, np.zeros((0, 1), np.float32), 10, {},
                         dense=np.ones(3, np.float32))
    assert grind.tamper(dense, 2, 5) is dense  # a dense uplink names no seeds to grind
