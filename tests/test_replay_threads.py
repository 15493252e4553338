"""The server step gives the same bits at any thread count, so `zofed replay` on a machine with another number of
cores rebuilds the run's model exactly; a run whose noise weights come from forward passes is refused.

torch splits a reduction over more than 32K values among its threads, so the tensors here are larger than that:
the toy runs train a tiny model whose tied embedding holds 4096 x 32 values."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.fl.aggregate import Contribution, CoordinateMedian, TrimmedMean, WeightedMean, clip_update
from zofed.fl.methods.hiso import SecondMoment
from zofed.fl.personal import MomentumTilt
from zofed.fl.protocol import ClientUpdate
from zofed.fl.server_opt import ServerOptimizer, make_server_optimizer
from zofed.models.tiny import tiny_causal_lm
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run

THREADS = (3, 4, 7)  # against one thread
SIZE = 200_003  # values a probed tensor holds: several of torch's 32K-value grains, and an odd tail


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bits(result) -> list[np.ndarray]:
    """Every number a reduction's result holds, flattened to arrays (tensors, arrays, floats, lists of them)."""
    if isinstance(result, torch.Tensor):
        return [result.detach().cpu().numpy().copy()]
    if isinstance(result, np.ndarray | float | int):
        return [np.array(result).copy()]
    if isinstance(result, ClientUpdate):
        return _bits(result.numbers)
    return [a for item in result for a in _bits(item)]


def _same_at_every_thread_count(reduce: Callable[[], object]) -> list[int]:
    """The thread counts at which `reduce()` gives other bits than at one thread."""
    with threads(1):
        reference = _bits(reduce())
    differ = []
    for n in THREADS:
        with threads(n):
            got = _bits(reduce())
        if len(got) != len(reference) or any(a.tobytes() != b.tobytes() for a, b in zip(got, reference, strict=True)):
            differ.append(n)
    return differ


def _tensors(count: int = 3, seed: int = 0, scale: float = 0.01) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SIZE + k, generator=g) * scale for k in range(count)]


@dataclass(frozen=True)
class Recorder:
    """A last link of a server optimizer's chain that keeps each tensor's step scale (a float64: the trust ratio's
    RMS reaches it before any float32 rounding)."""

    scales: list[list[float]]
    extras: frozenset[str] = frozenset()

    def init(self, tensors):
        return {}

    def update(self, steps, buffers, tensors, step, extras):
        self.scales.append([s.scale for s in steps])
        return steps


def _server_step(name: str, **settings) -> Callable[[], object]:
    """Three rounds of a server optimizer on fresh copies of the same tensors and updates: its tensors, its state
    and every step's scale."""
    start, deltas = _tensors(seed=1, scale=1.0), [_tensors(seed=2 + r) for r in range(3)]

    def run():
        tensors, scales = [t.clone() for t in start], []
        chain = make_server_optimizer(name, 0.01, **settings)
        optimizer = ServerOptimizer(chain.name, (*chain.pieces, Recorder(scales)))
        state = optimizer.init(tensors)
        for delta in deltas:
            extras = {"expected_square": [1e-4] * len(tensors)} if settings.get("warm_start") else {}
            state = optimizer.apply(tensors, state, delta, **extras)
        return [tensors, *state.buffers.values(), np.array(scales)]

    return run


SERVER_STEPS = {
    "adam tensor": dict(granularity="tensor"),
    "adam global, relative": dict(granularity="global", relative=True),
    "adam tensor, relative": dict(granularity="tensor", relative=True),
    "adam tensor, relative to start": dict(granularity="tensor", relative=True, relative_to="start"),
    "adam tensor, warm start": dict(granularity="tensor", warm_start=True),
    "adam coordinate": dict(granularity="coordinate"),
}


@pytest.mark.parametrize("case", sorted(SERVER_STEPS))
def test_each_server_optimizer_step_is_the_same_at_every_thread_count(case):
    assert _same_at_every_thread_count(_server_step("adam", **SERVER_STEPS[case])) == []


def _contributions() -> list[Contribution]:
    return [Contribution(i, 10 + i, _tensors(seed=10 + i), []) for i in range(5)]


@pytest.mark.parametrize("aggregator", [WeightedMean(), TrimmedMean(trim=0.2), CoordinateMedian()],
                         ids=lambda a: a.name)
def test_each_aggregator_is_the_same_at_every_thread_count(aggregator):
    contributions = _contributions()
    like = contributions[0].dense
    assert _same_at_every_thread_count(lambda: aggregator.update(like, contributions, {})[0]) == []


def test_clipping_hiso_and_the_tilt_reduce_alike_at_every_thread_count():
    dense = torch.cat(_tensors(seed=20)).numpy()
    update = ClientUpdate(0, 3, np.zeros(0, np.uint64), 7, np.zeros((1, 1), np.float32), 5, {}, dense=dense)
    assert _same_at_every_thread_count(lambda: clip_update(update, 0.5)[0]) == []  # the bound is below its norm
    k = [t.abs() + 1e-3 for t in _tensors(seed=21)]
    assert _same_at_every_thread_count(lambda: SecondMoment(k).precondition()) == []
    flat = torch.cat(_tensors(seed=22)).numpy()
    tilt = MomentumTilt.from_flat(flat, _tensors(seed=22), 0.5)
    assert _same_at_every_thread_count(tilt.rms) == []


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """The tiny Llama with a 4096-word vocabulary: its tied embedding (131072 values) is trained with the rest."""
    root = tmp_path_factory.mktemp("wide") / "model"
    tiny = tiny_causal_lm(vocab_size=4096, seed=1)
    tiny.model.save_pretrained(root)
    tiny.tokenizer.save_pretrained(root)
    return root


# Every step of these moves every tensor, the embedding included (zofed's one-block steps may leave it alone), along
# Gaussian noise: a Rademacher update of four steps takes 16 values, whose squares sum alike in any order. Before
# the server's reductions took a fixed order, both replays at three threads missed the run's model.
RUNS = {
    "zo-seeds": ["federation.method=zo-seeds", "federation.server_optimizer.name=adam",
                 "federation.server_optimizer.granularity=tensor", "zo.noise=gaussian"],
    "hiso": ["federation.method=hiso", "federation.server_optimizer.name=adam",
             "federation.server_optimizer.granularity=tensor", "zo.noise=gaussian"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_at_one_thread_replays_bit_for_bit_at_three(name, tiny_workspace, wide_model, tmp_path):
    out = tmp_path / name
    config = tiny_federated_config(tiny_workspace, out, f"model.name={wide_model}", "trainable.mode=all",
                                   *RUNS[name])
    run_federated(config, show_progress=False)  # at one thread (conftest)
    with threads(3):
        done = replay_run(out)
    assert done.matches, f"{name}: replayed at 3 threads, off by up to {done.max_abs_difference:.3g}"


def test_a_run_with_feature_shaped_noise_is_refused_with_the_reason(tiny_workspace, tmp_path):
    out = tmp_path / "features"
    config = tiny_federated_config(tiny_workspace, out, "zo.precondition=features", "federation.rounds=1")
    run_federated(config, show_progress=False)
    with pytest.raises(ConfigError, match="zo.precondition=features run: its noise weights come from forward passes"):
        replay_run(out)
    shown = CliRunner().invoke(app, ["replay", str(out)])
    assert shown.exit_code != 0 and "thread count" in shown.output
