"""Pins: the final trainable tensors of a 3-round tiny-model run of every method and ablation.

A restructuring of methods, server optimizers, aggregators or the round loop must not move any run. On a machine
whose float arithmetic matches the one the pins were written on (same kernels: the fingerprint of one tiny
forward pass says so), the final tensors must be bit-identical (sha256). Elsewhere a last-bit difference in a
kernel is amplified by adaptive steps (coordinate-wise Adam turns a near-zero coordinate's sign into a full
step), so there each run's update (final minus start) is compared by its sum, norm and four fixed random
projections within 1% (or 1% of the update's norm, for a value near zero): a changed seed stream, step rule or
server rule still moves them by more. A change that is meant to move a run (a bug fix) says so in its commit and
rewrites the pins:
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
ARITHMETIC = '14a69432a75e3a13418c6dc112e5c5f2b1061a0bbb4aa541ef4bc8d1c8a52d29'
PINS = {
    'zofed': [0.01162989, 0.015991413, -0.019065213, 0.0020509752, 0.003732861, 0.011276257],
    'zofed-size-blocks': [0.0121662, 0.015790199, -0.01880626, 0.0019287991, 0.0037014185, 0.010693424],
    'zofed-tilt': [0.01183924, 0.016231653, -0.019296713, 0.0021443067, 0.0037727485, 0.011484433],
    'zofed-blocks2': [-0.017400739, 0.043540049, -0.030167167, 0.0010761189, 0.013291564, 0.068474079],
    'zofed-shared': [0.014875196, 0.021208537, 0.015969777, 0.0070294442, 0.00068959026, -0.020334714],
    'zofed-cosine': [0.011638373, 0.015886542, -0.019042782, 0.0019429321, 0.0036217628, 0.010990916],
    'zofed-warm': [0.0043104458, 0.0058261857, -0.0070365439, 0.00071173274, 0.0013729354, 0.003932922],
    'zofed-tensor': [0.0049406183, 0.0070345441, -0.0084535114, 0.00025789952, 0.0022670347, 0.0049608771],
    'zofed-no-personal': [0.045526869, 0.044117059, 0.018816051, -0.014211796, -0.01625987, 0.031899079],
    'zofed-no-momentum': [-0.00038287528, 0.0036180126, -0.00064076137, 0.0016190369, -0.00012058121, 0.0023677412],
    'zofed-yogi': [-0.0085062745, 0.12417722, -0.028472697, 0.02153147, 0.0087574875, 0.19943078],
    'zofed-amsgrad-coordinate': [-0.047861365, 0.065930555, 0.0015604165, -0.022289767, -0.0084081528, 0.14179436],
    'zo-seeds': [1.2654994, 0.85947436, -0.4299255, -1.5418277, -0.52117422, -1.1360255],
    'zo-seeds-q2-gaussian': [-0.085804226, 0.27435509, -0.101927, 0.33321053, 0.14255845, -0.29114461],
    'decomfl': [0.010826743, 0.63422817, -0.66691429, 0.10177671, 0.30010783, 0.32112524],
    'hiso': [0.0015075475, 0.63372886, -0.66813922, 0.081663093, 0.32522678, 0.30674398],
    'fedkseed': [-1.07862, 0.53690109, -0.40563227, -0.048888096, 0.11710038, 0.39970196],
    'fedmezo': [1.2654971, 0.85947337, -0.42992977, -1.5418252, -0.52117434, -1.1360214],
    'fedavg': [-0.045045629, 0.045920458, 0.019372565, -0.06285776, 0.091359505, 0.018926731],
    'fedadam': [-0.81021377, 0.50258417, 0.033693789, -0.49969731, 0.44544961, 0.075436745],
}
EXACT = {
    'zofed': '8c7e4f13c1111150b56dd3a33d710f44ce4936be516b0dd9684caa56f60873fd',
    'zofed-size-blocks': '29f04fa1cdd96f86de7680ac992c7e36859d0668feac2e2b685e4cd947d9e207',
    'zofed-tilt': 'd235401a63145207e6c38d75edb2005621b2f7bfd972e1a16ac2f565733397c2',
    'zofed-blocks2': 'c1692f7290e176f96d982da00e4ebeaaf812308d0abcd87dedaee7c8eca94663',
    'zofed-shared': '4ef21879e77d85ab4c1a09aad4c3d0f16b6735f47165577ebeb5c5acb7a43b07',
    'zofed-cosine': 'cfa2136f87b2d31bbfd4dcfbcfee76beb87be3cecf4eb14f36d3109e60b2651e',
    'zofed-warm': '186789c0c6fc2665d4e772803b560cc038a2155f46a2e985e185ee7714dff33a',
    'zofed-tensor': 'd508f3f936d3aa16930e88411a337b6f6ce82d187534fe67000a8236b97b77c0',
    'zofed-no-personal': 'a19e3154815819ae4abeada1aa88697fa9dc626300616e3610d9b2951bbf46bd',
    'zofed-no-momentum': '432f5fc5f9e164bcaecbe72b79886ba909c275bb67d58cc69ddc388578f6c168',
    'zofed-yogi': 'eaca5aac68cc782eb000778aaa57c4c42ff554701552ebb8fbbe05e089e0adc6',
    'zofed-amsgrad-coordinate': '680021dfc4a5acb3588163610e383e31919a3eb32369a89210fb6c16b8132058',
    'zo-seeds': '6a59c52c75ef7463fabcfaec73a2ff357b7664a4c2bb00b9302ab6ac78ba8b4f',
    'zo-seeds-q2-gaussian': '680737cf4fa15e3c897d58608aec5aaff58d9c8944b17af57e904d7bd0b86f42',
    'decomfl': 'c22f5eaf6320f87171fa055655ea649c9f9b8839c13dcd017eba56ff0e0037bb',
    'hiso': '2ada52a8d0c26df2074e65d647c886d1ca413a6170ad65afa8f831a85fc28dea',
    'fedkseed': '5255f9a65ed33029a7e13b4a29be6316d907ea0edbc84e14a658cfba651bbfbb',
    'fedmezo': 'ce2927316109ac7e6bef207581e7edcaa138cb27535c5f2c495a5d4fa29de042',
    'fedavg': 'a17291c3771f6bada2e0717239569546ecab3540ed915c989fe91cab2d2d2a2c',
    'fedadam': '40dcfdf0795f341993046f933fdf75ad6117466358facf5acbfb9e1796a6c244',
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
