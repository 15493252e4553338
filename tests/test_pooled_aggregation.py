"""The server's columnar fast path (fl/pooled.py): a round's uplinks pooled on arrays give the general path's
mean, rows and block statistics bit for bit, and the general path still serves what the fast path does not."""

from unittest import mock

import numpy as np
import pytest
import torch

from zofed.fl.aggregate import WeightedMean
from zofed.fl.methods.zofed import block_probes
from zofed.fl.personal import (
    BlockSampling,
    BlockStats,
    cdf_rows,
    check_distribution,
    draw_block_rows,
    draw_blocks,
    expected_update_square,
    global_energy,
    stack_distributions,
)
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import ClientUpdate, encode, step_seeds
from zofed.fl.roles import ServerRole
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import make_server_optimizer
from zofed.zo.noise import CHUNK

SIZES = (40, 7, 96, 33, 128, 64)


def _tensors(sizes=SIZES, masked=True):
    """Flat random tensors (as the trainable views are) and bool masks on some of them."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    if not masked:
        return tensors, None
    return tensors, [torch.rand(n, generator=gen) < 0.6 if i % 2 == 0 else None for i, n in enumerate(sizes)]


def _round(method="zofed", shared=False, blocks=0, queries=1, clients=5, steps=3, tilt=0.0, optimizer="mezo",
           sizes=SIZES, warm_start=False, run_seed=7):
    """A server after receiving one round of `clients` uplinks with random scalars, each client with its own pi
    (its probes lean on different blocks) and its own example count."""
    tensors, masks = _tensors(sizes)
    plan = FederationPlan(method, clients, clients, steps, lr=1e-2, eps=1e-2, run_seed=run_seed, queries=queries,
                          pool_size=4, optimizer=optimizer,
                          sampling=BlockSampling(shared_seeds=shared, blocks=blocks, tilt=tilt))
    server = ServerRole(plan, tensors, masks, make_server_optimizer("adam", 1e-2, granularity="tensor",
                                                                    warm_start=warm_start))
    if method == "zofed":
        n = len(server.method_state.sizes)
        for c in range(clients):
            server.method_state.stats.record(c, list(range(n)), [float(1 + (b * 7 + c) % 5) ** 3 for b in range(n)])
    return server, _receive(server, 0)


def _receive(server, round_id):
    local, inbox = server.round_plan(round_id), RoundInbox()
    rng = np.random.default_rng(round_id)
    for c in server.sample(round_id):
        server.send_state(local, c)
        seeds = server.method.step_seeds(local, c)
        grads = rng.normal(size=(local.local_steps, local.queries)).astype(np.float32)
        explicit = np.asarray(seeds.seeds, np.uint64) if seeds.base_seed is None else np.zeros(0, np.uint64)
        update = ClientUpdate(round_id, c, explicit, seeds.base_seed, grads, 3 + 5 * c, {"train_loss": 1.0})
        server.receive(inbox, local, c, encode(update))
    assert len(inbox.accepted) == server.plan.clients_per_round, inbox.rejected
    return local, inbox


def _both_paths(server, local, inbox):
    """The general path's and the fast path's means, and the (seeds, coefficients) each hands add_seed_rows_."""
    from zofed.fl import aggregate

    calls = {}
    for name in ("general", "pooled"):
        with mock.patch.object(aggregate, "add_seed_rows_", wraps=aggregate.add_seed_rows_) as rows:
            if name == "general":
                contributions = [server.contribution(u, local) for u in inbox.accepted]
                mean = WeightedMean().update(server.tensors, contributions, {})[0]
            else:
                pooled = server.pooled_terms(local, inbox.accepted)
                assert pooled is not None
                mean = WeightedMean().update_pooled(server.tensors, pooled, {})[0]
        calls[name] = (mean, [(list(c.args[1]), c.args[2]) for c in rows.call_args_list])
    return calls["general"], calls["pooled"]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(("blocks", "queries"), [(0, 1), (2, 3), (4, 9)])
def test_a_pooled_zofed_round_is_the_general_paths_mean_bit_for_bit(shared, blocks, queries):
    """Private or shared seeds, one block per tensor or runs of tensors, one to nine queries (numpy's pairwise
    sums start at eight), masks on some tensors, clients with their own pis and example counts."""
    server, (local, inbox) = _round(shared=shared, blocks=blocks, queries=queries)
    pis = [server._sent[u.client_id] for u in inbox.accepted]
    assert all(not np.array_equal(pis[0], p) for p in pis[1:])  # every client its own pi
    (general, general_rows), (pooled, pooled_rows) = _both_paths(server, local, inbox)
    assert len(general_rows) == len(pooled_rows) == 1
    assert general_rows[0][0] == pooled_rows[0][0]  # the same seeds in the same order
    assert np.array_equal(general_rows[0][1], pooled_rows[0][1])  # the same float64 coefficients, every bit
    assert all(torch.equal(a, b) for a, b in zip(general, pooled, strict=True))
    assert any(float(m.abs().max()) > 0 for m in pooled)
    seeds_used = len(pooled_rows[0][0])
    terms = local.local_steps * local.queries * len(inbox.accepted)
    assert (seeds_used == local.local_steps * local.queries) if shared else (seeds_used == terms)


@pytest.mark.parametrize("method", ["zo-seeds", "decomfl", "fedkseed", "hiso"])
def test_methods_whose_steps_move_every_tensor_alike_pool_bit_for_bit_too(method):
    server, (local, inbox) = _round(method)
    if method == "hiso":  # a preconditioner far from uniform, as after a few rounds
        k = server.method_state.k
        for i, t in enumerate(k):
            t.copy_(torch.linspace(0.2, 3.0, t.numel()) ** (1 + i % 3))
        server.method_state.sent = None
        local, inbox = _receive(server, 1)
    (general, general_rows), (pooled, pooled_rows) = _both_paths(server, local, inbox)
    assert [s for s, _ in general_rows] == [s for s, _ in pooled_rows]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(general_rows, pooled_rows, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(general, pooled, strict=True))


def test_a_tensor_of_several_noise_chunks_pools_bit_for_bit():
    server, (local, inbox) = _round(shared=True, sizes=(CHUNK + 100, 50), clients=3, steps=4)
    (general, _), (pooled, _) = _both_paths(server, local, inbox)
    assert all(torch.equal(a, b) for a, b in zip(general, pooled, strict=True))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("warm_start", [False, True])
def test_observe_files_the_probes_each_client_would_file_and_the_same_expected_square(shared, warm_start):
    """All clients at once give the BlockStats (and a warm start's expected squares) of one client at a time."""
    server, (local, inbox) = _round(shared=shared, queries=3, warm_start=warm_start)
    state = server.method_state
    reference = BlockStats(*(a.copy() for a in (state.stats.client_sums, state.stats.client_counts,
                                                state.stats.global_sums, state.stats.global_counts)))
    sent = dict(server._sent)
    delta = [torch.zeros_like(t) for t in server.tensors]
    extras = server.method.observe(server, local, inbox.accepted, sent, delta)
    num_blocks = len(state.sizes)
    drawn, total = [], sum(u.num_examples for u in inbox.accepted)
    for u in inbox.accepted:  # the per-client filing observe did before the fast path
        blocks, energies = block_probes(u, sent[u.client_id][:num_blocks])
        reference.record(u.client_id, blocks, energies)
        drawn += [(u.num_examples / total, sent[u.client_id][b], b) for b in blocks]
    for name in ("client_sums", "client_counts", "global_sums", "global_counts"):
        assert np.array_equal(getattr(state.stats, name), getattr(reference, name)), name
    if not warm_start:
        assert extras == {}
        return
    energy = global_energy(reference, state.sizes, server.plan.sampling)
    expected = expected_update_square(energy, state.tensor_sizes, state.numels, local.lr, local.queries, drawn,
                                      state.layout)
    assert np.array_equal(extras["expected_square"], expected)


def test_batched_block_draws_are_each_clients_own_draws(monkeypatch):
    """Row by row the same blocks as draw_blocks, zero-probability blocks and all, however the rows are cut."""
    rng = np.random.default_rng(3)
    pis = rng.uniform(size=(40, 9)).astype(np.float32)
    pis[:, [0, 4, 8]] = 0.0  # never drawn, at either end and inside
    pis /= pis.sum(axis=1, keepdims=True)
    seeds = rng.integers(0, 2**63, size=(40, 12), dtype=np.uint64)
    seeds[:, :6] = seeds[0, :6]  # shared step seeds beside private ones
    expected = np.array([draw_blocks(row.tolist(), pi) for row, pi in zip(seeds, pis, strict=True)])
    assert np.array_equal(draw_block_rows(seeds, pis), expected)
    wide = rng.uniform(size=(30, 300)) ** rng.uniform(1, 8, size=(30, 1))  # torch's cumsum is numpy's, every bit
    assert np.array_equal(cdf_rows(wide.astype(np.float32)), np.stack([np.cumsum(r.astype(np.float32),
                                                                                  dtype=np.float64) for r in wide]))
    monkeypatch.setattr("zofed.fl.personal.DRAW_CELLS", 50)  # a few clients at a time
    assert np.array_equal(draw_block_rows(seeds, pis), expected)
    assert not np.isin(expected, [0, 4, 8]).any()
    # a uniform so close to 1 that u * cdf[-1] may round up to cdf[-1]: no entry lies above it
    monkeypatch.setattr("zofed.fl.personal._block_uniform", lambda seed: float(np.nextafter(1.0, 0.0)))
    pis[:, 8] = rng.uniform(size=40).astype(np.float32) * 0.01
    expected = np.array([draw_blocks(row.tolist(), pi) for row, pi in zip(seeds, pis, strict=True)])
    assert np.array_equal(draw_block_rows(seeds, pis), expected)
    assert (expected == 8).all()


def test_stacked_distributions_are_checked_like_one():
    pis = np.full((3, 4), 0.25, np.float32)
    check_distribution(pis, 4)
    bad = pis.copy()
    bad[1, 2] = 0.5
    with pytest.raises(ValueError, match="sum to 1"):
        check_distribution(bad, 4)
    with pytest.raises(ValueError, match="3 entries, the model 4 blocks"):
        stack_distributions([pis[0], pis[1, :3]], 4)
    assert np.array_equal(stack_distributions([np.concatenate([p, [9.0]]) for p in pis], 4), pis)


def _no_directions(*args, **kwargs):
    raise AssertionError("the general path rebuilt a client")


@pytest.mark.parametrize("shared", [False, True])
def test_rounds_take_the_fast_path_and_continue_as_the_general_path_would(shared):
    """Three rounds through ServerRole.aggregate without a single per-client rebuild give the model, optimizer
    state and block statistics of the same rounds aggregated client by client (an aggregator without
    update_pooled)."""

    class GeneralMean:  # what a robust aggregator looks like to the server: contributions only
        name = "mean"
        init, update = WeightedMean.init, WeightedMean.update

    servers = {}
    for name, aggregator in (("fast", WeightedMean()), ("general", GeneralMean())):
        server, _ = _round(shared=shared, queries=2)
        server.aggregator = aggregator
        with mock.patch.object(type(server.method), "directions", _no_directions) if name == "fast" \
                else mock.patch.object(type(server.method), "pooled_terms", _no_directions):
            for r in range(3):
                local, inbox = _receive(server, r)
                server.aggregate(local, inbox)
        servers[name] = server
    fast, general = servers["fast"], servers["general"]
    assert all(torch.equal(a, b) for a, b in zip(fast.tensors, general.tensors, strict=True))
    for key, buffers in fast.opt_state.buffers.items():
        assert all(torch.equal(a, b) for a, b in zip(buffers, general.opt_state.buffers[key], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fast.method_state.to_tensors().values(),
                                                 general.method_state.to_tensors().values(), strict=True))


@pytest.mark.parametrize(("method", "settings"), [
    ("zofed", {"tilt": 0.5}), ("zofed", {"optimizer": "zo-adam"}), ("hiso", {"copies": True}), ("fedmezo", {})])
def test_the_general_path_serves_rounds_the_fast_path_does_not(method, settings):
    """A momentum tilt, a stateful local optimizer, hiso clients sent different arrays and dense uplinks take the
    general path, and aggregate as before."""
    if method == "fedmezo":
        tensors, masks = _tensors()
        server = ServerRole(FederationPlan(method, 2, 2, 3, lr=1e-2, eps=1e-2), tensors, masks)
        local = server.round_plan(0)
        dense = np.ones(server.num_trainable, np.float32)
        accepted = [ClientUpdate(0, c, np.zeros(0, np.uint64), 1, np.zeros((3, 1), np.float32), 2, {}, dense)
                    for c in range(2)]
        assert server.pooled_terms(local, accepted) is None
        return
    copies = settings.get("copies", False)
    server, (local, inbox) = _round(method, **{k: v for k, v in settings.items() if k != "copies"})
    if copies:  # each client sent its own copy of the preconditioner
        server._sent = {c: s.copy() for c, s in server._sent.items()}
    assert server.pooled_terms(local, inbox.accepted) is None
    if method == "zofed" and "tilt" in settings:  # the tilt needs a first moment: one round to make it
        server.aggregate(local, inbox)
        local, inbox = _receive(server, 1)
        assert server.pooled_terms(local, inbox.accepted) is None
    with mock.patch.object(type(server.method), "directions", wraps=server.method.directions) as directions:
        server.aggregate(local, inbox)
    if settings.get("optimizer") != "zo-adam":  # a stateful optimizer is replayed densely instead
        assert directions.call_count == len(inbox.accepted)


def test_pooled_terms_list_each_shared_seed_once_whatever_the_clients():
    server, (local, inbox) = _round(shared=True, clients=12, steps=2)
    pooled = server.pooled_terms(local, inbox.accepted)
    seeds = step_seeds(inbox.accepted[0])
    assert all(np.array_equal(step_seeds(u), seeds) for u in inbox.accepted)
    assert len(pooled.seeds) == len(set(pooled.seeds)) == local.local_steps * local.queries
    assert pooled.coefficients.shape == (len(pooled.seeds), len(server.tensors))
    assert server.pooled_terms(local, []) is None


def test_the_rounds_arrays_are_built_once_and_follow_an_inbox_that_grows():
    server, (local, inbox) = _round(shared=True)
    last = inbox.accepted.pop()
    steps = server.round_steps(inbox.accepted, server._sent)
    assert server.round_steps(inbox.accepted, server._sent) is steps  # the pooled mean and observe share them
    inbox.accepted.append(last)
    grown = server.round_steps(inbox.accepted, server._sent)
    assert grown is not steps and grown.client_ids.tolist() == [u.client_id for u in inbox.accepted]
    server.aggregate(local, inbox)
    assert server._steps is None
