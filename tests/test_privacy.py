"""Client-level differential privacy (fl/privacy.py): the noise on each clipped uplink, the accountant's epsilon
against known values, and a private run that records its epsilon per round and replays from its log."""

import json

import numpy as np
import pytest
import torch
from toy_federation import tiny_federated_config, toy_clients, toy_context

from zofed.fl.plan import FederationPlan
from zofed.fl.privacy import PUBLIC_EXAMPLES, add_noise, client_noise, epsilon_spent, new_secret, server_noise
from zofed.fl.protocol import ClientUpdate, decode
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.server import RoundInbox
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run
from zofed.run.uplink_log import LOG_NAME, read_log


def test_the_noise_has_the_clip_norms_scale_and_comes_from_a_secret_not_the_seed():
    # enough numbers that the sample std sits far inside the tolerance whatever the (fresh, random) secret draws:
    # 200,000 of them put it within 0.16% (one sd) of the true 3.0, 2,000 within 1.6%, failing 3% one run in 17
    update = ClientUpdate(4, 2, np.zeros(0, np.uint64), 5, np.zeros((50_000, 4), np.float32), 10, {})
    secret = new_secret()
    noised = add_noise(update, 1.5, 2.0, server_noise(secret, 4, 2))
    assert noised.grads.dtype == np.float32 and noised.grads.std() == pytest.approx(3.0, rel=0.03)
    # the same secret repeats its noise (a resumed run), each round and client draws anew, each run's secret differs
    assert np.array_equal(noised.grads, add_noise(update, 1.5, 2.0, server_noise(secret.clone(), 4, 2)).grads)
    assert not np.array_equal(noised.grads, add_noise(update, 1.5, 2.0, server_noise(secret, 5, 2)).grads)
    assert not np.array_equal(noised.grads, add_noise(update, 1.5, 2.0, server_noise(secret, 4, 3)).grads)
    assert not torch.equal(secret, new_secret())
    dense = ClientUpdate(4, 2, np.zeros(0, np.uint64), None, np.zeros((0, 1), np.float32), 10, {},
                         dense=np.zeros(40_000, np.float32))
    assert add_noise(dense, 1.0, 1.0, client_noise()).dense.std() == pytest.approx(1.0, rel=0.1)


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
    # The log holds the numbers the aggregation read, after clipping and noise: the replay needs no secret, and
    # the logged scalars are no longer the clients' (clipped to 1, they would have a norm of at most 1).
    assert replay_run(out).matches
    header, logged, _ = read_log(out / LOG_NAME)
    norms = [float(np.linalg.norm(decode(data).grads)) for r in logged for _, data in r.uplinks]
    assert header["server_noised"] and max(norms) > 1.0
    # A second run with the same seed noises differently: the noise is not the seed's to repeat
    again = tmp_path / "again"
    run_federated(tiny_federated_config(tiny_workspace, again, "federation.method=zo-seeds",
                                        "federation.clip_norm=1.0", "federation.dp_noise=2.0"), show_progress=False)
    assert read_log(again / LOG_NAME)[1][0].uplinks != logged[0].uplinks
    with pytest.raises(ConfigError, match="dp_noise needs federation.clip_norm"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_noise=1.0")
    with pytest.raises(ConfigError, match="dp_delta is a setting of differential privacy"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_delta=1e-6")


def test_local_dp_noises_at_the_client_and_the_server_leaves_the_numbers_be(tiny_workspace, tmp_path):
    def uplinks(out, *extra):
        run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds", *extra),
                      show_progress=False)
        return [decode(data) for r in read_log(out / LOG_NAME)[1] for _, data in r.uplinks]

    # 8 queries a step: 16 scalars an uplink, so the noise's norm is near 8e-3 on every draw (with the 2 scalars of
    # one query, a fresh draw fell under the 1e-3 clip about one run in 9)
    private = ("federation.clip_norm=1e-3", "federation.dp_noise=2.0", "federation.dp_at=client", "zo.queries=8")
    plain = uplinks(tmp_path / "plain", "zo.queries=8")
    local = uplinks(tmp_path / "local", *private)
    first = plain[0]  # the first round starts from the same model: the same honest scalars, clipped and noised
    clipped = first.grads * min(1.0, 1e-3 / float(np.linalg.norm(first.grads)))
    noise = local[0].grads - clipped
    # noise of about 2 x 1e-3 on each scalar; a second run's client draws other noise (its own entropy, which
    # neither the seed nor the server knows)
    assert 2e-4 < float(np.abs(noise).mean()) < 1e-2 and local[0].grads.shape == first.grads.shape == (2, 8)
    again = uplinks(tmp_path / "again", *private)
    assert not np.array_equal(again[0].grads, local[0].grads)
    assert float(np.linalg.norm(local[0].grads)) > 1e-3  # what the server logged is the noised numbers, unclipped
    assert replay_run(tmp_path / "local").matches
    with pytest.raises(ConfigError, match="dp_at is a setting of differential privacy"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.dp_at=client")


def test_a_private_run_keeps_its_noise_secret_across_a_resume(tiny_workspace, tmp_path):
    """Two copies of a run stopped after round 2 resume to the same model: round 3's noise comes from the secret
    in the checkpoint, not from a new draw (which would make each resumed copy differ)."""
    import shutil

    from safetensors.torch import load_file

    private = ("federation.method=zo-seeds", "federation.clip_norm=1.0", "federation.dp_noise=2.0")
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "a", *private, "federation.rounds=2"),
                  show_progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    finals = []
    for name in ("a", "b"):
        run_federated(tiny_federated_config(tiny_workspace, tmp_path / name, *private), resume=True,
                      show_progress=False)
        finals.append(load_file(str(tmp_path / name / "final" / "trainable.safetensors")))
        assert replay_run(tmp_path / name).matches
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def _exact_values(update: ClientUpdate) -> list[bytes]:
    """How an uplink's own train loss and example count would read in its encoded header."""
    return [json.dumps(update.metrics["train_loss"]).encode(), f'"n":{update.num_examples}'.encode()]


def test_a_local_dp_uplink_carries_no_exact_per_client_value():
    """The accountant covers the noised numbers only: the uplink a local-DP client sends holds neither its train
    loss nor its example count, only the public count every noised uplink carries."""
    ctx = toy_context(mode="lora")
    plan = FederationPlan("zo-seeds", 6, 3, 2, lr=1e-2, eps=1e-2, run_seed=4, batch_size=8)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks, clip_norm=1.0, dp_noise=2.0,
                        dp_at_clients=True)
    local = server.round_plan(0)
    downlink, indices = server.downlink(local, 2), toy_clients()[2]
    honest = decode(ClientRole(ctx).train(downlink, 2, indices, 0))
    assert honest.num_examples == len(indices) != PUBLIC_EXAMPLES and np.isfinite(honest.metrics["train_loss"])
    sent = ClientRole(ctx, local_dp=(1.0, 2.0)).train(downlink, 2, indices, 0)
    private = decode(sent)
    assert private.metrics == {} and private.num_examples == PUBLIC_EXAMPLES
    assert not any(value in sent for value in _exact_values(honest))
    inbox = RoundInbox()  # and the server takes it as a valid uplink
    server.receive(inbox, local, 2, sent)
    assert len(inbox.accepted) == 1 and not inbox.rejected


def test_a_central_dp_log_and_record_carry_no_exact_per_client_value(tiny_workspace, tmp_path):
    """The log of a central-DP run reveals no more than the model: its uplinks hold no client's train loss or
    example count (they are read from a plain run of the same seed, whose first round's uplinks are the same
    clients' honest ones), and the round's record holds no train loss."""
    def first_round(out, *extra):
        run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds",
                                            "federation.rounds=1", *extra), show_progress=False)
        record = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                      if r["event"] == "round")
        return record, read_log(out / LOG_NAME)[1][0].uplinks

    plain_record, plain = first_round(tmp_path / "plain")
    private_record, private = first_round(tmp_path / "private", "federation.clip_norm=1.0",
                                          "federation.dp_noise=2.0")
    assert [c for c, _ in private] == [c for c, _ in plain] and len(plain) == 2
    for (_, honest), (_, noised) in zip(plain, private, strict=True):
        exact, logged = decode(honest), decode(noised)
        assert exact.num_examples > 1 and "train_loss" in exact.metrics  # there was something to leak
        assert logged.metrics == {} and logged.num_examples == PUBLIC_EXAMPLES
        assert not any(value in noised for value in _exact_values(exact))
    assert np.isfinite(plain_record["train_loss"]) and np.isnan(private_record["train_loss"])
    assert "clipped" not in private_record  # which clients' numbers were over the clip norm is theirs too
