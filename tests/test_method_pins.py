"""Pins: the final trainable tensors of a 3-round tiny-model run of every method and ablation.

The restructuring of methods, server optimizers, aggregators and the round loop must not move any run. Each
pin is a fingerprint of the run's update (final minus starting tensors): its sum, its norm and four fixed random
projections, compared with a relative tolerance far below any real change of algorithm (a changed seed, step
or server rule moves them by percent) but above float summation order on another CPU. A change that is meant to
move a run (a bug fix) says so in its commit and rewrites the pin: `python tests/test_method_pins.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from toy_federation import tiny_federated_config  # noqa: E402

from zofed.run.federated import run_federated  # noqa: E402

# name -> overrides of the tiny federated run (tests/toy_federation.py)
RUNS = {
    "zofed": [],
    "zofed-size-blocks": ["federation.sampling.mix=1.0"],
    "zofed-tilt": ["federation.sampling.tilt=0.5"],
    "zofed-blocks2": ["federation.sampling.blocks=2"],
    "zofed-shared": ["federation.sampling.shared_seeds=true"],
    "zofed-cosine": ["federation.server_optimizer.decay=cosine"],
    "zofed-warm": ["federation.server_optimizer.warm_start=true"],
    "zofed-no-personal": ["federation.sampling.personalize=false"],
    "zofed-no-momentum": ["federation.server_optimizer.name=sgd"],
    "zofed-yogi": ["federation.server_optimizer.name=yogi"],
    "zofed-amsgrad-coordinate": ["federation.server_optimizer.name=amsgrad",
                                 "federation.server_optimizer.granularity=coordinate"],
    "zo-seeds": ["federation.method=zo-seeds"],
    "zo-seeds-q2-gaussian": ["federation.method=zo-seeds", "zo.queries=2", "zo.noise=gaussian"],
    "decomfl": ["federation.method=decomfl"],
    "fedkseed": ["federation.method=fedkseed", "federation.pool_size=8"],
    "fedmezo": ["federation.method=fedmezo"],
    "fedavg": ["federation.method=fedavg"],
    "fedadam": ["federation.method=fedadam", "federation.server_optimizer.lr=0.01"],
}

# name -> [sum, norm, projection 0..3] of (final - start), written by running this file
PINS = {
    'zofed': [0.081013426, 0.089152558, -0.13347001, -0.0021501941, 0.015380396, -0.20461715],
    'zofed-size-blocks': [-0.034432278, 0.12129502, -0.099550013, -0.048677121, -0.047066984, -0.15572236],
    'zofed-tilt': [0.08143615, 0.089624845, -0.13399521, -0.002008791, 0.015627759, -0.2058698],
    'zofed-blocks2': [0.20353857, 0.14649121, -0.025076994, 0.010207995, -0.10536271, -0.1298187],
    'zofed-shared': [0.00098743383, 0.11240713, -0.17992119, 0.099675196, -0.078066968, 0.020806942],
    'zofed-cosine': [0.073488536, 0.082264074, -0.11477179, 0.0052194468, 0.0072234011, -0.21043456],
    'zofed-warm': [0.0693538, 0.061930646, -0.063037192, 0.034232119, 0.0070325679, -0.18831959],
    'zofed-no-personal': [-0.10070088, 0.14686041, 0.021970624, 0.21149026, -0.1220146, -0.010713055],
    'zofed-no-momentum': [-0.0010531011, 0.0041037941, 0.0070916697, 0.0033806173, 0.0032405777, -0.00069364369],
    'zofed-yogi': [0.041861684, 0.064917825, -0.086924441, 0.063814322, 0.078080234, -0.12358007],
    'zofed-amsgrad-coordinate': [0.041748364, 0.064949802, -0.08699614, 0.063740955, 0.07819345, -0.12376956],
    'zo-seeds': [0.013891591, 0.36172208, -0.20118145, 0.35486453, -0.49428679, -0.023185349],
    'zo-seeds-q2-gaussian': [0.17039759, 0.24632602, 0.019869432, 0.22886056, -0.012021315, -0.30700064],
    'decomfl': [-0.63036269, 0.54168163, -1.1827153, -0.9404495, 0.17432831, 0.19819531],
    'fedkseed': [0.63907313, 0.30112392, 0.33743077, 0.14142379, 0.19606967, -0.31839535],
    'fedmezo': [0.013887592, 0.36172292, -0.20117875, 0.35486197, -0.49428646, -0.023187449],
    'fedavg': [-0.045045177, 0.045920437, 0.019371526, -0.062857503, 0.091359976, 0.018926775],
    'fedadam': [-0.81020931, 0.50258414, 0.033685559, -0.49969445, 0.44545312, 0.075435775],
}


def fingerprint(ws: Path, out: Path, overrides: list[str]) -> list[float]:
    results_dir = out
    config = tiny_federated_config(ws, results_dir, *overrides)
    run_federated(config, show_progress=False)
    start_dir = out.parent / f"{out.name}-start"
    start = tiny_federated_config(ws, start_dir, *overrides, "federation.rounds=1")
    from zofed.run.setup import build

    setup = build(start)
    initial = setup.trainable.state_dict()
    final = load_file(str(out / "final" / "trainable.safetensors"))
    delta = torch.cat([(final[k].double() - initial[k].double()).reshape(-1) for k in sorted(final)])
    rng = np.random.default_rng(1234)
    projections = torch.from_numpy(rng.standard_normal((4, delta.numel())))
    return [float(delta.sum()), float(delta.norm()), *(float(p @ delta) for p in projections)]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_method_ends_where_it_is_pinned(name, tiny_workspace, tmp_path):
    got = fingerprint(tiny_workspace, tmp_path / name, RUNS[name])
    assert got[1] > 0, f"{name} did not move the model"
    assert name in PINS, f"no pin for {name}: run `python tests/test_method_pins.py` and paste its output"
    assert np.allclose(got, PINS[name], rtol=1e-4, atol=1e-9), f"{name}: {got} != pinned {PINS[name]}"


if __name__ == "__main__":  # print the pins of the code as it is now
    import tempfile
    from hashlib import sha256

    from conftest import _write_dataset

    from zofed.models.tiny import tiny_causal_lm

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        tiny = tiny_causal_lm(seed=1)
        tiny.model.save_pretrained(ws / "model")
        tiny.tokenizer.save_pretrained(ws / "model")
        _write_dataset(ws / "train.jsonl", 200, 0)
        _write_dataset(ws / "test.jsonl", 60, 1)
        print("PINS = {")
        for name in RUNS:
            values = fingerprint(ws, ws / "runs" / name, RUNS[name])
            final = (ws / "runs" / name / "final" / "trainable.safetensors").read_bytes()
            print(f"    {name!r}: [{', '.join(f'{v:.8g}' for v in values)}],")
            print(f"{name} sha256 {sha256(final).hexdigest()}", file=sys.stderr)  # exact, for this machine
        print("}")
