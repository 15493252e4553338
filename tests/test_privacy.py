"""Client-level differential privacy (fl/privacy.py): the noise on each clipped uplink, the accountant's epsilon
against known values, and a private run that records its epsilon per round and replays from its log."""

import json

import numpy as np
import pytest
from toy_federation import tiny_federated_config

from zofed.fl.privacy import add_noise, epsilon_spent
from zofed.fl.protocol import ClientUpdate
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run


def test_the_noise_has_the_clip_norms_scale_and_repeats_from_the_seed():
    update = ClientUpdate(4, 2, np.zeros(0, np.uint64), 5, np.zeros((500, 4), np.float32), 10, {})
    noised = add_noise(update, 1.5, 2.0, run_seed=0, round_id=4)
    assert noised.grads.dtype == np.float32 and noised.grads.std() == pytest.approx(3.0, rel=0.03)
    assert np.array_equal(noised.grads, add_noise(update, 1.5, 2.0, 0, 4).grads)  # a run and its replay agree
    assert not np.array_equal(noised.grads, add_noise(update, 1.5, 2.0, 0, 5).grads)  # each round its own draw
    dense = ClientUpdate(4, 2, np.zeros(0, np.uint64), None, np.zeros((0, 1), np.float32), 10, {},
                         dense=np.zeros(400, np.float32))
    assert add_noise(dense, 1.0, 1.0, 0, 4).dense.std() == pytest.approx(1.0, rel=0.1)


def test_epsilon_grows_with_rounds_and_falls_with_noise_and_sampling():
    one = epsilon_spent(1.0, 50, 5, 1, 1e-5)
    many = epsilon_spent(1.0, 50, 5, 32, 1e-5)
    assert 0 < one < many and epsilon_spent(4.0, 50, 5, 32, 1e-5) < many
    assert epsilon_spent(1.0, 50, 50, 32, 1e-5) > many  # every client every round: no sampling to amplify
    assert epsilon_spent(1.0, 50, 5, 0, 1e-5) == 0.0
    # Full participation is the plain Gaussian mechanism with multiplier sigma / 2 (replace-one neighbours),
    # composed: RDP alpha / (2 (sigma/2)^2) a round, turned into epsilon(delta) with the conversion
    # rdp + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1), minimised over alpha.
    sigma, rounds, delta = 8.0, 10, 1e-5
    alphas = np.linspace(1.01, 400, 200_000)
    rdp = rounds * alphas / (2 * (sigma / 2) ** 2)
    expected = np.min(rdp + np.log((alphas - 1) / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1))
    assert epsilon_spent(sigma, 10, 10, rounds, delta) == pytest.approx(expected, rel=1e-3)


def test_a_private_run_records_its_epsilon_and_replays(tiny_workspace, tmp_path):
    out = tmp_path / "private"
    results = run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds",
                                                  "federation.clip_norm=1.0", "federation.dp_noise=2.0"),
                            show_progress=False)
    rounds = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "round"]
    spent = [r["dp_epsilon"] for r in rounds]
    assert spent == sorted(spent) and spent[0] > 0
    assert spent[-1] == pytest.approx(epsilon_spent(2.0, 4, 2, 3, 1e-5))
    assert results["dp_epsilon"] == spent[-1] and results["dp_delta"] == 1e-5
    assert replay_run(out).matches  # the server's noise comes from the run seed: the replay adds the same
    with pytest.raises(ConfigError, match="dp_noise needs federation.clip_norm"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_noise=1.0")
    with pytest.raises(ConfigError, match="dp_delta is a setting of differential privacy"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_delta=1e-6")


def test_local_dp_noises_at_the_client_and_the_server_leaves_the_numbers_be(tiny_workspace, tmp_path):
    from zofed.fl.protocol import decode
    from zofed.run.uplink_log import LOG_NAME, read_log

    def uplinks(out, *extra):
        run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds", *extra),
                      show_progress=False)
        return [decode(data) for r in read_log(out / LOG_NAME)[1] for _, data in r.uplinks]

    plain = uplinks(tmp_path / "plain")
    local = uplinks(tmp_path / "local", "federation.clip_norm=1e-3", "federation.dp_noise=2.0",
                    "federation.dp_at=client")
    first = plain[0]  # the first round starts from the same model: the same honest scalars, clipped and noised
    clipped = first.grads * min(1.0, 1e-3 / float(np.linalg.norm(first.grads)))
    expected = add_noise(ClientUpdate(0, first.client_id, first.seeds, first.base_seed, clipped.astype(np.float32),
                                      first.num_examples, {}), 2.0, 1e-3, 0, 0).grads
    assert np.allclose(local[0].grads, expected, atol=1e-6)
    assert float(np.linalg.norm(local[0].grads)) > 1e-3  # what the server logged is the noised numbers, unclipped
    assert replay_run(tmp_path / "local").matches
    with pytest.raises(ConfigError, match="dp_at is a setting of differential privacy"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_at=client")
