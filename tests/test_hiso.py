"""HiSo: shared seeds, perturbations preconditioned by the server's second moment, scalar-only uplink."""

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context

from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import decode
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.rounds import run_round


def _server(method, ctx):
    plan = FederationPlan(method, 6, 3, 3, lr=1e-2, eps=1e-2, run_seed=2, batch_size=8)
    return ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks)


def _deliver(ctx):
    client = ClientRole(ctx)
    return lambda r, downlinks: {c: client.train(d, c, toy_clients()[c], r) for c, d in downlinks}


def test_hiso_starts_as_decomfl_then_preconditions_by_the_rounds_second_moment():
    """With K = 1 the first round is DeComFL's bit for bit; after it K holds the round's squared mean estimate
    and the next downlink's preconditioner is normalized to unit RMS and no longer uniform."""
    ctx = toy_context()
    hiso, decomfl = _server("hiso", ctx), _server("decomfl", ctx)
    start = [t.clone() for t in hiso.tensors]
    run_round(hiso, 0, _deliver(ctx))
    run_round(decomfl, 0, _deliver(ctx))
    assert all(torch.equal(a, b) for a, b in zip(hiso.tensors, decomfl.tensors, strict=True))
    local = hiso.round_plan(1)
    p = decode(hiso.downlink(local, 0)).server_state
    assert p.size == hiso.num_trainable and abs(np.sqrt(np.mean(p.astype(np.float64) ** 2)) - 1.0) < 1e-6
    moved = torch.cat([(h - s).reshape(-1) for h, s in zip(hiso.tensors, start, strict=True)])
    k = torch.cat(hiso.method_state.k)
    g_hat = moved / (-1e-2 * 3)
    assert torch.allclose(k, 0.9 + 0.1 * g_hat.square(), rtol=1e-5)
    inv = k.double().rsqrt()
    assert np.allclose(p, (inv / inv.square().mean().sqrt()).numpy(), rtol=1e-6)
    big, small = int(g_hat.abs().argmax()), int(g_hat.abs().argmin())
    assert p[big] < p[small]  # the coordinate the round moved most is probed least


def test_hiso_clients_share_one_preconditioner_so_the_server_merges_their_seeds():
    """Every client of a round gets the same preconditioner and the same seeds: the server pools their terms
    under one perturbation, so each direction is regenerated once per round, not once per client."""
    ctx = toy_context()
    server = _server("hiso", ctx)
    run_round(server, 0, _deliver(ctx))
    local = server.round_plan(1)
    client = ClientRole(ctx)
    uplinks = {c: client.train(server.downlink(local, c), c, toy_clients()[c], 1) for c in server.sample(1)}
    contributions = [server.contribution(decode(u), local) for u in uplinks.values()]
    keys = {pert.pool_key() for c in contributions for pert, _ in c.directions}
    assert len(keys) == 1 and None not in keys
    seeds = [{s for _, terms in c.directions for s, _ in terms} for c in contributions]
    assert all(s == seeds[0] for s in seeds)  # shared seeds: 3 steps' directions for all clients together


def test_a_hiso_downlink_carries_the_preconditioner_and_a_bad_one_is_refused():
    ctx = toy_context()
    hiso, decomfl = _server("hiso", ctx), _server("decomfl", ctx)
    grow = len(hiso.downlink(hiso.round_plan(0), 0)) - len(decomfl.downlink(decomfl.round_plan(0), 0))
    assert 4 * hiso.num_trainable <= grow < 4 * hiso.num_trainable + 32  # one float32 per trainable value
    bad = hiso.round_plan(0)
    start = ctx.trainable.tensors()
    with pytest.raises(ValueError, match="one finite preconditioner value per trainable value"):
        get_method("hiso").perturbations(bad, start, None, [1, 2], np.ones(3, np.float32))


def _hiso_round(run_seed):
    from test_pooled_aggregation import _round

    return _round("hiso", shared=True, clients=4, run_seed=run_seed)


def test_two_hiso_servers_in_one_process_rebuild_as_each_alone():
    """The method object is shared by every run of the process; what a run's rebuild depends on must not be kept
    there. Two servers' rounds rebuilt interleaved, client by client, pool and aggregate (seed-median: the clients'
    terms must fall under one perturbation) exactly as each server's round rebuilt alone."""
    from zofed.fl.aggregate import SeedMedian

    def aggregate(server, contributions):
        median = SeedMedian()
        return median.update(server.tensors, contributions, median.init())[0]

    (a, (local_a, inbox_a)), (b, (local_b, inbox_b)) = _hiso_round(7), _hiso_round(8)
    alone_a = aggregate(a, [a.contribution(u, local_a) for u in inbox_a.accepted])
    alone_b = aggregate(b, [b.contribution(u, local_b) for u in inbox_b.accepted])
    mixed_a, mixed_b = [], []
    for ua, ub in zip(inbox_a.accepted, inbox_b.accepted, strict=True):
        mixed_a.append(a.contribution(ua, local_a))
        mixed_b.append(b.contribution(ub, local_b))
    assert len({pert.noise_key() for c in mixed_a for pert, _ in c.directions}) == 1
    for alone, mixed in ((alone_a, aggregate(a, mixed_a)), (alone_b, aggregate(b, mixed_b))):
        assert all(torch.equal(x, y) for x, y in zip(alone, mixed, strict=True))
