"""zofed's own method: personalized block sampling on clients, adaptive momentum on the server."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context

from zofed.fl.methods import get_method
from zofed.fl.personal import (
    BlockSampling,
    BlockStats,
    MomentumTilt,
    block_sizes,
    check_distribution,
    client_distribution,
    draw_block,
    draw_blocks,
    expected_update_square,
    step_perturbation,
    tensor_blocks,
)
from zofed.fl.plan import FederationPlan, LocalTraining
from zofed.fl.protocol import decode, message_nbytes, step_seeds
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.server import RoundInbox, rebuild_client_update
from zofed.fl.server_opt import make_server_optimizer as ServerOptimizer
from zofed.fl.server_opt import movable_values
from zofed.zo.noise import chunk_bounds, derive_seed
from zofed.zo.perturb import add_directions_


def run_client(ctx, start, client_id, indices, local, server_state=None):
    """A client's local round under its method, from the server state its downlink carried."""
    state = np.zeros(0, np.float32) if server_state is None else server_state
    return get_method(local.method).train(ctx, start, client_id, indices, local, state)


def rebuild(start, update, local, server_state=None):
    return rebuild_client_update(get_method(local.method), start, update, local, None, server_state)


def assert_rebuilt_exactly(start, update, final, round_plan, pi) -> None:
    """The server's rebuild of a client's update matches what the client applied (relative error <= 1e-5)."""
    rebuilt = torch.cat([r.reshape(-1) for r in rebuild(start, update, round_plan, pi)])
    actual = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    assert actual.norm() > 0 and float((rebuilt - actual).norm() / actual.norm()) <= 1e-5


def test_personalized_steps_are_unbiased_with_identity_covariance():
    """E[z z^T] = I for z = u_b / sqrt(pi_b), b ~ pi: the mean of (w . z) z over many steps is w."""
    pi = np.array([0.6, 0.3, 0.1], np.float32)
    w = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5, 3.0]), torch.tensor([-1.0])]
    estimate = [torch.zeros_like(t) for t in w]
    n = 6000
    for seed in range(n):
        pert, _ = step_perturbation(seed, pi)
        z = [torch.zeros_like(t) for t in w]
        add_directions_(z, [(seed, 1.0)], pert)
        g = sum(float((a * b).sum()) for a, b in zip(w, z, strict=True))
        for e, zi in zip(estimate, z, strict=True):
            e.add_(zi, alpha=g / n)
    flat_est, flat_w = torch.cat(estimate), torch.cat(w)
    assert float((flat_est - flat_w).norm() / flat_w.norm()) < 0.1


def test_blocks_are_drawn_with_their_probabilities_and_deterministically():
    pi = np.array([0.7, 0.2, 0.1], np.float32)
    draws = np.array([draw_block(s, pi) for s in range(5000)])
    assert np.allclose(np.bincount(draws, minlength=3) / 5000, pi, atol=0.03)
    assert [draw_block(s, pi) for s in range(50)] == [draw_block(s, pi) for s in range(50)]


def test_distribution_follows_each_clients_own_block_energies():
    sizes = np.array([100.0, 100.0, 100.0, 100.0])
    settings = BlockSampling(mix=0.2, prior_weight=1.0)
    stats = BlockStats.zeros(2, 4)
    assert np.allclose(client_distribution(stats, 0, sizes, settings), 0.25)  # no probes yet: by size
    for _ in range(20):
        stats.record(0, [0, 1, 2, 3], [50.0, 1.0, 1.0, 1.0])  # client 0's gradient lives in block 0
        stats.record(1, [0, 1, 2, 3], [1.0, 1.0, 1.0, 50.0])  # client 1's in block 3
    pi0, pi1 = client_distribution(stats, 0, sizes, settings), client_distribution(stats, 1, sizes, settings)
    assert pi0.argmax() == 0 and pi1.argmax() == 3 and pi0[0] > 0.4 and pi1[3] > 0.4
    assert pi0.min() >= 0.2 / 4 - 1e-6  # the mixed-in share bounds every importance weight
    check_distribution(pi0, 4)
    for bad in (np.array([0.5, 0.5], np.float32), np.array([0.5, 0.6, -0.1, 0.0], np.float32),
                np.array([np.nan, 0.5, 0.25, 0.25], np.float32)):
        with pytest.raises(ValueError):
            check_distribution(bad, 4)


def test_a_cost_aware_distribution_weighs_each_block_by_its_energy_over_its_cost():
    """sqrt(n_b E_b / c_b): of blocks with the same energy, one 16 times cheaper is drawn 4 times as often (before
    the size-proportional share is mixed in), the pi that minimizes variance times the expected cost of a step."""
    sizes, costs = np.array([100.0, 100.0, 100.0]), np.array([0.16, 0.04, 0.01])
    stats = BlockStats.zeros(1, 3)
    for _ in range(50):
        stats.record(0, [0, 1, 2], [4.0, 1.0, 1.0])
    plain, aware = BlockSampling(mix=1e-6), BlockSampling(mix=1e-6, cost_aware=True)
    energy_only = client_distribution(stats, 0, sizes, plain, costs)  # costs ignored unless asked for
    assert energy_only[0] == pytest.approx(2 * energy_only[1], rel=0.05) and energy_only[1] == pytest.approx(
        energy_only[2], rel=1e-4)
    pi = client_distribution(stats, 0, sizes, aware, costs)
    assert pi[2] == pytest.approx(2 * pi[1], rel=1e-4) and pi[1] == pytest.approx(pi[0], rel=0.05)
    # no costs known (every step runs the whole model): the energies alone
    assert np.array_equal(client_distribution(stats, 0, sizes, aware, None), energy_only)
    energy = np.array([4.0, 1.0, 1.0])  # variance x cost is least at the cost-aware pi among the two
    assert (sizes * energy / pi).sum() * (pi * costs).sum() < (sizes * energy / energy_only).sum() * (
        energy_only * costs).sum()


def test_server_rebuilds_a_personalized_clients_update_exactly_and_learns_its_blocks():
    ctx = toy_context()
    plan = FederationPlan("zofed", 6, 2, 4, lr=1e-2, eps=1e-2, run_seed=3, batch_size=8)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        ServerOptimizer("adam", 1e-2, granularity="tensor"))
    round_plan = server.round_plan(0)
    start = [t.clone() for t in server.tensors]
    # Client 1's probes say its gradient lives in block 1: its distribution moves far from size-proportional.
    others = [b for b in range(len(start)) if b != 1]
    server.method_state.stats.record(1, [1, 1, *others], [500.0, 600.0, *[1e-3] * len(others)])
    downlink = server.downlink(round_plan, 1)
    pi = decode(downlink).server_state
    assert pi[1] > 3 * server.method_state.sizes[1] / server.method_state.sizes.sum()
    update, final = run_client(ctx, start, 1, toy_clients()[1], round_plan, pi)
    assert_rebuilt_exactly(start, update, final, round_plan, pi)
    inbox = RoundInbox()
    server.receive(inbox, round_plan, 1, ClientRole(ctx).train(downlink, 1, toy_clients()[1], 0))
    server.aggregate(round_plan, inbox)
    assert server.method_state.stats.client_counts[1].sum() == len(start) + 1 + 4
    assert server.method_state.stats.global_counts.sum() == len(start) + 1 + 4


def test_uplink_bytes_do_not_depend_on_the_model():
    sizes, numels = [], []
    for vocab, layers in ((64, 2), (4000, 6)):
        ctx = toy_context(vocab_size=vocab, num_layers=layers)
        start = [t.clone() for t in ctx.trainable.tensors()]
        sizes_b = block_sizes(start)
        pi = (sizes_b / sizes_b.sum()).astype(np.float32)
        plan = LocalTraining("zofed", run_seed=1, round_id=0, local_steps=10, lr=1e-2, eps=1e-2, batch_size=8)
        update, _ = run_client(ctx, start, 0, toy_clients()[0], plan, pi)
        # the train loss travels as JSON text, whose digits vary with its value: fix it, count the rest
        sizes.append(message_nbytes(replace(update, metrics={"train_loss": 0.5})))
        numels.append(sum(t.numel() for t in start))
    assert numels[1] > 5 * numels[0]  # about 9 times the parameters, 3 times the blocks
    assert sizes[0] == sizes[1] < 400


@pytest.mark.parametrize("name", ["adam", "yogi", "amsgrad"])
@pytest.mark.parametrize("granularity", ["coordinate", "tensor", "global"])
@pytest.mark.parametrize("relative", [False, "current", "start"])
def test_server_optimizer_state_restores_to_a_bit_identical_continuation(name, granularity, relative):
    opt = ServerOptimizer(name, lr=0.1, granularity=granularity, relative=bool(relative),
                          relative_to=relative or "current")
    gen = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen)] for _ in range(4)]
    a = [torch.ones(5), torch.full((3, 2), 0.05)]
    state = opt.init(a)
    for d in deltas[:2]:
        state = opt.apply(a, state, d)
    b = [t.clone() for t in a]
    restored = type(state).from_tensors({k: v.clone() for k, v in state.to_tensors().items()})
    for d in deltas[2:]:
        state = opt.apply(a, state, d)
        restored = opt.apply(b, restored, d)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_block_granularity_keeps_the_direction_inside_a_block():
    d = [torch.tensor([1.0, -3.0, 0.5]), torch.tensor([2.0, 2.0])]
    for granularity, parallel in (("tensor", True), ("coordinate", False)):
        t = [torch.zeros(3), torch.zeros(2)]
        opt = ServerOptimizer("adam", lr=1.0, granularity=granularity)
        opt.apply(t, opt.init(t), d)
        cosine = float(torch.nn.functional.cosine_similarity(t[0], d[0], dim=0))
        assert (abs(cosine - 1) < 1e-6) == parallel
    with pytest.raises(ValueError, match="granularity"):
        ServerOptimizer("adam", granularity="layer")


def test_global_granularity_keeps_the_direction_of_the_whole_update():
    """One v for every value: the step is the update scaled by one number, so a tensor whose update is small
    stays small (tensor-wise moments would give it as long a step as the others)."""
    d = [torch.tensor([1.0, -3.0, 0.5]), torch.tensor([0.02, -0.01])]
    steps = {}
    for granularity in ("global", "tensor"):
        t = [torch.zeros(3), torch.zeros(2)]
        opt = ServerOptimizer("adam", lr=1.0, granularity=granularity)
        opt.apply(t, opt.init(t), d)
        steps[granularity] = torch.cat(t)
    flat = torch.cat(d)
    assert float(torch.nn.functional.cosine_similarity(steps["global"], flat, dim=0)) == pytest.approx(1.0, abs=1e-6)
    ratio = steps["global"] / flat
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))  # one scale for every value
    assert steps["tensor"][3:].norm() > 10 * steps["global"][3:].norm()  # tensor-wise blows the small one up
    with pytest.raises(ValueError, match="warm start"):
        ServerOptimizer("adam", granularity="global", warm_start=True)


@pytest.mark.parametrize("granularity", ["tensor", "global"])
def test_masked_values_do_not_count_in_the_servers_mean_squares(granularity):
    """Under a selection mask the moving values step as the same values would with nothing pinned beside them:
    counting the pinned zeros in the mean square would lengthen their step by sqrt(all / movable)."""
    d = [torch.tensor([1.0, 0.0, -3.0, 0.0, 0.0, 0.0]), torch.tensor([0.5, 2.0])]
    masks = [torch.tensor([True, False, True, False, False, False]), None]
    assert movable_values([torch.zeros(6), torch.zeros(2)], masks) == [2, 2]
    assert movable_values([torch.zeros(6), torch.zeros(2)], [torch.ones(6), None]) is None  # noise scales pin none
    opt = ServerOptimizer("adam", lr=1.0, granularity=granularity)
    masked = [torch.zeros(6), torch.zeros(2)]
    state = opt.apply(masked, opt.init(masked), d, movable=[2, 2])
    alone = [torch.zeros(2), torch.zeros(2)]  # the same movable values, nothing pinned
    opt.apply(alone, opt.init(alone), [d[0][masks[0]], d[1]])
    assert torch.equal(masked[0][masks[0]], alone[0]) and torch.equal(masked[1], alone[1])
    assert not masked[0][~masks[0]].any() and state.step == 1
    unmasked = [torch.zeros(6), torch.zeros(2)]
    opt.apply(unmasked, opt.init(unmasked), d)  # counting the pinned zeros: a shorter v, a longer step
    assert float(unmasked[0][0]) > 1.2 * float(masked[0][0])


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_cosine_decay_shrinks_the_server_step_to_zero_over_the_run(name):
    """With decay_rounds R the r-th round moves the weights by lr (1 + cos(pi r / R)) / 2 times what a constant
    lr moves them, for the same state and update; the state's round counter carries the schedule."""
    gen = torch.Generator().manual_seed(0)
    deltas = [[torch.randn(6, generator=gen)] for _ in range(4)]
    constant, decayed = ServerOptimizer(name, lr=0.1), ServerOptimizer(name, lr=0.1, decay_rounds=4)
    assert [decayed.lr_at(r) for r in (0, 2, 4, 9)] == pytest.approx([0.1, 0.05, 0.0, 0.0])
    a, b = [torch.ones(6)], [torch.ones(6)]
    sa, sb = constant.init(a), decayed.init(b)
    for r, d in enumerate(deltas):
        before_a, before_b = a[0].clone(), b[0].clone()
        sa, sb = constant.apply(a, sa, d), decayed.apply(b, sb, d)
        factor = 0.5 * (1 + np.cos(np.pi * r / 4))
        assert torch.allclose(b[0] - before_b, factor * (a[0] - before_a), atol=1e-7)
    with pytest.raises(ValueError, match="decay_rounds"):
        ServerOptimizer("adam", decay_rounds=-1)


def test_a_beta1_ramp_rises_linearly_and_a_restored_state_continues_it():
    """beta1_start 0.5 over 5 rounds: the r-th round's first moment follows m <- b_r m + (1 - b_r) d with
    b_r = 0.5 + 0.1 r, so the first round moves as a constant beta1 0.5 would and the last as 0.9; the round
    counter in the state carries the ramp across a checkpoint."""
    gen = torch.Generator().manual_seed(1)
    deltas = [[torch.randn(4, generator=gen)] for _ in range(7)]
    ramp = ServerOptimizer("adam", lr=0.1, granularity="global", beta1_start=0.5, ramp_rounds=5)
    t = [torch.ones(4)]
    state, m = ramp.init(t), torch.zeros(4)
    for r, d in enumerate(deltas):
        beta1 = 0.5 + 0.1 * min(r, 4)
        m = beta1 * m + (1 - beta1) * d[0]
        state = ramp.apply(t, state, d)
        assert torch.allclose(state.buffers["m"][0], m, atol=1e-6)
    first = {}
    for name, opt in (("ramp", ramp), ("constant", ServerOptimizer("adam", lr=0.1, granularity="global", beta1=0.5))):
        x = [torch.ones(4)]
        opt.apply(x, opt.init(x), deltas[0])
        first[name] = x[0]
    assert torch.equal(first["ramp"], first["constant"])
    a = [torch.ones(4)]
    sa = ramp.init(a)
    for d in deltas[:2]:
        sa = ramp.apply(a, sa, d)
    b = [a[0].clone()]
    sb = type(sa).from_tensors({k: v.clone() for k, v in sa.to_tensors().items()})
    for d in deltas[2:]:
        sa, sb = ramp.apply(a, sa, d), ramp.apply(b, sb, d)
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError, match="adaptive"):
        ServerOptimizer("sgd", beta1_start=0.5, ramp_rounds=5)
    with pytest.raises(ValueError, match="rounds"):
        ServerOptimizer("adam", beta1_start=0.5)


def test_expected_update_square_matches_the_mean_square_of_personalized_steps():
    """Over many rounds of two clients' one-block steps on a linear loss, the blocks' mean d^2 equals what
    expected_update_square predicts from the true block energies |grad_b|^2 and the blocks drawn. (Blocks
    of many coordinates, as in a model: the steps' coherent part is then about 1/n_b of their noise.)"""
    gen = torch.Generator().manual_seed(0)
    grad = [torch.randn(n, generator=gen) * scale for n, scale in ((64, 1.0), (128, 0.3), (32, 2.0))]
    energy = np.array([float(g.square().sum()) for g in grad])
    sizes = np.array([64.0, 128.0, 32.0])
    pis = {0: np.array([0.6, 0.3, 0.1], np.float32), 1: np.array([0.2, 0.2, 0.6], np.float32)}
    weights, lr = {0: 0.7, 1: 0.3}, 0.5
    observed, predicted = np.zeros(3), np.zeros(3)
    for trial in range(2000):
        d = [torch.zeros_like(g) for g in grad]
        steps = []
        for client, pi in pis.items():
            for t in range(2):
                seed = 10_000 * trial + 100 * client + t
                pert, b = step_perturbation(seed, pi)
                z = [torch.zeros_like(g) for g in grad]
                add_directions_(z, [(seed, 1.0)], pert)
                g = sum(float((a * zi).sum()) for a, zi in zip(grad, z, strict=True))
                add_directions_(d, [(seed, -lr * g * weights[client])], pert)
                steps.append((weights[client], pi[b], b))
        observed += [float(x.square().mean()) for x in d]
        predicted += expected_update_square(energy, sizes, sizes, lr, 1, steps)
    assert np.allclose(observed, predicted, rtol=0.1)


def test_warm_start_sizes_a_blocks_first_step_by_what_its_probes_measured():
    """Without a warm start a block's first step is a full-size sign step whatever its probe measured; with
    one, a probe ten times weaker than expected moves its block far less than one as strong as expected."""
    d = [torch.full((4,), 1.0), torch.full((4,), 0.1), torch.zeros(4)]
    expected = [1.0, 1.0, 0.0]  # the third block was not probed this round
    moved = {}
    for warm in (False, True):
        opt = ServerOptimizer("adam", lr=1.0, granularity="tensor", warm_start=warm)
        t = [torch.zeros(4) for _ in d]
        state = opt.apply(t, opt.init(t), d, expected_square=expected)
        moved[warm] = [float(x.abs().mean()) for x in t]
        assert moved[warm][2] == 0 and float(state.buffers["v"][2]) == 0  # an unprobed block stays cold
    assert moved[False][0] == pytest.approx(moved[False][1], rel=1e-3)
    assert moved[True][0] > 5 * moved[True][1]
    assert moved[True][0] < moved[False][0]
    for name, granularity in (("sgd", None), ("adam", "coordinate")):
        with pytest.raises(ValueError, match="warm start"):
            ServerOptimizer(name, warm_start=True, **({"granularity": granularity} if granularity else {}))


def test_relative_steps_move_each_tensor_in_proportion_to_its_own_scale():
    """With relative steps a block-wise adam step moves a tensor of RMS 0.02 fifty times less than one of RMS 1
    (without, both by lr). An all-zero tensor (LoRA's B) is measured against the smallest nonzero scale (LoRA's
    A), not moved by a full absolute lr; only when every tensor is zero is the step absolute. sgd refuses the
    option."""
    d = [torch.tensor([1.0, -1.0, 1.0, -1.0])] * 3
    moved = {}
    for relative in (False, True):
        opt = ServerOptimizer("adam", lr=1e-2, granularity="tensor", relative=relative)
        t = [torch.full((4,), 1.0), torch.full((4,), 0.02), torch.zeros(4)]
        start = [x.clone() for x in t]
        opt.apply(t, opt.init(t), d)
        moved[relative] = [float((x - s).abs().mean()) for x, s in zip(t, start, strict=True)]
    assert moved[False] == pytest.approx([1e-2] * 3, rel=1e-3)
    assert moved[True] == pytest.approx([1e-2, 2e-4, 2e-4], rel=1e-3)
    opt, zero = ServerOptimizer("adam", lr=1e-2, granularity="tensor", relative=True), [torch.zeros(4)]
    opt.apply(zero, opt.init(zero), d[:1])
    assert float(zero[0].abs().mean()) == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(ValueError, match="relative steps need an adaptive"):
        ServerOptimizer("sgd", relative=True)


def test_zofed_s_default_server_step_does_not_follow_the_clients_lr():
    """zofed's default server (adam, one second moment, relative steps) normalizes the round's update: an update
    ten times larger (clients stepping at ten times the lr) moves the tensors by the same step, which the server lr
    alone sets; plain averaging moves them ten times as far. Why benchmarks/ranking.yaml tunes zofed's server lr."""
    default = get_method("zofed").server_default
    d = [torch.tensor([0.3, -1.0, 0.2, -0.5]), torch.tensor([1.0, 0.1])]
    moved = {}
    for name, lr, relative in (("zofed", default.lr, default.relative), ("sgd", 1.0, False)):
        for scale in (1.0, 10.0):
            opt = ServerOptimizer("adam" if name == "zofed" else "sgd", lr=lr, granularity=default.granularity,
                                  relative=relative)
            t = [torch.full((4,), 1.0), torch.full((2,), 0.5)]
            opt.apply(t, opt.init(t), [scale * x for x in d])
            moved[name, scale] = torch.cat([x.reshape(-1) for x in t])
    start = torch.cat([torch.full((4,), 1.0), torch.full((2,), 0.5)])
    assert torch.allclose(moved["zofed", 1.0], moved["zofed", 10.0], atol=1e-6)
    assert not torch.allclose(moved["zofed", 1.0], start)
    assert torch.allclose(moved["sgd", 10.0] - start, 10 * (moved["sgd", 1.0] - start))


def test_steps_relative_to_the_start_do_not_grow_with_the_tensor():
    """Measured against the current RMS a tensor that earlier rounds tripled takes a step three times as long, and
    a LoRA B grown past its A steps by its own scale; measured against the run's start both keep the step they
    started with (B: its A's starting scale). The option needs relative steps."""
    d = [torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([1.0, 1.0, -1.0, -1.0])]
    moved = {}
    for anchor in ("current", "start"):
        opt = ServerOptimizer("adam", lr=1e-2, granularity="tensor", relative=True, relative_to=anchor)
        start = [torch.full((4,), 0.02), torch.zeros(4)]  # LoRA's A and B as a run starts them
        state = opt.init(start)
        grown = [3 * start[0], torch.full((4,), 1.0)]  # the same tensors after rounds of noise
        before = [x.clone() for x in grown]
        opt.apply(grown, state.clone(), d)
        moved[anchor] = [float((x - b).abs().mean()) for x, b in zip(grown, before, strict=True)]
    assert moved["current"] == pytest.approx([6e-4, 1e-2], rel=1e-3)
    assert moved["start"] == pytest.approx([2e-4, 2e-4], rel=1e-3)
    with pytest.raises(ValueError, match="needs relative steps"):
        ServerOptimizer("adam", relative_to="start")
    with pytest.raises(ValueError, match="relative_to must be one of"):
        ServerOptimizer("adam", relative=True, relative_to="initial")


def test_the_floor_of_relative_steps_stays_at_the_starting_scale_when_a_zero_started_tensor_moves_first():
    """LoRA's B tensors start at zero. Once one of them has moved, a floor read from the tensors now would be its
    tiny RMS, and every other B would step by that: the floor is the smallest RMS a nonzero tensor started with,
    so a B that moves late steps at its A's scale as the first one did."""
    opt = ServerOptimizer("adam", lr=1e-2, granularity="tensor", relative=True)
    a, first_b, late_b = torch.full((4,), 0.02), torch.zeros(4), torch.zeros(4)
    state = opt.init([a, first_b, late_b])
    d = [torch.tensor([1.0, -1.0, 1.0, -1.0])] * 2 + [torch.zeros(4)]  # the late B gets no update in round 1
    state = opt.apply([a, first_b, late_b], state, d)
    assert float(first_b.abs().mean()) == pytest.approx(2e-4, rel=1e-3) and not late_b.any()
    opt.apply([a, first_b, late_b], state, [torch.zeros(4), torch.zeros(4), torch.tensor([1.0, -1.0, 1.0, -1.0])])
    assert float(late_b.abs().mean()) == pytest.approx(2e-4, rel=1e-2)  # not 2e-4 x 2e-4


def test_a_warm_started_server_round_moves_the_probed_blocks_by_less_than_full_steps():
    """In a real round the server passes each probed block's expected energy to the optimizer: without a warm
    start every moved block moves by about lr (rms over the block), with one by less, and the same blocks
    move."""
    ctx = toy_context()
    plan = FederationPlan("zofed", 4, 2, 3, lr=1e-2, eps=1e-2, run_seed=5, batch_size=8)
    moved = {}
    for warm in (False, True):
        server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                            ServerOptimizer("adam", 1e-2, granularity="tensor", warm_start=warm))
        round_plan, inbox = server.round_plan(0), RoundInbox()
        for client in (0, 1):
            uplink = ClientRole(ctx).train(server.downlink(round_plan, client), client, toy_clients()[client], 0)
            server.receive(inbox, round_plan, client, uplink)
        start = [t.clone() for t in server.tensors]
        server.aggregate(round_plan, inbox)
        moved[warm] = np.array([float((t - s).square().mean().sqrt()) for t, s in zip(server.tensors, start,
                                                                                       strict=True)])
    assert ((moved[False] > 0) == (moved[True] > 0)).all() and (moved[False] > 0).sum() >= 2
    assert np.allclose(moved[False][moved[False] > 0], 1e-2, rtol=0.05)  # tau trims blocks of tiny updates a little
    assert (moved[True] <= 1e-2 * (1 + 1e-3)).all() and moved[True].sum() < 0.95 * moved[False].sum()


def test_momentum_tilted_steps_are_rebuilt_exactly_from_the_momentum_sent():
    ctx = toy_context()
    plan = FederationPlan("zofed", 6, 2, 3, lr=1e-2, eps=1e-2, run_seed=3, batch_size=8,
                          sampling=BlockSampling(tilt=0.5))
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        ServerOptimizer("adam", 1e-2, granularity="tensor"))
    client = ClientRole(ctx)
    for round_id in range(2):  # the first round gives the server a non-zero first moment
        round_plan, inbox = server.round_plan(round_id), RoundInbox()
        for c in server.sample(round_id):
            server.receive(inbox, round_plan, c, client.train(server.downlink(round_plan, c), c, toy_clients()[c]))
        server.aggregate(round_plan, inbox)
    round_plan = server.round_plan(2)
    assert round_plan.tilt == 0.5
    start = [t.clone() for t in server.tensors]
    # client 5: with these streams client 4's three steps draw the same blocks tilted or not
    state = decode(server.downlink(round_plan, 5)).server_state
    tilt = MomentumTilt.from_flat(state[len(start):], start, 0.5)
    assert max(float(b.abs().max()) for b in tilt.buffers) > 0
    update, final = run_client(ctx, start, 5, toy_clients()[5], round_plan, state)
    rebuilt = torch.cat([r.reshape(-1) for r in rebuild(start, update, round_plan, state)])
    actual = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    untilted = torch.cat([r.reshape(-1) for r in rebuild(start, update, replace(round_plan, tilt=0.0),
                                                         state[:len(start)])])
    assert torch.equal(rebuilt, actual) and not torch.equal(untilted, actual)
    with pytest.raises(ValueError, match="momentum"):
        ServerRole(plan, start, None, ServerOptimizer("sgd"))


def test_tensor_blocks_cut_the_model_into_contiguous_runs_balanced_by_size():
    tensors = [torch.zeros(n) for n in (10, 10, 10, 10, 10, 10, 40)]
    assert tensor_blocks(tensors).tolist() == list(range(7))
    layout = tensor_blocks(tensors, 2)
    assert layout.tolist() == [0, 0, 0, 0, 0, 1, 1]  # 50 and 50 coordinates
    assert np.all(np.diff(tensor_blocks(tensors, 4)) >= 0)  # contiguous in model order
    assert block_sizes(tensors, layout=layout).tolist() == [50.0, 50.0]
    with pytest.raises(ValueError, match="7 trainable tensors"):
        tensor_blocks(tensors, 8)


def test_grouped_blocks_perturb_whole_runs_of_tensors_and_are_rebuilt_exactly():
    """With blocks=2 every step moves every tensor of the drawn run, scaled by 1/sqrt(pi_b); the server draws
    the same runs, rebuilds the update exactly and files the probes under the two blocks."""
    ctx = toy_context()
    plan = FederationPlan("zofed", 6, 2, 4, lr=1e-2, eps=1e-2, run_seed=3, batch_size=8,
                          sampling=BlockSampling(blocks=2))
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        ServerOptimizer("adam", 1e-2, granularity="tensor"))
    round_plan = server.round_plan(0)
    assert round_plan.blocks == 2 and server.method_state.stats.client_sums.shape == (6, 2)
    start = [t.clone() for t in server.tensors]
    layout = tensor_blocks(start, 2)
    downlink = server.downlink(round_plan, 1)
    pi = decode(downlink).server_state
    assert pi.shape == (2,)
    pert, b = step_perturbation(7, pi, layout=layout)
    assert [pert.moves(i) for i in range(len(start))] == (layout == b).tolist()
    update, final = run_client(ctx, start, 1, toy_clients()[1], round_plan, pi)
    assert_rebuilt_exactly(start, update, final, round_plan, pi)
    inbox = RoundInbox()
    server.receive(inbox, round_plan, 1, ClientRole(ctx).train(downlink, 1, toy_clients()[1], 0))
    server.aggregate(round_plan, inbox)
    assert server.method_state.stats.client_counts[1].sum() == 4 and server.method_state.stats.global_counts.sum() == 4
    with pytest.raises(ValueError, match="trainable tensors"):
        ServerRole(replace(plan, sampling=BlockSampling(blocks=len(start) + 1)), start, None,
                   ServerOptimizer("adam", 1e-2, granularity="tensor"))


def test_shared_seeds_couple_the_clients_draws_and_are_rebuilt_exactly():
    """With shared seeds two clients of a round step along the same seeds: under the same pi they draw the
    same blocks; under different pis each draws from its own, and the server still rebuilds each exactly."""
    ctx = toy_context()
    plan = FederationPlan("zofed", 6, 2, 6, lr=1e-2, eps=1e-2, run_seed=3, batch_size=8,
                          sampling=BlockSampling(shared_seeds=True))
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        ServerOptimizer("adam", 1e-2, granularity="tensor"))
    round_plan = server.round_plan(0)
    assert round_plan.shared_seeds == 1
    start = [t.clone() for t in server.tensors]
    others = list(range(1, len(start)))
    # client 2 leans on block 0
    server.method_state.stats.record(2, [0, 0, *others], [500.0, 600.0, *[1e-3] * len(others)])
    pis = {c: decode(server.downlink(round_plan, c)).server_state for c in (0, 1, 2)}
    updates = {c: run_client(ctx, start, c, toy_clients()[c], round_plan, pis[c]) for c in (0, 1, 2)}
    assert updates[0][0].base_seed == updates[1][0].base_seed == updates[2][0].base_seed
    draws = {c: [draw_block(derive_seed(updates[c][0].base_seed, t), pis[c]) for t in range(6)] for c in pis}
    assert draws[0] == draws[1] and draws[2] != draws[0]
    for c, (update, final) in updates.items():
        assert_rebuilt_exactly(start, update, final, round_plan, pis[c])
    private = replace(round_plan, shared_seeds=0)
    assert run_client(ctx, start, 1, toy_clients()[1], private, pis[1])[0].base_seed != updates[1][0].base_seed


def _round_of_contributions(num_clients: int, shared: bool):
    """One zofed round of `num_clients` clients with personal pis, as the server's contributions."""
    ctx = toy_context()
    plan = FederationPlan("zofed", num_clients, num_clients, 3, lr=1e-2, eps=1e-2, run_seed=5, batch_size=8,
                          sampling=BlockSampling(shared_seeds=shared))
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        ServerOptimizer("adam", 1e-2, granularity="tensor"))
    local = server.round_plan(0)
    start = [t.clone() for t in server.tensors]
    n = len(start)
    for c in range(num_clients):  # each client leans on its own blocks, so the pis differ
        server.method_state.stats.record(c, list(range(n)), [float(1 + (b * 7 + c) % 5) for b in range(n)])
    pis = {c: server.send_state(local, c) for c in range(num_clients)}
    clients = toy_clients(num_clients, size=120)
    updates = [run_client(ctx, start, c, clients[c], local, pis[c])[0] for c in range(num_clients)]
    return start, local, pis, updates, [server.contribution(u, local) for u in updates]


@pytest.mark.parametrize("shared", [True, False])
def test_mean_regenerates_each_shared_seed_once_per_tensor(shared):
    """With shared seeds the mean sums coefficients per (seed, tensor) across clients before regenerating: the
    noise made does not grow with the clients. With private seeds every step's noise is made on its own (all of a
    tensor's seeds in one call), and the result equals the sum of the clients' exact rebuilds."""
    from unittest import mock

    from zofed.fl.aggregate import WeightedMean
    from zofed.zo.noise import NoiseSource

    start, local, pis, updates, contributions = _round_of_contributions(6, shared)
    with mock.patch.object(NoiseSource, "rows", autospec=True, side_effect=NoiseSource.rows) as rows:
        mean = WeightedMean().update(start, contributions, {})[0]
    steps = local.local_steps * len(updates)
    total = sum(u.num_examples for u in updates)
    expected = [torch.zeros_like(t) for t in start]
    for u in updates:
        for e, r in zip(expected, rebuild(start, u, local, pis[u.client_id]), strict=True):
            e.add_(r, alpha=u.num_examples / total)
    flat = torch.cat([m.reshape(-1) for m in mean])
    flat_expected = torch.cat([e.reshape(-1) for e in expected])
    assert flat_expected.norm() > 0
    assert float((flat - flat_expected).norm() / flat_expected.norm()) <= 1e-5
    # one regeneration (per chunk) for each distinct (seed, drawn block): shared seeds make clients coincide
    pairs = {(seed, b) for u in updates for seed, b in zip(step_seeds(u), draw_blocks(step_seeds(u), pis[u.client_id]),
                                                           strict=True)}
    made = sum(len(call.args[1]) for call in rows.call_args_list)  # noise rows made, one per seed and chunk
    assert made == sum(len(list(chunk_bounds(start[b].numel()))) for _, b in pairs)
    # ... and all of a tensor chunk's seeds in one call
    assert rows.call_count == sum(len(list(chunk_bounds(start[b].numel()))) for b in {b for _, b in pairs})
    assert (len(pairs) < steps) if shared else (len(pairs) == steps)
