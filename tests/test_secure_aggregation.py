"""Secure aggregation on Flower (flower/secure.py): Flower's SecAgg+ between real simulated SuperNodes gives the
plain run's model within SecAgg+'s quantization, the server sees only the sum, and settings that need each
client's numbers are refused."""

import copy
import json
import time

import numpy as np
import pytest
from safetensors.torch import load_file

pytest.importorskip("flwr", reason="secure aggregation runs on the Flower backend (pip install 'zofed[flower]')")

from flwr.app import Context, Message, Metadata, RecordDict  # noqa: E402
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


class _InProcessGrid:
    """A Grid delivering each message to a ClientApp in this process, one Context per node (SecAgg+ keeps its
    client state there): SecAgg+'s four stages without Flower's engine."""

    def __init__(self, app, nodes):
        self.app = app
        self.contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in nodes}

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            delivered = copy.deepcopy(message)  # each node gets its own copy, as over the wire
            try:
                replies.append(self.app(delivered, self.contexts[node]))
            except RuntimeError:  # Flower turns a ClientApp's exception into an error reply; here: no reply
                continue
        return replies


def _secure_round(monkeypatch, grads, examples, drop=(), forge=()):
    """secure_deliver over an in-process grid whose client c sends `grads[c]` with `examples[c]` examples; clients
    in `drop` fail while training, those in `forge` send another client's header."""
    from flwr.clientapp import ClientApp
    from flwr.supercore.task_identity import TaskIdentity

    from zofed.flower.secure import secure_deliver, secure_mod

    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):  # the server's, as in a Flower run
        monkeypatch.setattr(TaskIdentity, key, value)
    app = ClientApp()

    @app.train(mods=[secure_mod])
    def train(message, context):
        downlink, client, round_id, scalar_range = read_secure_train(message)
        if client in drop:
            raise RuntimeError(f"client {client} crashed")
        header_id = (client + 1) % len(grads) if client in forge else client
        update = ClientUpdate(round_id, header_id, np.zeros(0, np.uint64), 5, grads[client], examples[client],
                              {"train_loss": 1.0})
        return secure_reply(message, encode(update), scalar_range)

    nodes = {c: 100 + c for c in range(len(grads))}
    return secure_deliver(_InProcessGrid(app, nodes.values()), 3, [(c, b"down") for c in nodes], nodes, 10.0,
                          max(examples), timeout=None)


def test_secagg_plus_unmasks_the_weighted_mean_survives_a_dropout_and_refuses_a_forged_header(monkeypatch):
    from zofed.fl.rounds import Failure, Summed

    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(4)]
    examples = [10, 20, 30, 40]
    full = _secure_round(monkeypatch, grads, examples)
    mean = sum(n * g.astype(np.float64) for n, g in zip(examples, grads, strict=True)) / sum(examples)
    summed = decode(full.replies[0])
    assert summed.num_examples == 100 and np.allclose(summed.grads, mean, atol=2 * 20 / 2**22)
    assert all(full.replies[c] == Summed(0) for c in (1, 2, 3)) and full.clipped == 0
    assert full.flower_bytes_up > 4 * len(full.replies[0])  # keys, shares and masked vectors
    # client 2 crashes after the keys are shared: its masks are recovered from the others' shares
    dropped = _secure_round(monkeypatch, grads, examples, drop={2})
    rest = [0, 1, 3]
    mean = sum(examples[c] * grads[c].astype(np.float64) for c in rest) / sum(examples[c] for c in rest)
    assert np.allclose(decode(dropped.replies[0]).grads, mean, atol=2 * 20 / 2**22)
    assert isinstance(dropped.replies[2], Failure) and dropped.replies[2].reason.startswith("client_error")
    assert dropped.replies[1] == dropped.replies[3] == Summed(0)
    # a client that names another in its clear part spoils the sum, which cannot be taken apart: all refused
    forged = _secure_round(monkeypatch, grads, examples, forge={1})
    assert all(isinstance(r, Failure) and "another client's header" in r.reason for r in forged.replies.values())
