"""Federated ZO on a tiny random-init model: exact reconstruction, aggregation, bad uplinks, determinism."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context

from zofed.fl.aggregate import WeightedMean
from zofed.fl.methods import get_method, method_names
from zofed.fl.methods.base import step_records
from zofed.fl.plan import FederationPlan, LocalTraining
from zofed.fl.protocol import decode, encode, message_nbytes
from zofed.fl.roles import ServerRole
from zofed.fl.server import rebuild_client_update
from zofed.fl.server_opt import make_server_optimizer
from zofed.sim.engine import simulate
from zofed.zo.perturb import merge_terms


def run_client(ctx, start, client_id, indices, local, server_state=None):
    state = np.zeros(0, np.float32) if server_state is None else server_state
    return get_method(local.method).train(ctx, start, client_id, indices, local, state)


def rebuild(start, update, local, server_state=None):
    return rebuild_client_update(get_method(local.method), start, update, local, None, server_state)


def seed_plan(method, run_seed, round_id, client_id, steps, pool_size=0):
    local = LocalTraining(method, run_seed, round_id, steps, lr=1e-2, eps=1e-2, pool_size=pool_size)
    return get_method(method).step_seeds(local, client_id)


def _plan(method, steps=3, round_id=0):
    return LocalTraining(method, run_seed=5, round_id=round_id, local_steps=steps, lr=1e-2, eps=1e-2, batch_size=8,
                         pool_size=4)


def _skewed_pi(blocks):
    """A personal block distribution far from uniform, as a client under label skew might get."""
    w = np.linspace(1.0, 8.0, blocks)
    return (w / w.sum()).astype(np.float32)


@pytest.mark.parametrize("method", method_names(first_order=False))
def test_server_rebuilds_each_clients_exact_local_update(method):
    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    plan = _plan(method)
    pi = _skewed_pi(len(start)) if get_method(method).uses_sampling else None
    if method == "hiso":  # a preconditioner far from uniform, as after a few rounds
        numel = sum(t.numel() for t in start)
        pi = np.random.default_rng(0).uniform(0.2, 3.0, numel).astype(np.float32)
    update, final = run_client(ctx, start, 2, toy_clients()[2], plan, pi)
    client_delta = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    rebuilt = rebuild(start, update, plan, pi)
    server_delta = torch.cat([r.reshape(-1) for r in rebuilt])
    assert client_delta.norm() > 0
    assert float((server_delta - client_delta).norm() / client_delta.norm()) <= 1e-5
    if method != "fedmezo":
        assert torch.equal(server_delta, client_delta)  # same fp32 operations in the same order


def test_mean_update_is_the_weighted_mean_of_rebuilt_updates():
    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    plan = _plan("zo-seeds")
    updates = [run_client(ctx, start, k, idx, plan)[0] for k, idx in enumerate(toy_clients(3))]
    server = ServerRole(FederationPlan("zo-seeds", 3, 3, 3, 1e-2, 1e-2), start)
    contributions = [server.contribution(u, plan) for u in updates]
    mean = torch.cat([m.reshape(-1) for m in WeightedMean().update(start, contributions, {})[0]])
    total = sum(u.num_examples for u in updates)
    expected = sum(torch.cat([d.reshape(-1) for d in rebuild(start, u, plan)])
                   * (u.num_examples / total) for u in updates)
    assert float((mean - expected).norm() / expected.norm()) <= 1e-5


def test_decomfl_clients_share_seeds_so_the_server_regenerates_steps_not_clients_times_steps():
    plans = [seed_plan("decomfl", 1, 3, client, 5) for client in range(4)]
    assert all(p.seeds == plans[0].seeds for p in plans)
    assert seed_plan("zo-seeds", 1, 3, 0, 5).seeds != seed_plan("zo-seeds", 1, 3, 1, 5).seeds
    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    updates = [run_client(ctx, start, k, idx, _plan("decomfl", steps=5))[0] for k, idx in enumerate(toy_clients(4))]
    terms = [term for u in updates for r in step_records(u) for term in r.grad_terms()]
    assert len(terms) == 20 and len(merge_terms(terms)) == 5


def test_fedkseed_draws_only_from_its_pool():
    from zofed.fl.methods import kseed_pool

    pool = set(kseed_pool(9, 4).tolist())
    seeds = {s for c in range(5) for s in seed_plan("fedkseed", 9, 0, c, 20, pool_size=4).seeds}
    assert seeds <= pool and len(seeds) > 1


def test_seed_and_scalar_uplink_does_not_grow_with_the_model():
    sizes = []
    for vocab in (64, 4000):  # ~21k and ~150k trainable parameters
        ctx = toy_context(vocab_size=vocab)
        start = [t.clone() for t in ctx.trainable.tensors()]
        update, _ = run_client(ctx, start, 1, toy_clients()[1], _plan("zo-seeds", steps=10))
        sizes.append(message_nbytes(update))
    assert sizes[0] == sizes[1] and sizes[0] < 400


def _run(tamper=None, rounds=3, method="zo-seeds"):
    ctx = toy_context(mode="lora")
    history = []
    plan = FederationPlan(method, 6, 3, 2, lr=1e-2, eps=1e-2, run_seed=4, batch_size=8)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks, make_server_optimizer("adam", lr=1e-2))
    result = simulate(ctx, toy_clients(), server, rounds, tamper=tamper, on_round=history.append)
    return result, history


def test_three_round_run_is_bit_identical_when_repeated():
    first, h1 = _run()
    second, h2 = _run()
    assert all(torch.equal(a, b) for a, b in zip(first.global_tensors, second.global_tensors, strict=True))
    assert [r["clients"] for r in h1] == [r["clients"] for r in h2] and len(h1) == 3
    assert any(float(t.abs().max()) > 0 for t in first.global_tensors)  # LoRA B moved off zero


def test_malformed_uplinks_are_rejected_with_a_reason_and_the_round_goes_on():
    def tamper(round_id, client_id, data):
        if round_id == 1 and client_id == sampled[0]:
            return b"not a zofed message at all"
        if round_id == 1 and client_id == sampled[1]:
            return data[:-3]
        return data

    from zofed.fl.roles import sample_clients

    sampled = sample_clients(4, 1, 6, 3)
    _, history = _run(tamper)
    assert [r["accepted"] for r in history] == [3, 1, 3]
    reasons = sorted(r["reason"].split(":")[0] for r in history[1]["rejected"])
    assert reasons == ["bad_magic", "truncated"] or reasons == ["bad_magic", "length_mismatch"]


def test_a_round_where_every_uplink_is_bad_keeps_the_model():
    sent = []
    clean, _ = _run(tamper=lambda r, c, d: sent.append(d) or d, rounds=1)  # passes every uplink through
    broken, history = _run(tamper=lambda r, c, d: b"", rounds=1)
    assert history[0]["accepted"] == 0 and len(history[0]["rejected"]) == 3
    ctx = toy_context(mode="lora")
    assert all(torch.equal(a, b) for a, b in zip(broken.global_tensors, ctx.trainable.tensors(), strict=True))
    # The uplinks were the encoder's canonical bytes, and the recorded size is measured from exactly those bytes.
    assert len(sent) == 3 and all(encode(decode(d)) == d for d in sent)
    assert clean.history[0]["bytes_up_per_client"] == np.mean([len(d) for d in sent]) < 400


def test_first_order_client_uploads_its_dense_update_and_leaves_no_gradients():
    from zofed.fl.methods.first_order import run_first_order_client

    ctx = toy_context(mode="lora")
    start = [t.clone() for t in ctx.trainable.tensors()]
    batch = ctx.task.collate(ctx.train, list(range(40)))
    before = ctx.task.loss(ctx.model, batch)
    plan = LocalTraining("fedavg", 1, 0, local_steps=15, lr=5e-2, eps=1e-2, batch_size=16)
    update, final = run_first_order_client(ctx, start, 0, np.arange(120), plan)
    assert update.dense.size == sum(t.numel() for t in start) and update.grads.shape[0] == 0
    rebuilt = rebuild(start, update, plan)
    assert all(torch.allclose(r, f - s) for r, f, s in zip(rebuilt, final, start, strict=True))
    assert ctx.task.loss(ctx.model, batch) < before  # back-propagation really trained
    assert all(p.grad is None and not p.requires_grad for p in ctx.model.parameters())


def test_fedavg_run_and_its_bytes():
    result, history = _run(method="fedavg", rounds=2)
    assert all(r["accepted"] == 3 for r in history)
    numel = sum(t.numel() for t in result.global_tensors)
    assert history[0]["bytes_up_per_client"] > 4 * numel  # the dense update crosses the wire


def test_fedkseed_picks_are_not_the_stream_of_any_local_batch():
    """FedKSeed's seed picks once drew from [run seed, round, client, 7], the stream of local step 7's batch: the
    picks and that batch were the same random numbers. Every stream now carries its own tag (streams.py)."""
    from zofed import streams

    local = LocalTraining("fedkseed", 3, 2, local_steps=12, lr=1e-2, eps=1e-2, pool_size=64)
    picks = streams.kseed_picks(3, 2, 1).integers(0, 64, size=12)
    for step in range(12):
        assert not np.array_equal(streams.local_batch(3, 2, 1, step).integers(0, 64, size=12), picks)
    pool = get_method("fedkseed").step_seeds(local, 1).seeds
    from zofed.fl.methods import kseed_pool

    assert pool == [int(kseed_pool(3, 64)[i]) for i in picks]


def test_a_forward_estimator_client_is_rebuilt_exactly_and_charged_q_plus_one_passes():
    from dataclasses import replace

    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    plan = replace(_plan("zo-seeds"), queries=3, estimator="forward")
    update, final = run_client(ctx, start, 1, toy_clients()[1], plan)
    client_delta = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    server_delta = torch.cat([r.reshape(-1) for r in rebuild(start, update, plan)])
    assert client_delta.norm() > 0 and torch.equal(server_delta, client_delta)
    assert get_method("zo-seeds").forward_passes(plan) == 3 * (3 + 1)  # 3 steps of q + 1 passes


@pytest.mark.parametrize("optimizer", ["zo-adam", "zo-sgd-momentum"])
@pytest.mark.parametrize("method", ["zo-seeds", "zofed"])
def test_a_stateful_local_optimizer_is_replayed_by_the_server_bit_for_bit(method, optimizer):
    """Clients may run ZO-Adam or momentum locally from a fresh state each round: the server replays each
    client's steps with the same optimizer and gets the client's update exactly, and the round's mean is the
    example-weighted mean of those replays (no pooling: the update is not linear in the steps)."""
    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    plan = FederationPlan(method, 3, 3, 4, lr=1e-2, eps=1e-2, batch_size=8, optimizer=optimizer)
    server = ServerRole(plan, start)
    local = server.round_plan(0)
    assert not local.linear_steps and type(local.local_optimizer()).__name__ != "MeZO"
    states = {c: server.send_state(local, c) for c in range(3)}
    runs = {c: run_client(ctx, start, c, toy_clients(3)[c], local, states[c]) for c in range(3)}
    for c, (update, final) in runs.items():
        client_delta = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
        replayed = torch.cat([r.reshape(-1) for r in rebuild(start, update, local, states[c])])
        assert client_delta.norm() > 0 and torch.equal(replayed, client_delta)
    mezo = replace(local, optimizer="mezo")  # the same scalars replayed as MeZO steps move elsewhere
    update = runs[0][0]
    assert not torch.equal(torch.cat([r.reshape(-1) for r in rebuild(start, update, mezo, states[0])]),
                           torch.cat([r.reshape(-1) for r in rebuild(start, update, local, states[0])]))
    contributions = [server.contribution(u, local) for u, _ in runs.values()]
    assert all(c.dense is not None and not c.directions for c in contributions)
    mean = WeightedMean().update(start, contributions, {})[0]
    total = sum(u.num_examples for u, _ in runs.values())
    expected = [torch.zeros_like(t) for t in start]
    for u, final in runs.values():
        for e, f, s in zip(expected, final, start, strict=True):
            e.add_(f - s, alpha=u.num_examples / total)
    assert all(torch.equal(m, e) for m, e in zip(mean, expected, strict=True))


@pytest.mark.parametrize("estimator", ["central", "forward"])
def test_float16_scalars_halve_the_uplink_and_the_server_still_rebuilds_the_client_exactly(estimator):
    """With scalar_bits 16 each scalar is rounded to float16 before the client's step uses it, so the server's
    replay from the decoded wire bytes is the client's own update, and each scalar costs 2 bytes, not 4."""
    ctx = toy_context()
    start = [t.clone() for t in ctx.trainable.tensors()]
    full = replace(_plan("zofed", steps=6), queries=4, estimator=estimator)
    half = replace(full, scalar_bits=16)
    pi = _skewed_pi(len(start))
    update, final = run_client(ctx, start, 1, toy_clients()[1], half, pi)
    assert update.scalar_bits == 16 and np.array_equal(update.grads.astype(np.float16).astype(np.float32),
                                                       update.grads)
    received = decode(encode(update))
    client_delta = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    server_delta = torch.cat([r.reshape(-1) for r in rebuild(start, received, half, pi)])
    assert client_delta.norm() > 0 and torch.equal(server_delta, client_delta)
    full_update, _ = run_client(ctx, start, 1, toy_clients()[1], full, pi)
    same_loss = replace(full_update, metrics=update.metrics)  # the loss's digits change the header's length
    assert message_nbytes(same_loss) - message_nbytes(update) == 2 * 6 * 4
    assert np.abs(full_update.grads - update.grads).max() > 0  # the rounding is real...
    assert np.allclose(full_update.grads, update.grads, rtol=1e-2, atol=1e-3)  # ...and small
