"""Secure aggregation on Flower (flower/secure.py): Flower's SecAgg+ between real simulated SuperNodes gives the
plain run's model within SecAgg+'s quantization, the server sees only the sum, and settings that need each
client's numbers are refused."""

import json
import time

import numpy as np
import pytest
from safetensors.torch import load_file

pytest.importorskip("flwr", reason="secure aggregation runs on the Flower backend (pip install 'zofed[flower]')")

from flwr.app import Message, Metadata, RecordDict  # noqa: E402
from flwr.common import FitIns, Parameters  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from toy_federation import tiny_federated_config  # noqa: E402

from zofed.fl.protocol import ClientUpdate, decode, encode  # noqa: E402
from zofed.flower.secure import read_secure_train, secure_reply, summed_uplink  # noqa: E402
from zofed.flower.simulation import run_flower_simulation  # noqa: E402
from zofed.run.config import ConfigError  # noqa: E402
from zofed.run.federated import run_federated  # noqa: E402
from zofed.run.replay import replay_run  # noqa: E402

SECURE = ("flower.secure_aggregation=true", "flower.secagg_range=50")


def _config(ws, out, *extra):
    return tiny_federated_config(ws, out, "federation.method=decomfl", "data.eval_examples=20", "federation.rounds=2",
                                 "federation.partition.num_clients=3", "federation.clients_per_round=3",
                                 "flower.reply_timeout=300", "flower.node_timeout=600", *extra)


def _rounds(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "round"]


def test_secagg_plus_on_flower_gives_the_plain_model_within_quantization_and_replays(tiny_workspace, tmp_path):
    run_federated(_config(tiny_workspace, tmp_path / "plain"), show_progress=False)
    secure = run_flower_simulation(_config(tiny_workspace, tmp_path / "secure", *SECURE), show_progress=False)
    plain, masked = (load_file(str(tmp_path / d / "final" / "trainable.safetensors")) for d in ("plain", "secure"))
    assert plain.keys() == masked.keys()
    # each scalar is quantized to a step of 2 x 50 / 2^22 ~ 2.4e-5; the model moves by lr x scalars x noise
    moved = max(float((plain[k] - masked[k]).abs().max()) for k in plain)
    assert 0 < moved < 1e-5, moved  # not bit-identical (the scalars were quantized), yet the same model
    assert max(float(plain[k].abs().max()) for k in plain if "lora_B" in k) > 10 * moved  # LoRA B started at 0
    for p, s in zip(_rounds(tmp_path / "plain"), _rounds(tmp_path / "secure"), strict=True):
        assert s["secure_sum_of"] == s["accepted"] == p["accepted"] == 3 and s["secagg_clipped"] == 0
        assert s["clients"] == p["clients"] and s["client_errors"] == 0
        # SecAgg+'s keys, shares and masked vectors cost far more than three seed-and-scalar uplinks
        assert s["flower_bytes_up_per_client"] > 10 * p["bytes_up_per_client"]
    assert secure["test"]["accuracy"] == pytest.approx(
        json.loads((tmp_path / "plain" / "results.json").read_text())["test"]["accuracy"], abs=0.06)
    # the uplink log holds one summed uplink a round, from which the model rebuilds bit for bit
    log = [json.loads(x) for x in (tmp_path / "secure" / "uplinks.jsonl").read_text().splitlines()[1:]]
    assert len(log) == 2
    assert replay_run(tmp_path / "secure").matches


def _train_message(content: RecordDict) -> Message:
    """A train message as the SuperLink delivers it (metadata given: no Flower run in this process)."""
    metadata = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=1, reply_to_message_id="",
                        group_id="0", created_at=time.time(), ttl=60.0, message_type="train")
    return Message(content, metadata=metadata)


def test_a_secure_client_reply_hides_its_scalars_behind_the_parameters_and_counts_clipping():
    grads = np.array([[3.0], [-80.0], [0.5]], np.float32)
    update = ClientUpdate(4, 2, np.zeros(0, np.uint64), 99, grads, 17, {"train_loss": 0.7})
    ins = FitIns(Parameters([], ""), {"zofed-downlink": b"down", "client-id": 2, "round": 4, "secagg-range": 50.0})
    message = _train_message(compat.fitins_to_recorddict(ins, True))
    assert read_secure_train(message) == (b"down", 2, 4, 50.0)
    reply = secure_reply(message, encode(update), 50.0)
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    from flwr.common import parameters_to_ndarrays

    assert np.array_equal(parameters_to_ndarrays(fitres.parameters)[0], [[3.0], [-50.0], [0.5]])
    assert fitres.num_examples == 17 and fitres.metrics["clipped"] == 1
    header = decode(fitres.metrics["header"])
    assert header.base_seed == 99 and not header.grads.any()  # the clear part carries no scalar


def test_the_summed_uplink_carries_the_mean_under_the_shared_seeds_and_refuses_mismatches():
    headers = [ClientUpdate(1, c, np.zeros(0, np.uint64), 7, np.zeros((2, 1), np.float32), n, {})
               for c, n in ((0, 10), (3, 30))]
    uplink = decode(summed_uplink(headers, [0, 3], np.array([[1.0], [2.0]]), [0.5, 0.7]))
    assert uplink.client_id == 0 and uplink.num_examples == 40 and uplink.base_seed == 7
    assert np.array_equal(uplink.grads, [[1.0], [2.0]]) and uplink.metrics["train_loss"] == pytest.approx(0.6)
    other = ClientUpdate(1, 3, np.zeros(0, np.uint64), 8, np.zeros((2, 1), np.float32), 30, {})
    with pytest.raises(ValueError, match="share their step seeds"):
        summed_uplink([headers[0], other], [0, 3], np.zeros((2, 1)), [0.5, 0.7])
    with pytest.raises(ValueError, match="another client's header"):
        summed_uplink(headers, [0, 4], np.zeros((2, 1)), [0.5, 0.7])


def test_settings_that_need_each_clients_numbers_are_refused(tiny_workspace, tmp_path):
    for extra, message in ((["federation.method=zofed"], "needs each client's own numbers"),
                           (["federation.method=zo-seeds"], "needs each client's own numbers"),
                           (["federation.aggregator=median"], "use mean"),
                           (["federation.clip_norm=1"], "cannot clip numbers it never sees"),
                           (["federation.screen_threshold=0.1"], "screening"),
                           (["optimizer.name=zo-adam"], "use mezo"),
                           (["federation.clients_per_round=1"], "clients_per_round >= 2")):
        with pytest.raises(ConfigError, match=message):
            tiny_federated_config(tiny_workspace, tmp_path / "bad", "federation.method=decomfl", *SECURE, *extra)
    with pytest.raises(ConfigError, match="secagg_range is a setting of flower.secure_aggregation"):
        tiny_federated_config(tiny_workspace, tmp_path / "bad", "flower.secagg_range=5")
    ok = tiny_federated_config(tiny_workspace, tmp_path / "ok", "federation.method=hiso", *SECURE,
                               "federation.clip_norm=1", "federation.dp_noise=0.5", "federation.dp_at=client")
    with pytest.raises(ConfigError, match="runs on the Flower backend"):
        run_federated(ok, show_progress=False)
