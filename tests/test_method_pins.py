"""Pins: the final trainable tensors of a 3-round tiny-model run of every method and ablation.

A restructuring of methods, server optimizers, aggregators or the round loop must not move any run. On a machine
whose float arithmetic matches the one the pins were written on (same kernels: the fingerprint of one tiny forward
and backward pass says so), the final tensors must be bit-identical (sha256). Elsewhere a last-bit difference in a
kernel is amplified by adaptive steps (coordinate-wise Adam turns a near-zero coordinate's sign into a full step),
so there each run's update (final minus start) is compared by its sum, norm and four fixed random projections within
1% (or 1% of the update's norm, for a value near zero): a changed seed stream, step rule or server rule still moves
them by more. A change that is meant to move a run (a bug fix) says so in its commit and rewrites the pins:
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
    "zofed-warm": ["federation.server_optimizer.warm_start=true", "federation.server_optimizer.granularity=tensor"],
    "zofed-tensor": ["federation.server_optimizer.granularity=tensor"],
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
ARITHMETIC = '0f5b50e134e08237b96aa3056e8ef81cbe21e5b555838f5241ca1f6e31a04c17'
PINS = {
    'zofed': [-0.0082259757, 0.016713892, -0.021251086, -0.014394793, 0.0078987018, 0.018571786],
    'zofed-size-blocks': [-0.0082223432, 0.01670865, -0.021246792, -0.014388306, 0.0078962528, 0.018562947],
    'zofed-tilt': [-0.0082259757, 0.016713892, -0.021251086, -0.014394793, 0.0078987018, 0.018571786],
    'zofed-blocks2': [0.0028264017, 0.04530105, 0.045211394, 0.023019867, 0.032998037, -0.01992349],
    'zofed-shared': [-0.00086679103, 0.020630105, 3.9960312e-05, 0.0033048232, -0.0051778712, -0.021700791],
    'zofed-cosine': [-0.0082523642, 0.016568947, -0.020840334, -0.014478689, 0.0078327542, 0.018669796],
    'zofed-warm': [-0.0028023947, 0.0056322455, -0.0070909101, -0.0049156534, 0.0026625239, 0.0063389375],
    'zofed-tensor': [-0.0034495727, 0.0069417621, -0.0087499621, -0.0060491827, 0.0032815011, 0.0078010993],
    'zofed-no-personal': [0.030289062, 0.045284829, -0.00458888, -0.077981309, -0.019325035, -0.0042340434],
    'zofed-no-momentum': [0.00095574063, 0.0050095167, -0.0051271339, 0.0022731537, 0.00052955663, -0.0027653161],
    'zofed-yogi': [-0.037846546, 0.12745854, -0.18654425, -0.059290486, 0.053274722, 0.07827723],
    'zofed-amsgrad-coordinate': [-0.024447966, 0.065174928, -0.090770545, -0.037817127, 0.02803062, 0.055335148],
    'zo-seeds': [-0.076256707, 0.79672958, -0.58927352, -1.0958989, -1.1639089, -0.9664563],
    'zo-seeds-q2-gaussian': [-0.42666524, 0.51193824, -0.32959248, -0.86396066, -0.23003215, -0.73614095],
    'decomfl': [-1.1405047, 1.0222934, -1.6442964, 0.25186515, 1.902734, -0.4955979],
    'hiso': [-1.144809, 1.0144202, -1.6372059, 0.27348417, 1.8635279, -0.48341286],
    'fedkseed': [1.4397794, 0.85351352, 1.2920015, -0.70099482, -0.49428892, -0.57535889],
    'fedmezo': [-0.076253241, 0.79672946, -0.58927444, -1.0959009, -1.1639129, -0.96645997],
    'fedavg': [0.029457682, 0.072190308, -0.018986237, -0.018458081, 0.072591686, 0.13399145],
    'fedadam': [0.12637719, 0.65497337, -0.54406045, -0.51726088, 0.68221432, 1.1582783],
}
EXACT = {
    'zofed': '15b690a86ff53398d488f8f303e80f0a247236b9af654121debbdae283885377',
    'zofed-size-blocks': 'bcd6fdd5bd3a40ced87277df187946d0232c770ea01fe12d89935ffabbdce505',
    'zofed-tilt': '15b690a86ff53398d488f8f303e80f0a247236b9af654121debbdae283885377',
    'zofed-blocks2': '632ab29c0a02dd5c9896c4b40ebc80ef39233b4e5c8fb1d8ac765c65a1fd4e34',
    'zofed-shared': '97d7decc1d91c91522f6c2dafd2e40ee1a9db2d57594b3047266d10be58615c0',
    'zofed-cosine': '72c4a67dca34e1ab5c45eb58f46d4dace5534465d77b02e2f6f0d2685641e8b9',
    'zofed-warm': '386af77ec379d1ca03d51a92cf61ac19d77911e58df3d9a212868615eaab0b42',
    'zofed-tensor': 'fe54ac4613e17311af2141f24597a840a8dbd48a379f336720a81505cfc3c390',
    'zofed-no-personal': 'c61b3da22fe5de7a3f00b61c2d631681a329b1b85644a2480b7c7d687bd35728',
    'zofed-no-momentum': 'f8172e2743bfdb72fe3b8fbb1f41480588a9370627f148be329308f74c8104b9',
    'zofed-yogi': 'fe3d46470c5f462b9c9270b92341e78401105e182809a7bc3f2db5ca0b5c3e7b',
    'zofed-amsgrad-coordinate': 'c8241a46f68e4a87c23ed2c11e3908b4bb77b329b486252ca5337a9dee3239fc',
    'zo-seeds': '82d2a20ff3a8b0eb44cfd20476179e3a4dbc56a98a7b12dc61a728c71e6d016a',
    'zo-seeds-q2-gaussian': 'bc7274da70d224820d8d9e198832a6c26dab2b0eaacd1b8e0f0419e38856cb20',
    'decomfl': 'dbf1eb721935325818026fa521a7d4df11b545a0265a9227f27af6a925b62c0c',
    'hiso': 'f882eead3f43a01395f5383bebfc8bd76e5146c09d5ef61426419429ed09d597',
    'fedkseed': 'a2e15163c960dd6591a159dee5bc1db10135d72ee8d9d3f7a1ca278c8d549dc2',
    'fedmezo': '206359f95fad4b2bb3118fc4467bc4ac58520e12a46e94667ebaa902579e66e4',
    'fedavg': '121bb3352eb5d067770ecf2e157d7e75b835194c2f8461b60a756c6acd3d814b',
    'fedadam': 'e907519b70a699e6602e12c8a3791b1ca77bf5075402ca738c5a65e37b7d5dbe',
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
    """sha256 of the CPU's kernel family and one forward and backward pass of a tiny random model.

    A forward pass alone once matched on two machines whose training runs differed in the last bits, so the
    kernel family torch dispatches to and the gradients are part of what must match.
    """
    from zofed.models.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm(seed=1).model.eval()
    tokens = torch.arange(48).reshape(3, 16) % 60
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    digest = sha256(torch.backends.cpu.get_cpu_capability().encode())
    digest.update(loss.detach().numpy().tobytes())
    for param in model.parameters():
        digest.update(param.grad.numpy().tobytes())
    return digest.hexdigest()


def final_sha(out: Path) -> str:
    return sha256((out / "final" / "trainable.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_method_ends_where_it_is_pinned(name, tiny_workspace, tmp_path):
    got = fingerprint(tiny_workspace, tmp_path / name, RUNS[name])
    assert got[1] > 0, f"{name} did not move the model"
    assert name in PINS, f"no pin for {name}: run `python tests/test_method_pins.py` and paste its output"
    if arithmetic() == ARITHMETIC:
        assert final_sha(tmp_path / name) == EXACT[name], f"{name} moved: {got} (pinned {PINS[name]})"
    # A projection near zero carries the kernels' rounding at the update's scale, not its own: 1% of the norm.
    scale = 1e-2 * PINS[name][1]
    assert np.allclose(got, PINS[name], rtol=1e-2, atol=scale), f"{name}: {got} != pinned {PINS[name]}"


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
