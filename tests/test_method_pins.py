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
    'zofed': [-0.01157261, 0.038902341, -0.056911446, -0.018120303, 0.016260541, 0.023962304],
    'zofed-size-blocks': [-0.011407973, 0.038751277, -0.056734062, -0.017834314, 0.016155201, 0.023552446],
    'zofed-tilt': [-0.01157261, 0.038902341, -0.056911446, -0.018120303, 0.016260541, 0.023962304],
    'zofed-blocks2': [-0.02764388, 0.05268297, 0.046825751, 0.014662905, 0.048600518, -0.031220429],
    'zofed-shared': [-0.00035667001, 0.052633571, -0.0011460579, 0.0099155225, -0.014552504, -0.056944237],
    'zofed-cosine': [-0.01269051, 0.028564652, -0.038782312, -0.021734143, 0.013328553, 0.028170812],
    'zofed-warm': [-0.0057827836, 0.016176244, -0.023306799, -0.0094572971, 0.0071468249, 0.012386928],
    'zofed-tensor': [-0.0070519206, 0.019937289, -0.028769027, -0.011506835, 0.0087818203, 0.015076511],
    'zofed-no-personal': [0.019296703, 0.053200056, -0.027518099, -0.087210215, -0.017461234, -0.029850394],
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
    'zofed': '1d2d8fde4cb9788790e36b7c017134ed66a6dd02161fd5742ac6ff861cc3bc4b',
    'zofed-size-blocks': 'ccbebd11fa34e27d0ecc6c3d3e1dbf3f5fd7dd3888764081c8639f7c7c561ad7',
    'zofed-tilt': '1d2d8fde4cb9788790e36b7c017134ed66a6dd02161fd5742ac6ff861cc3bc4b',
    'zofed-blocks2': 'e0364f78a0dfbb65ef9cda3a0d44a02baf7001ed26a11775c8e3e897543792c9',
    'zofed-shared': '3a4212b1dbdd339b692cc311b81ec5f1d48d47c8be2eda729cc2523ba1391d66',
    'zofed-cosine': 'a8b7fdf6a824e70abb459bd9b4c899a875479d94c2cb3f0c9a05df59b27a30c0',
    'zofed-warm': 'f45346d4d03c57046d2f4766a81276d205af87914c738e3c8007c03d196c85a5',
    'zofed-tensor': '09c14ed72043c5ca46819f5937dbed111446ca5ea0c581346fcb55db6c475443',
    'zofed-no-personal': '76c54fd5fe693037688f3d285dfbff6ad325fda4aebeb63cad8d2bdf65938233',
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
