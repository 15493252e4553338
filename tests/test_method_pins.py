"""Pins: the final trainable tensors of a 3-round tiny-model run of every method and ablation.

A restructuring of methods, server optimizers, aggregators or the round loop must not move any run. On a machine
whose float arithmetic matches the one the pins were written on (same kernels: the fingerprint of one tiny
forward pass says so), the final tensors must be bit-identical (sha256). Elsewhere a last-bit difference in a
kernel is amplified by adaptive steps (coordinate-wise Adam turns a near-zero coordinate's sign into a full
step), so there each run's update (final minus start) is compared by its sum, norm and four fixed random
projections within 1%: a changed seed stream, step rule or server rule still moves them by more. A change
that is meant to move a run (a bug fix) says so in its commit and rewrites the pins:
`.venv/bin/python tests/test_method_pins.py`.
"""

from __future__ import annotations

import sys
from hashlib import sha256
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
    "hiso": ["federation.method=hiso"],
    "fedkseed": ["federation.method=fedkseed", "federation.pool_size=8"],
    "fedmezo": ["federation.method=fedmezo"],
    "fedavg": ["federation.method=fedavg"],
    "fedadam": ["federation.method=fedadam", "federation.server_optimizer.lr=0.01"],
}

# name -> [sum, norm, projection 0..3] of (final - start), written by running this file
# the machine the pins were written on, and the sha256 of each run's final/trainable.safetensors there
ARITHMETIC = 'f96395c3e4b7cfd054c0975651485e5ea2414a17c2f5a0828068345e52be6ee5'
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
    'hiso': [-0.6258217, 0.54119694, -1.1873804, -0.93759977, 0.16956811, 0.20548502],
    'fedkseed': [-0.88022032, 0.45565372, -0.26684381, -0.46171199, -0.71419119, -0.38281836],
    'fedmezo': [0.013887592, 0.36172292, -0.20117875, 0.35486197, -0.49428646, -0.023187449],
    'fedavg': [-0.045045177, 0.045920437, 0.019371526, -0.062857503, 0.091359976, 0.018926775],
    'fedadam': [-0.81020931, 0.50258414, 0.033685559, -0.49969445, 0.44545312, 0.075435775],
}
EXACT = {
    'zofed': '0d6af3d009fadf4df576118ec2d9f514834336b04229f27b7a87bf082a24be22',
    'zofed-size-blocks': '443f9daa49ab9377e840397a054f22062c6da90ea241fb1fb14062fc8f6b3036',
    'zofed-tilt': '93ee3c3aa7951651a3c993d231ec47cb65f93aad9b68c24ae468428610e10aaf',
    'zofed-blocks2': '5340e6da9cd301458c11a6e0d225dda4720a9713828c6e0fd58ad1fc27371e81',
    'zofed-shared': '6d774e2fae80825a885e349d122b24da1e2d0834521f0cbde5a2d94736e512fb',
    'zofed-cosine': '1ad4618a075a694a8c98bd0815116fc62fc7f3f6014857a742f94da04c70d575',
    'zofed-warm': 'ab71d319331ff5c1cdde05004a6136f2ee1add7e226f8d67570bd2b62e0fed1b',
    'zofed-no-personal': '64888936d9f1056f92218e35444809214fff740dfe366905c9190ee30bf6a96d',
    'zofed-no-momentum': '46e3aabee73ec27e64765525a56e03e68f39ca4a552ff0a098a6abf5fbfc8dd2',
    'zofed-yogi': '727df257963c9bc243507fdbb9db208afccd3643ca0e8d13527e8dd7ed3ddca4',
    'zofed-amsgrad-coordinate': '11efac4c0be12041df2911f34ba71590d903d2f2513dedd15a010a82d048bb65',
    'zo-seeds': '6f463463b83d8b3df19be00ab504e3f508d3c4b7e4beee10f0f11d8f5c57ab1d',
    'zo-seeds-q2-gaussian': 'fadcd5eea4f8aa4fd78cdc348d820471fad744f96467087c1e5f7c35a518caad',
    'decomfl': '86228f6b0e4ead04841f0abba7eece3914c0da4afa467713ff69485fb03b02dd',
    'hiso': '1905780f345e230b1d651935542bf45282d43857de0acec32c083ce7466a61f3',
    'fedkseed': '14f4239aeae7ee72658f0cf8025cc3a0914a4f7f3837dc3d7f7ebb7ef3d7956c',
    'fedmezo': '9c65093fc7ff232beed0f52efc8a3c75615541bfbbb7d7b8c48dd53cb8be3842',
    'fedavg': 'baecb4359007bd7873e1bb5caa3cfae2cae34bf6f2c940335caef47ce0027265',
    'fedadam': '4c1f9d49a4be126137b4359dad35fa83c44b2e24580139f764b2e3c85b5190f5',
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


def arithmetic() -> str:
    """sha256 of one forward pass of a tiny random model: equal on machines whose kernels round alike."""
    from zofed.models.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm(seed=1).model.eval()
    with torch.no_grad():
        logits = model(torch.arange(48).reshape(3, 16) % 60).logits
    return sha256(logits.numpy().tobytes()).hexdigest()


def final_sha(out: Path) -> str:
    return sha256((out / "final" / "trainable.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_method_ends_where_it_is_pinned(name, tiny_workspace, tmp_path):
    got = fingerprint(tiny_workspace, tmp_path / name, RUNS[name])
    assert got[1] > 0, f"{name} did not move the model"
    assert name in PINS, f"no pin for {name}: run `python tests/test_method_pins.py` and paste its output"
    if arithmetic() == ARITHMETIC:
        assert final_sha(tmp_path / name) == EXACT[name], f"{name} moved: {got} (pinned {PINS[name]})"
    assert np.allclose(got, PINS[name], rtol=1e-2, atol=1e-6), f"{name}: {got} != pinned {PINS[name]}"


if __name__ == "__main__":  # print the pins of the code as it is now
    import tempfile

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
        pins, exact = {}, {}
        for name in RUNS:
            pins[name] = fingerprint(ws, ws / "runs" / name, RUNS[name])
            exact[name] = final_sha(ws / "runs" / name)
        print(f"ARITHMETIC = {arithmetic()!r}")
        print("PINS = {")
        for name, values in pins.items():
            print(f"    {name!r}: [{', '.join(f'{v:.8g}' for v in values)}],")
        print("}")
        print("EXACT = {")
        for name, digest in exact.items():
            print(f"    {name!r}: {digest!r},")
        print("}")
