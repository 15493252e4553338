"""Method objects are registry-wide and hold no per-run state: the server's and clients' state objects do. Two runs
side by side in one process end exactly as each does alone."""

from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config

from zofed.fl.methods import get_method, method_names
from zofed.run.federated import run_federated


def _final(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "trainable.safetensors"))


def test_two_runs_side_by_side_end_as_each_alone(tiny_workspace, tmp_path):
    runs = {"zofed": ["federation.method=zofed"], "hiso": ["federation.method=hiso", "federation.local_steps=3"]}

    def run(name: str, out):
        run_federated(tiny_federated_config(tiny_workspace, out, *runs[name]), show_progress=False)
        return _final(out)

    alone = {name: run(name, tmp_path / f"{name}-alone") for name in runs}
    with ThreadPoolExecutor(2) as pool:
        together = dict(zip(runs, pool.map(lambda name: run(name, tmp_path / f"{name}-together"), runs),
                            strict=True))
    for name in runs:
        assert alone[name].keys() == together[name].keys()
        assert all(torch.equal(alone[name][k], together[name][k]) for k in alone[name]), name
    assert not any(torch.equal(alone["zofed"][k], alone["hiso"][k]) for k in alone["zofed"])  # two real runs


def test_no_method_object_keeps_anything_of_a_run(tiny_workspace, tmp_path):
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "run"), show_progress=False)
    assert {name: vars(get_method(name)) for name in method_names()} == {name: {} for name in method_names()}
