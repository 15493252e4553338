"""The ZO engine on small tensors: seeded noise, perturb/restore, the estimator, optimizers and their state."""

import gc
import math

import pytest
import torch

from zofed.zo import noise
from zofed.zo.noise import CHUNK, NoiseSource, chunk_bounds, derive_seed
from zofed.zo.optim import OPTIMIZER_NAMES, OptState, learning_rate, magnitude_masks, make_optimizer
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.step import NonFiniteLossError, replay_steps, zo_step


def noise_like(tensor: torch.Tensor, seed: int, tensor_index: int, kind: str) -> torch.Tensor:
    """The whole perturbation of one tensor as a dense tensor, chunk by chunk as the engine makes it."""
    source = NoiseSource(kind)
    out = torch.empty(tensor.numel(), dtype=torch.float32)
    for _, start, end in chunk_bounds(tensor.numel()):
        out[start:end] = source.chunk(seed, tensor_index, start, end - start)
    return out.view_as(tensor)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    # One tensor spans several noise chunks so chunk seeding is exercised.
    big = torch.randn(CHUNK * 2 + 123, generator=g) * 0.05
    return [big, torch.randn(300, generator=g), torch.randn(7, generator=g)]


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_same_seed_regenerates_same_noise_and_other_seeds_differ(kind):
    t = torch.zeros(CHUNK + 1000)
    a, b = noise_like(t, 11, 0, kind), noise_like(t, 11, 0, kind)
    assert torch.equal(a, b)
    assert not torch.equal(a, noise_like(t, 12, 0, kind))
    assert not torch.equal(a, noise_like(t, 11, 1, kind))  # another tensor index, another stream
    assert abs(float(a.mean())) < 0.01 and abs(float(a.std()) - 1.0) < 0.01
    if kind == "rademacher":
        assert set(a.unique().tolist()) == {-1.0, 1.0}


def test_rademacher_scale_is_exact_and_signs_do_not_depend_on_scale():
    src = NoiseSource("rademacher")
    plus = src.chunk(5, 0, 0, 1000, 1e-3).clone()
    minus = src.chunk(5, 0, 0, 1000, -2e-3).clone()
    assert set(plus.abs().unique().tolist()) == {torch.tensor(1e-3).item()}
    assert torch.equal(torch.sign(plus), -torch.sign(minus))


def test_derive_seed_is_deterministic_and_spreads():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
    seeds = {derive_seed(0, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_perturb_then_restore_returns_the_parameters(kind):
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    masks = [None, torch.arange(300) % 3 == 0, None]
    pert = Perturbation(kind=kind, scales=[1.0, 0.5, 2.0], masks=masks)
    eps = 1e-3
    add_directions_(tensors, [(42, eps)], pert)
    assert (tensors[0] - before[0]).abs().max() > 0.5 * eps  # it really moved
    assert torch.equal(tensors[1][~masks[1]], before[1][~masks[1]])  # masked coordinates never move
    add_directions_(tensors, [(42, -2 * eps)], pert)
    add_directions_(tensors, [(42, eps)], pert)
    err = max(float((t - b).abs().max()) for t, b in zip(tensors, before, strict=True))
    assert err <= 1e-6


def test_block_scales_scale_each_tensor():
    tensors = [torch.zeros(500), torch.zeros(500)]
    add_directions_(tensors, [(3, 1.0)], Perturbation(scales=[1.0, 0.25]))
    assert torch.allclose(tensors[0].abs(), torch.ones(500))
    assert torch.allclose(tensors[1].abs(), torch.full((500,), 0.25))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_estimate_aligns_with_true_gradient_of_smooth_function(kind):
    d = 20
    g = torch.Generator().manual_seed(1)
    a = torch.randn(d, d, generator=g)
    a = a @ a.T / d + torch.eye(d)
    x = torch.randn(d, generator=g, dtype=torch.float64).float()

    def f(v):
        return float(torch.sin(v).sum() + 0.5 * v @ a @ v)

    true_grad = torch.cos(x) + a @ x
    eps, n = 1e-3, 3000
    estimate = torch.zeros(d)
    for s in range(n):
        z = noise_like(x, s, 0, kind)
        estimate += (f(x + eps * z) - f(x - eps * z)) / (2 * eps) * z
    cosine = float(torch.nn.functional.cosine_similarity(estimate, true_grad, dim=0))
    assert cosine > 0.9


def _quadratic_problem():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(30, 30, generator=g)
    a = a @ a.T / 30 + torch.eye(30)
    return a, torch.randn(30, generator=g)


LRS = {"mezo": 2e-3, "sparse-mezo": 2e-3, "zo-sgd-momentum": 3e-4, "zo-adam": 1e-2, "zo-adamu": 1e-2}


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_lowers_a_quadratic(name):
    a, x0 = _quadratic_problem()
    x = x0.clone()
    opt = make_optimizer(name, **({"density": 0.75, "mask_interval": 10} if name == "sparse-mezo" else {}))
    state = opt.init([x])
    for t in range(300):
        state, _ = zo_step([x], lambda: float(0.5 * x @ a @ x), opt, state, seed=t, eps=1e-3, lr=LRS[name])
    assert float(0.5 * x @ a @ x) < 0.6 * float(0.5 * x0 @ a @ x0)
    assert state.step == 300


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
@pytest.mark.parametrize("queries", [1, 3])
def test_replay_from_seeds_and_scalars_rebuilds_the_update(name, queries):
    """What a server does: from the start tensors, seeds and scalars alone, rebuild the client's update."""
    tensors = _tensors(3)
    start = [t.clone() for t in tensors]
    weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(tensors)]

    def loss():
        return float(sum((torch.tanh(t) * w).sum() for t, w in zip(tensors, weights, strict=True)))

    opt = make_optimizer(name)
    state = opt.init(tensors)
    replay_state = opt.init(start)
    records, lrs = [], []
    for t in range(4):
        lr = learning_rate(t, 1e-3, "linear", total=4)
        state, record = zo_step(tensors, loss, opt, state, seed=100 + t, eps=1e-3, lr=lr, queries=queries)
        records.append(record)
        lrs.append(lr)
    rebuilt = [t.clone() for t in start]
    replay_steps(rebuilt, records, opt, replay_state, lrs)
    client_update = torch.cat([(t - s) for t, s in zip(tensors, start, strict=True)])
    server_update = torch.cat([(r - s) for r, s in zip(rebuilt, start, strict=True)])
    rel = float((client_update - server_update).norm() / client_update.norm())
    assert rel <= 1e-4  # the client's perturb/restore round trips add fp32 rounding the replay does not
    assert len(records[0].grads) == queries


@pytest.mark.parametrize("name", ["zo-adam", "zo-adamu", "sparse-mezo", "zo-sgd-momentum"])
def test_state_round_trip_gives_bit_identical_continuation(name):
    a, x0 = _quadratic_problem()
    opt = make_optimizer(name)

    def run(x, state, steps):
        for t in steps:
            state, _ = zo_step([x], lambda: float(0.5 * x @ a @ x), opt, state, seed=t, eps=1e-3, lr=1e-3)
        return state

    x = x0.clone()
    state = run(x, opt.init([x]), range(5))
    saved_x, saved = x.clone(), OptState.from_tensors({k: v.clone() for k, v in state.to_tensors().items()})
    run(x, state, range(5, 10))
    resumed = saved_x.clone()
    run(resumed, saved, range(5, 10))
    assert torch.equal(x, resumed)


def test_non_finite_loss_restores_parameters_and_raises():
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    opt = make_optimizer("mezo")
    with pytest.raises(NonFiniteLossError):
        zo_step(tensors, lambda: float("nan"), opt, opt.init(tensors), seed=1, eps=1e-3, lr=1.0)
    assert max(float((t - b).abs().max()) for t, b in zip(tensors, before, strict=True)) <= 1e-6


def test_bad_optimizer_and_schedule_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown ZO optimizer 'adam'"):
        make_optimizer("adam")
    with pytest.raises(ValueError, match="bad hyperparameters for mezo"):
        make_optimizer("mezo", momentum=0.9)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate(0, 1.0, "exp")


def test_learning_rate_schedules():
    assert learning_rate(0, 1.0, "constant", 10, warmup=2) == 0.5
    assert learning_rate(5, 1.0, "constant", 10) == 1.0
    assert math.isclose(learning_rate(5, 1.0, "linear", 10), 0.5)
    assert math.isclose(learning_rate(10, 1.0, "cosine", 10), 0.0, abs_tol=1e-12)


def test_magnitude_masks_keep_the_requested_fraction():
    t = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    (small,) = magnitude_masks([t], 0.25, keep="smallest")
    (large,) = magnitude_masks([t], 0.25, keep="largest")
    assert abs(float(small.float().mean()) - 0.25) < 0.01 and abs(float(large.float().mean()) - 0.25) < 0.01
    assert float(t[small].abs().max()) <= float(t[large].abs().min())


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
@pytest.mark.parametrize("queries", [1, 2])
def test_steps_from_a_clean_copy_are_bit_identical_to_their_replay(name, queries):
    """With master weights the client's update is exactly what a server rebuilds from seeds and scalars."""
    tensors = _tensors(5)
    start = [t.clone() for t in tensors]
    clean = [t.clone() for t in tensors]
    weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(tensors)]

    def loss():
        return float(sum((torch.tanh(t) * w).sum() for t, w in zip(tensors, weights, strict=True)))

    opt = make_optimizer(name)
    state, replay_state = opt.init(clean), opt.init(start)
    records = []
    for t in range(4):
        state, record = zo_step(tensors, loss, opt, state, seed=t, eps=1e-3, lr=1e-3, queries=queries, clean=clean)
        records.append(record)
    replay_steps(start, records, opt, replay_state, [1e-3] * 4)
    assert all(torch.equal(t, c) for t, c in zip(tensors, clean, strict=True))
    assert all(torch.equal(t, s) for t, s in zip(tensors, start, strict=True))


@pytest.mark.parametrize("estimator", ["central", "forward"])
@pytest.mark.parametrize("name", ["mezo", "zo-adamu"])
def test_a_small_step_from_a_clean_copy_makes_all_its_noise_in_one_pass_and_moves_the_same_bits(
        monkeypatch, estimator, name):
    """Small trainable tensors: one `words_of_seeds` pass per tensor serves both the perturbations and the update,
    and the step moves the weights bit for bit as one that hashes every query's noise each time it reads it."""
    from zofed.zo import step as step_module

    calls = {"words_of_seeds": 0}

    def counting(fn: str):
        original = getattr(noise, fn)

        def counted(*args, **kwargs):
            calls[fn] += 1
            return original(*args, **kwargs)
        return counted

    for fn in list(calls):
        monkeypatch.setattr(noise, fn, counting(fn))

    def run(cache_limit: int) -> list[torch.Tensor]:
        monkeypatch.setattr(step_module, "KEPT_NOISE_VALUES", cache_limit)
        gen = torch.Generator().manual_seed(0)
        x, target = [torch.randn(300, generator=gen), torch.randn(40, generator=gen)], torch.randn(300, generator=gen)
        clean, opt = [t.clone() for t in x], make_optimizer(name)
        state = opt.init(clean)
        for t in range(3):
            pert = Perturbation(scales=[1.0, 0.0 if t == 1 else 2.0])  # tensor 1 stands still at step 1
            state, _ = zo_step(x, lambda: float(((x[0] - target) ** 2).sum() + x[1].sum()), opt, state, seed=t,
                               eps=1e-2, lr=1e-3, queries=4, perturbation=pert, clean=clean, estimator=estimator)
        return clean

    cached = run(step_module.KEPT_NOISE_VALUES)
    assert calls == {"words_of_seeds": 2 + 1 + 2}  # the prefetches, one per moving tensor and step; no read hashes
    regenerated = run(0)
    assert calls["words_of_seeds"] > 5
    assert all(torch.equal(a, b) for a, b in zip(cached, regenerated, strict=True))


@pytest.mark.parametrize("exact", [False, True])
def test_the_forward_estimator_shares_one_centre_pass_and_restores_the_weights(exact):
    """q one-sided queries around one centre: q + 1 loss evaluations instead of 2 q, each scalar is
    (L(x + eps u) - L(x)) / eps, and with lr 0 the weights come back (exactly from a clean copy)."""
    from zofed.zo.optim import MeZO
    from zofed.zo.perturb import Perturbation, add_directions_
    from zofed.zo.prefix import forward_equivalents

    gen = torch.Generator().manual_seed(0)
    target = [torch.randn(300, generator=gen), torch.randn(40, generator=gen)]
    x = [torch.zeros(300), torch.zeros(40)]
    calls = []

    def loss() -> float:
        calls.append(1)
        return float(sum(((a - b) ** 2).sum() for a, b in zip(x, target, strict=True)))

    start = [t.clone() for t in x]
    clean = [t.clone() for t in x] if exact else None
    state, record = zo_step(x, loss, MeZO(), MeZO().init(x), seed=3, eps=1e-2, lr=0.0, queries=3, clean=clean,
                            estimator="forward")
    assert len(calls) == 3 + 1 and forward_equivalents(1.0, 3, "forward") == 4.0
    for t, s in zip(x, start, strict=True):
        assert torch.equal(t, s) if exact else torch.allclose(t, s, atol=1e-6)
    centre = float(sum((b ** 2).sum() for b in target))
    for j, g in enumerate(record.grads):
        probe = [t.clone() for t in start]
        add_directions_(probe, [(record.query_seeds()[j], 1e-2)], Perturbation())
        plus = float(sum(((a - b) ** 2).sum() for a, b in zip(probe, target, strict=True)))
        assert g == pytest.approx((plus - centre) / 1e-2, rel=1e-4)
    with pytest.raises(ValueError, match="unknown ZO estimator"):
        zo_step(x, loss, MeZO(), MeZO().init(x), seed=3, eps=1e-2, lr=0.0, estimator="backward")


def _live_tensor_bytes() -> int:
    """The bytes of every tensor memory alive in the process (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(), not isinstance: some module proxies warn on __class__
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_an_in_place_step_holds_nothing_that_grows_with_the_model_through_its_forward_passes(monkeypatch):
    """Beyond inference, an in-place step holds its noise source's fixed scratch during the loss evaluations:
    nothing proportional to the trainable tensors (a word cache held 1/32 of their bytes through every pass)."""
    monkeypatch.setattr(noise, "CHUNK", 1024)

    def held_during_loss(numel: int) -> int:
        tensors = [torch.zeros(numel), torch.zeros(300)]
        opt = make_optimizer("mezo")
        before, held = _live_tensor_bytes(), []

        def loss() -> float:
            held.append(_live_tensor_bytes() - before)
            return float(tensors[0][0])

        zo_step(tensors, loss, opt, opt.init(tensors), seed=3, eps=1e-3, lr=1e-2)
        return max(held)

    small, large = held_during_loss(1024 * 2), held_during_loss(1024 * 64)
    assert large == small
    assert small <= 4 * 1024 * 2  # the chunk's floats plus its words and the hash's scratch (1/32 each)
