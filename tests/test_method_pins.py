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
ARITHMETIC = '14554a1c6ac0d52da5614fd24edeb201b9ea8910db92a3a141681ed468a9a1c3'
PINS = {
    'zofed': [0.011630231, 0.015991417, -0.019065238, 0.0020511908, 0.0037330611, 0.011275978],
    'zofed-size-blocks': [0.012166193, 0.015790198, -0.018806251, 0.001928805, 0.0037014147, 0.010693424],
    'zofed-tilt': [0.01183917, 0.016231709, -0.019296866, 0.0021449827, 0.003772594, 0.011484027],
    'zofed-blocks2': [-0.017400391, 0.043540054, -0.030166944, 0.0010758511, 0.013291742, 0.068474118],
    'zofed-shared': [0.014875189, 0.021208535, 0.015969779, 0.0070294483, 0.00068958522, -0.02033471],
    'zofed-cosine': [0.011638579, 0.015886549, -0.019042707, 0.0019430778, 0.0036219895, 0.010990747],
    'zofed-warm': [0.0043104066, 0.005826187, -0.0070365274, 0.00071171187, 0.0013729188, 0.0039329777],
    'zofed-tensor': [0.0049406178, 0.0070345457, -0.0084535044, 0.00025789823, 0.0022670372, 0.00496089],
    'zofed-no-personal': [0.045526975, 0.04411707, 0.018816043, -0.01421169, -0.016259898, 0.031899471],
    'zofed-no-momentum': [-0.00038325651, 0.0036170009, -0.00064082051, 0.0016174559, -0.00011965917, 0.002367812],
    'zofed-yogi': [-0.0085609658, 0.12417698, -0.028450531, 0.021536982, 0.0086716769, 0.19947458],
    'zofed-amsgrad-coordinate': [-0.047896408, 0.065929686, 0.0015522464, -0.022230034, -0.008452741, 0.14177267],
    'zo-seeds': [1.2655025, 0.85947548, -0.42992797, -1.5418311, -0.52117191, -1.1360199],
    'zo-seeds-q2-gaussian': [-0.085803484, 0.27435515, -0.10192802, 0.33320983, 0.14256006, -0.29114757],
    'decomfl': [0.010828829, 0.63422813, -0.66691692, 0.10177824, 0.30011326, 0.32112461],
    'hiso': [0.0015058372, 0.63372825, -0.66813824, 0.081659905, 0.32522854, 0.30674394],
    'fedkseed': [-1.078616, 0.53689896, -0.40563316, -0.048890247, 0.11710088, 0.39970071],
    'fedmezo': [1.2655039, 0.85947644, -0.42992776, -1.5418324, -0.5211732, -1.1360225],
    'fedavg': [-0.045045597, 0.045920455, 0.019372566, -0.062857776, 0.091359502, 0.018926753],
    'fedadam': [-0.81021467, 0.5025841, 0.033693882, -0.49969832, 0.4454499, 0.075437249],
}
EXACT = {
    'zofed': '19c14a9a0afdc940cc04e9272ee2587e7bb132dfb23a6f700584c97a62e80656',
    'zofed-size-blocks': '357381f202349205c678b85562c47bcfa368c4e1ef0b6fc3b8ee2ef596002d8f',
    'zofed-tilt': '210a3e46127e8699816ea9bb5ff81da0e67ec49846807eb336f86ba7834367ab',
    'zofed-blocks2': '9e6d32706da83df3151c0d5e4618f6c7761f7d1e960c09252d2f6ad806851b85',
    'zofed-shared': 'ceaff9c26d15247c613a8d4833ecc91fb222d1d98663da3ac075ea706ae75bc9',
    'zofed-cosine': 'edc5e07cb719863f7135fb9fbcb09be505be5038a66078e97cab9f7eb40016a6',
    'zofed-warm': 'c0e19f5a850b5bf14702959af4ea1cad9144b3ce391456ef033e7378e4ae0d94',
    'zofed-tensor': 'd5b8ada5817f051736a2760cb9fe421a310cf674007397a5933d36ebc14fc3ea',
    'zofed-no-personal': 'f615d3ab25dabe6218ad798157650ebfe6d2b7738f8747673e3799ed4587d832',
    'zofed-no-momentum': '55b1abbd11fffbe3d94d34da3343a1da0aa3211ed16918eb1a71262c780a3695',
    'zofed-yogi': '324639d5cf59833645dbb9b062b3fae4ab3443a6363c081d624545f845bcbc49',
    'zofed-amsgrad-coordinate': '9bb1033c3dc7fdf402d5d7c2c70ba3f4f4e5483bacd979e6552a37ccef220f85',
    'zo-seeds': '8f10917019faf092a00c3e9e1104d90260748589e937ba4345497647239b8494',
    'zo-seeds-q2-gaussian': '053a8d233099821f6673cfcd705bf7cfbf8e254fbe68ecc2ea2cedf9c32b7ed7',
    'decomfl': 'f38283e2f1f5c2d3a87da3658f77cb4b2254385391b25ceb24b4a40658ce1fe9',
    'hiso': '25dbe6804f2c68e42ff1d84531964599e2dd9fed62affb4368515feb220926c2',
    'fedkseed': '855b4044408518e7867951d9beb2d667875f0c83d2a1877dca2ff3a6cdd087bd',
    'fedmezo': 'd00764d8112afce8f1214ef4af89cfcdbc21e14749f9e20102b6e4470c17472a',
    'fedavg': 'a3085989d1a6ceb3ebc43dc80866fcf06f954376e44f2f9aa4a0203a247f5f53',
    'fedadam': 'ddf636bcf90592ea8357bd2a2c44d72d26c4a71db0052755e632aa2be7de49e7',
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
