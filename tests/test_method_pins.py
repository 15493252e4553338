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
    'zofed': [-0.073387496, 0.10294134, -0.049363584, -0.062361231, -0.03737641, 0.19913421],
    'zofed-size-blocks': [-0.033993089, 0.11983584, 0.0084514131, -0.073245785, -0.013202779, 0.25234015],
    'zofed-tilt': [-0.072966023, 0.10321634, -0.04974352, -0.062316348, -0.037018062, 0.19951719],
    'zofed-blocks2': [0.018931611, 0.14625139, -0.1029307, -0.14118121, -0.11703876, 0.13577498],
    'zofed-shared': [-0.056586137, 0.11327908, 0.070828364, 0.18457051, -0.023340117, -0.019357783],
    'zofed-cosine': [-0.041613006, 0.09040607, -0.059137468, -0.041615457, -0.02637852, 0.15943229],
    'zofed-warm': [-0.0055772172, 0.066859536, -0.057777406, -0.01826738, -0.009924775, 0.099327346],
    'zofed-no-personal': [0.18855413, 0.14581527, -0.064594524, -0.26069288, -0.22991792, 0.15229913],
    'zofed-no-momentum': [-0.00038106284, 0.0036167501, -0.00064200367, 0.0016194876, -0.00012005091, 0.0023652923],
    'zofed-yogi': [-0.047866101, 0.065900644, 0.0015452506, -0.022314792, -0.0084156923, 0.14175007],
    'zofed-amsgrad-coordinate': [-0.047890972, 0.065932057, 0.001541615, -0.022229863, -0.0084519976, 0.14177384],
    'zo-seeds': [1.2654997, 0.85947475, -0.42992709, -1.5418263, -0.52117652, -1.1360264],
    'zo-seeds-q2-gaussian': [-0.085804345, 0.27435548, -0.10192851, 0.3332104, 0.14255951, -0.29114662],
    'decomfl': [0.01082908, 0.63422858, -0.6669147, 0.10177954, 0.3001093, 0.3211241],
    'hiso': [0.0015099806, 0.63372875, -0.66813593, 0.081664402, 0.3252251, 0.3067436],
    'fedkseed': [-1.0786134, 0.5368982, -0.40562993, -0.048890935, 0.11709944, 0.39969742],
    'fedmezo': [1.2654981, 0.85947392, -0.42992803, -1.5418259, -0.52117642, -1.1360251],
    'fedavg': [-0.045045177, 0.045920437, 0.019371526, -0.062857503, 0.091359976, 0.018926775],
    'fedadam': [-0.81020931, 0.50258414, 0.033685559, -0.49969445, 0.44545312, 0.075435775],
}
EXACT = {
    'zofed': '6fef50fa18521f59b80161a11af4fbbc77ae1fbf353fa1ac2c77499d606deabf',
    'zofed-size-blocks': 'ecd5801329ce19b6add581b0ef18bf22f960e804f079d2109dd3431f9d9ff36d',
    'zofed-tilt': '9b42d7cd17d97859f53e1270446b34f43f309e27aab8988ad35a13f44a334449',
    'zofed-blocks2': '4974a5f4b79d9fbd113ac0829cad16f8efc0c5f2244cf6ed9f3ed7986949da64',
    'zofed-shared': '326b96be29111aa34b4c30b20409ff2f90318869aae6721a9494884330569d79',
    'zofed-cosine': 'e0688477e691bc19f55625769a712c40e6b407a325dba5e36f709e01b74c7f56',
    'zofed-warm': '7df834a5ba629d0472f3a776116675e76e02ffc2e65aaca3479dd208d58ec390',
    'zofed-no-personal': 'de5445847260128700ebc710168fb9b385324fc7ad0e58e8f4497ed5830ba812',
    'zofed-no-momentum': '19f6a7df8985a3172454cfa33cc7eccbc5f39e5705d0fd2fe2404cf7d0a2fe04',
    'zofed-yogi': '0905f4fca7634c27149b787f7d2855691f831fa83026eda9fcab672ee3f68602',
    'zofed-amsgrad-coordinate': 'e5a7941a3b3addcb24d490e7611b44e1ddc6304451cd57b57760a7a274c5295b',
    'zo-seeds': '5cff3a1195702bf45cc17061ec167fd10851ccba84f0e36af41c7e067b92bb8b',
    'zo-seeds-q2-gaussian': '342593ad315796d49df326c6e8018433572c720f076c657702de82d35e9fc56d',
    'decomfl': '3624ac804356ea2f1e9251bd03f004972e691499534a7aab43b0a55ba9dc7712',
    'hiso': 'eb5400fd8064e53b94a4de3159ec72a6523d05889648427732b4ce0f937eaf95',
    'fedkseed': '7a433b7cf9d4ea57e3485e05fad5ce85a9a61b3a2fc33274dfadf3e7ff43191a',
    'fedmezo': '9d0b6d217c8a72e3ee31568c815fc72dcc853cb9ed28c14ef6e1b88332ec12ee',
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
