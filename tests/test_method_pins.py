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
    'zofed': [0.0088570087, 0.018395323, 0.023830001, 0.015962477, -0.0088219271, -0.019466181],
    'zofed-size-blocks': [0.0088449219, 0.018384549, 0.023831517, 0.015950312, -0.0088194947, -0.019426506],
    'zofed-tilt': [0.0088570087, 0.018395323, 0.023830001, 0.015962477, -0.0088219271, -0.019466181],
    'zofed-blocks2': [-0.059179952, 0.042318761, -0.043994534, -0.030390631, 0.013343553, -0.022025966],
    'zofed-shared': [-0.00014049953, 0.020594196, 0.00067883223, -0.0046754805, 0.0062335487, 0.022389258],
    'zofed-cosine': [0.0089973939, 0.018163338, 0.022955503, 0.01590125, -0.0086183793, -0.020223633],
    'zofed-warm': [0.0028655336, 0.0058034762, 0.0073559726, 0.0050756107, -0.0027571643, -0.0064247801],
    'zofed-tensor': [0.0035441351, 0.0072037166, 0.0091601004, 0.0062931833, -0.003427138, -0.0079239924],
    'zofed-no-personal': [0.0015611867, 0.041455587, 0.0019003945, -0.039885573, -0.079026431, 0.019623688],
    'zofed-no-momentum': [-0.0027027025, 0.0054116106, 0.01223392, 2.5209473e-05, -0.0026571081, 0.012933827],
    'zofed-yogi': [0.022498099, 0.14444069, 0.27072024, 0.093225314, -0.080029218, 0.025847556],
    'zofed-amsgrad-coordinate': [0.013897393, 0.067173416, 0.11923756, 0.052753202, -0.038103733, 0.0048464969],
    'zo-seeds': [0.51997658, 0.54846638, -0.97431943, -0.74111828, -0.61025919, -0.37418543],
    'zo-seeds-q2-gaussian': [-0.738337, 0.4755905, 0.16265997, 0.46601048, 0.4439889, 0.030571856],
    'decomfl': [-0.15644923, 0.34810733, -0.090213817, 0.39288416, -0.12655832, -0.20605249],
    'hiso': [-0.15644069, 0.3480868, -0.089823841, 0.39302902, -0.12772688, -0.20567131],
    'fedkseed': [0.82349325, 0.66422243, 0.14562957, 0.35955436, 0.00072525264, -0.079667613],
    'fedmezo': [0.51997686, 0.54846594, -0.97431801, -0.74111807, -0.61025858, -0.37418455],
    'fedavg': [0.025049436, 0.048915001, 0.071211396, -0.028655783, -0.02301425, 0.09406828],
    'fedadam': [-0.15919102, 0.53809682, 0.20506396, 0.092823168, -0.16836115, 0.64346863],
}
EXACT = {
    'zofed': '48a52836cf7980be2a9e488b949eac141bd72cef40ac61be9ef061a235fe3b17',
    'zofed-size-blocks': 'b96bcf9792ef3b5a5a6fa6b095417f964bc09d6ebbfee354144de0772a3cd41c',
    'zofed-tilt': '48a52836cf7980be2a9e488b949eac141bd72cef40ac61be9ef061a235fe3b17',
    'zofed-blocks2': 'a3c4d2352cde39c2c9ce229054a4ab9aaa216edf2cd5bc5778352b47a22a18bb',
    'zofed-shared': 'bab3874ba2c21f56d447c65c94241f13d50705e978670b41c8e40cc4df267014',
    'zofed-cosine': '5405d5131e853bbdcb257590020c803b6cb0d3637850ebbbad31fd7043f36ff7',
    'zofed-warm': '7a2f7f893f53b15a93f213d11cb6e783af778e843919541841740319538cb726',
    'zofed-tensor': 'b68feb7e9d3fb6b89a4742ddff54aff41b0cc3008d055fa2ab68e11f878210ab',
    'zofed-no-personal': '8b8ee9d60ba7fa2e668ac23625e3ca507b4e9a738e004a2db727545231efe9a8',
    'zofed-no-momentum': '6fb5434c896ba1370a21a44dc717dc0644d867fe3377065595d5e702090a4f87',
    'zofed-yogi': '909fbce069d7f813f35cee7e01e5c741887d2bf2e3f19caf685387f9a3935ea7',
    'zofed-amsgrad-coordinate': '5d9354d604a2b40b85326013e433bb1bd28679cfc23575bd92b912ce88cd61f4',
    'zo-seeds': 'aa20c15cb510e7b6e93d7a2e826a97fe2b99fe8362524def59f4486773094dce',
    'zo-seeds-q2-gaussian': '692e16d85e63f35fa83bb929d3c6a18260e1ea032977c0a95b0004790c1faa30',
    'decomfl': 'b343d660502133557a3e760b9718931a83e8b60b6d8edb720a9b3cab96d86447',
    'hiso': '49bf97fafaf839cddca0c8b29b21b899359dc7f2cb614c4b78ab501bedf2e2eb',
    'fedkseed': 'f4e34506e3e46fd80eafb02fc44da959ac86c22a73c19b8d60e771e898ab9364',
    'fedmezo': '8f5961b0cfa864f278fbb601cfaf8028bedb56da9f73c3a676d6cf7abad436d1',
    'fedavg': '774a1c90fc886f3dfd335b5c7f3e08a02fd9ea04bb47ae62606adbf060a3dba1',
    'fedadam': 'e14b732c7e7b2ae8aa656ca75de6dc75917d7f3bac003b7e59f4d6eb4e11ec18',
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
