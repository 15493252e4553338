"""Tail averaging (`federation.average_from`): after a share of the rounds the model evaluated and released is the
mean of the server's iterates, while the clients go on training from the last one; it checkpoints, resumes and
replays bit for bit."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config

from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import ClientUpdate, encode
from zofed.fl.roles import ServerRole
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import make_server_optimizer
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run


def _rounds(server, rounds, start=0):
    """Feed `rounds` rounds of two clients with seeded scalars; returns each round's iterate."""
    iterates = []
    for r in range(start, start + rounds):
        local, inbox = server.round_plan(r), RoundInbox()
        rng = np.random.default_rng(r)
        for c in server.sample(r):
            server.send_state(local, c)
            grads = rng.normal(size=(2, 1)).astype(np.float32)
            server.receive(inbox, local, c, encode(ClientUpdate(r, c, np.zeros(0, np.uint64),
                                                                server.method.step_seeds(local, c).base_seed,
                                                                grads, 10, {})))
        server.aggregate(local, inbox)
        iterates.append([t.clone() for t in server.tensors])
    return iterates


def _server(average_from):
    plan = FederationPlan("zo-seeds", 4, 2, 2, lr=0.1, eps=1e-2, run_seed=1)
    return ServerRole(plan, [torch.zeros(5), torch.ones(3)], None, make_server_optimizer("sgd", 1.0),
                      average_from=average_from)


def test_the_released_model_is_the_mean_of_the_iterates_since_the_start_round():
    server = _server(average_from=2)
    iterates = _rounds(server, 2)
    assert server.model_tensors() is server.tensors  # before the tail: the last iterate
    iterates += _rounds(server, 3, start=2)
    expected = [torch.stack([it[i] for it in iterates[2:]]).mean(dim=0) for i in range(2)]
    assert all(torch.allclose(m, e, atol=1e-6) for m, e in zip(server.model_tensors(), expected, strict=True))
    assert not torch.equal(server.model_tensors()[0], server.tensors[0])  # the clients' iterate is the last one
    # the average is server state: a server restored from it goes on exactly
    restored = _server(average_from=2)
    restored.load_state(server.tensors, server.state_tensors())
    assert restored.averaged == 3
    _rounds(server, 1, start=5), _rounds(restored, 1, start=5)
    assert all(torch.equal(a, b) for a, b in zip(server.model_tensors(), restored.model_tensors(), strict=True))


def test_an_averaged_run_checkpoints_its_average_replays_and_releases_another_model(tiny_workspace, tmp_path):
    avg = ("federation.rounds=4", "federation.average_from=0.5")  # rounds 3 and 4 averaged
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "whole", *avg), show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "last", "federation.rounds=4"), show_progress=False)
    final = {d: load_file(str(tmp_path / d / "final" / "trainable.safetensors")) for d in ("whole", "last")}
    assert any(not torch.equal(final["whole"][k], final["last"][k]) for k in final["whole"])
    checkpoint = tmp_path / "whole" / "checkpoint"
    assert int(load_file(str(checkpoint / "average.safetensors"))["count"][0]) == 2  # resumes with its average
    trained = load_file(str(checkpoint / "trainable.safetensors"))  # the clients' iterate, not the average
    assert any(not torch.equal(trained[k], final["whole"][k]) for k in trained)
    assert replay_run(tmp_path / "whole").matches  # the log rebuilds the average, bit for bit
    with pytest.raises(ConfigError, match=r"federation.average_start \(2 -> 3\)"):
        run_federated(tiny_federated_config(tiny_workspace, tmp_path / "whole", "federation.rounds=6",
                                            "federation.average_from=0.5"), resume=True, show_progress=False)


def test_a_finished_averaged_run_resumed_releases_and_tests_its_average_again(tiny_workspace, tmp_path):
    """A resume that finds every round done runs none: it still releases the tail average, not the checkpoint's
    last iterate, and its test is the first sitting's."""
    avg = ("federation.rounds=4", "federation.average_from=0.5")
    out = tmp_path / "run"
    first = run_federated(tiny_federated_config(tiny_workspace, out, *avg), show_progress=False)
    released = load_file(str(out / "final" / "trainable.safetensors"))
    again = run_federated(tiny_federated_config(tiny_workspace, out, *avg), resume=True, show_progress=False)
    assert again["test"] == first["test"]
    final = load_file(str(out / "final" / "trainable.safetensors"))
    assert all(torch.equal(released[k], final[k]) for k in released)
