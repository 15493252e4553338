"""The Flower backend on Flower's simulation engine: the same model as the in-process engine, the same run
directory, failures counted per round, and a clear error when too few clients answer."""

import json
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

pytest.importorskip("flwr", reason="the Flower backend needs flwr (pip install 'zofed[flower]')")

from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from toy_federation import tiny_federated_config  # noqa: E402

from zofed.cli import app as cli  # noqa: E402
from zofed.flower.apps import make_client_app  # noqa: E402
from zofed.flower.client import answer_query, train_client  # noqa: E402
from zofed.flower.config import (  # noqa: E402
    RUN_CONFIG_KEYS,
    config_text,
    num_supernodes,
    parse_config_text,
    resolve_run_config,
)
from zofed.flower.deploy import render_app_pyproject  # noqa: E402
from zofed.flower.rounds import FederationError  # noqa: E402
from zofed.flower.simulation import run_flower_simulation  # noqa: E402
from zofed.run.config import ConfigError  # noqa: E402
from zofed.run.federated import run_federated  # noqa: E402
from zofed.run.stored_config import dump_config  # noqa: E402


def _config(ws, out, *extra):
    return tiny_federated_config(ws, out, "data.eval_examples=20", "federation.rounds=2",
                                 "federation.partition.num_clients=2", "flower.reply_timeout=300", *extra)


def _final(out):
    return load_file(str(out / "final" / "trainable.safetensors"))


def _rounds(out, event="round"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def test_flower_simulation_gives_the_in_process_model_bit_for_bit(tiny_workspace, tmp_path):
    """Same config and seeds: equal final tensors, equal per-round metrics, the same uplink bytes."""
    inproc = run_federated(_config(tiny_workspace, tmp_path / "inprocess"), show_progress=False)
    dump_config(_config(tiny_workspace, tmp_path / "flower"), tmp_path / "flower.yaml")
    invoked = CliRunner().invoke(cli, ["run", str(tmp_path / "flower.yaml"), "--backend", "flower"])
    assert invoked.exit_code == 0, invoked.output
    flower = json.loads((tmp_path / "flower" / "results.json").read_text())
    a, b = _final(tmp_path / "inprocess"), _final(tmp_path / "flower")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # trained: LoRA B starts at zero (zofed moves one block a step, so 8 steps need not reach every one of them)
    assert sum(bool(a[k].abs().sum() > 0) for k in a if "lora_B" in k) >= 2
    assert flower["test"] == inproc["test"] and flower["backend"] == "flower"
    assert flower["bytes_up_per_client_round"] == inproc["bytes_up_per_client_round"] < 400
    for x, y in zip(_rounds(tmp_path / "inprocess"), _rounds(tmp_path / "flower"), strict=True):
        for key in ("clients", "accepted", "rejected", "bytes_up_per_client", "bytes_down_per_client",
                    "train_loss", "eval_accuracy", "eval_loss", "forward_passes"):
            assert x[key] == y[key], key
        assert y["client_errors"] == y["missing"] == 0
        assert y["bytes_up_per_client"] < y["flower_bytes_up_per_client"] < 10 * y["bytes_up_per_client"] + 4096
    assert sorted(p.name for p in (tmp_path / "flower").iterdir()) == sorted(
        p.name for p in (tmp_path / "inprocess").iterdir())


def _faulty_client_app(text, fail_client, hang_client=None, hang_until=None):
    """zofed's ClientApp, except that one client raises and another never answers in round 1: it answers once
    `hang_until()` holds (the server has closed round 1 without it)."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return answer_query(message, context)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if message.metadata.group_id == "0" and partition == fail_client:
            raise RuntimeError("disk full on this client")
        if message.metadata.group_id == "0" and partition == hang_client:
            import time

            deadline = time.monotonic() + 180
            while not hang_until() and time.monotonic() < deadline:
                time.sleep(0.5)
        return train_client(message, context, text)

    return app


def test_client_errors_and_missing_replies_are_counted_per_round(tiny_workspace, tmp_path):
    # The healthy client's first reply (actor start, imports, model load) gets a wide margin on a loaded machine;
    # the hanging one answers as soon as round 1 is closed without it, so the margin costs no waiting.
    cfg = _config(tiny_workspace, tmp_path / "faulty", "federation.partition.num_clients=3",
                  "federation.clients_per_round=3", "flower.min_clients=1", "flower.reply_timeout=60")
    metrics = tmp_path / "faulty" / "metrics.jsonl"
    round_1_closed = lambda: metrics.exists() and '"round": 1' in metrics.read_text()  # noqa: E731
    app = _faulty_client_app(config_text(cfg), 0, 2, round_1_closed)
    results = run_flower_simulation(cfg, show_progress=False, client_app=app)
    first, second = _rounds(tmp_path / "faulty")
    assert first["client_errors"] == 1 and first["missing"] == 1 and first["accepted"] == 1
    reasons = {r["client"]: r["reason"] for r in first["rejected"]}
    assert reasons[0].startswith("client_error:") and "disk full on this client" in reasons[0]
    assert reasons[2].startswith("missing: no reply within 60 s")
    assert second["accepted"] == 3 and second["rejected"] == [] and second["client_errors"] == second["missing"] == 0
    assert results["rejected_uplinks"] == 2


def test_fewer_answers_than_min_clients_stop_the_run(tiny_workspace, tmp_path):
    cfg = _config(tiny_workspace, tmp_path / "short", "flower.min_clients=2")
    expected = (r"round 1: 1 of 2 sampled clients .* fewer than the 2 the round needs "
                r"\(client 1: client_error: .*disk full on this client\) \(flower.min_clients\)$")
    with pytest.raises(FederationError, match=expected):
        run_flower_simulation(cfg, show_progress=False, client_app=_faulty_client_app(config_text(cfg), 1))
    failed = _rounds(tmp_path / "short", "round_failed")
    assert len(failed) == 1 and failed[0]["client_errors"] == 1
    assert not (tmp_path / "short" / "results.json").exists()


def test_min_clients_above_the_sample_is_a_config_error(tiny_workspace, tmp_path):
    cfg = _config(tiny_workspace, tmp_path / "bad", "flower.min_clients=3")
    with pytest.raises(FederationError, match="min_clients=3 is more than the 2 clients"):
        run_flower_simulation(cfg, show_progress=False, client_app=make_client_app(config_text(cfg)))


def test_config_travels_as_text_and_in_the_app_pyproject(tiny_workspace, tmp_path):
    import tomli

    cfg = _config(tiny_workspace, tmp_path / "x", "flower.min_clients=1")
    assert parse_config_text(config_text(cfg)) == cfg
    app = tomli.loads(render_app_pyproject(cfg, resume=True))["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "zofed.flower.apps:server_app",
                                 "clientapp": "zofed.flower.apps:client_app"}
    assert app["config"]["zofed-resume"] is True
    assert parse_config_text(app["config"]["zofed-config"]) == cfg


def test_the_flower_backend_without_flwr_names_the_extra(tiny_workspace, tmp_path, monkeypatch):
    dump_config(_config(tiny_workspace, tmp_path / "none"), tmp_path / "c.yaml")
    monkeypatch.setitem(sys.modules, "flwr", None)  # as if flwr were not installed
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "c.yaml"), "--backend", "flower"])
    assert result.exit_code == 2 and "install zofed[flower]" in " ".join(result.output.split())
    assert not (tmp_path / "none").exists()


def _grouped_data(ws, path, groups):
    """The workspace's training file with a `user` column taking `groups` values, for a natural split."""
    lines = (ws / "train.jsonl").read_text().splitlines()
    path.write_text("".join(json.dumps({**json.loads(line), "user": f"u{i % groups}"}) + "\n"
                            for i, line in enumerate(lines)))
    return path


def test_a_natural_split_simulates_one_supernode_per_group(tiny_workspace, tmp_path):
    """partition.num_clients says 2, the column has 3 values: 3 clients, so 3 SuperNodes (the ServerApp would
    wait for the third until flower.node_timeout)."""
    data = _grouped_data(tiny_workspace, tmp_path / "grouped.jsonl", 3)
    cfg = _config(tiny_workspace, tmp_path / "natural", f"data.source={data}", "data.test_source=null",
                  "data.text_columns=[text, user]", "federation.partition.scheme=natural",
                  "federation.partition.column=user", "federation.rounds=1", "flower.node_timeout=60")
    assert cfg.federation.partition.num_clients == 2 and num_supernodes(cfg) == 3
    assert 'This run needs 3 SuperNodes' in render_app_pyproject(cfg)  # what `zofed flower-app` writes
    results = run_flower_simulation(cfg, show_progress=False)
    partition = json.loads((tmp_path / "natural" / "partition.json").read_text())
    assert len(partition["clients"]) == 3
    (only,) = _rounds(tmp_path / "natural")
    assert only["accepted"] == 2 and only["rejected"] == [] and results["rounds"] == 1


def _app_run_config(cfg):
    """The run config a deployed app starts with: `[tool.flwr.app.config]` of the app `zofed flower-app` writes,
    flattened as Flower flattens it."""
    import tomli
    from flwr.common.config import flatten_dict

    return flatten_dict(tomli.loads(render_app_pyproject(cfg))["tool"]["flwr"]["app"]["config"])


def test_flat_run_config_keys_are_laid_over_the_embedded_config(tiny_workspace, tmp_path):
    from flwr.common.config import fuse_dicts, parse_config_args

    cfg = _config(tiny_workspace, tmp_path / "x")
    app_config = _app_run_config(cfg)
    assert set(RUN_CONFIG_KEYS) <= set(app_config) and app_config["lr"] == cfg.optimizer.lr
    assert resolve_run_config(app_config) == cfg  # without overrides the flat keys change nothing
    # `flwr run APP CONNECTION --run-config "..."`, parsed and fused as Flower does.
    overrides = parse_config_args(["rounds=5 method='zo-seeds' clients-per-round=1 local-steps=3 lr=5e-4 eps=2e-2 "
                                   f"seed=7 out-dir='{tmp_path / 'y'}'"])
    resolved = resolve_run_config(fuse_dicts(app_config, overrides))
    expected = _config(tiny_workspace, tmp_path / "y", "federation.rounds=5", "federation.method=zo-seeds",
                       "federation.clients_per_round=1", "federation.local_steps=3", "optimizer.lr=5e-4",
                       "zo.eps=2e-2", "train.seed=7")
    assert resolved == expected and resolved.federation.partition == cfg.federation.partition


def test_the_flat_lr_is_the_clients_learning_rate_of_whatever_method_runs(tiny_workspace, tmp_path):
    """fedavg and fedadam clients step at federation.first_order_lr, never optimizer.lr: `lr` sets the former for
    them (it was laid over optimizer.lr and silently ignored). An `lr` left as written for a zeroth-order app keeps
    its value off a first-order method that a flat `method` switches to."""
    fedavg = _config(tiny_workspace, tmp_path / "x", "federation.method=fedavg", "federation.first_order_lr=2e-3")
    app_config = _app_run_config(fedavg)
    assert app_config["lr"] == 2e-3 and resolve_run_config(app_config) == fedavg
    resolved = resolve_run_config({**app_config, "lr": 5e-3})
    assert resolved.federation.first_order_lr == 5e-3 and resolved.optimizer.lr == fedavg.optimizer.lr
    with pytest.raises(ConfigError, match=r"'lr' \(federation.first_order_lr\) = -1.0: Input should be greater"):
        resolve_run_config({**app_config, "lr": -1.0})
    zofed = _config(tiny_workspace, tmp_path / "x")
    app_config = _app_run_config(zofed)
    switched = resolve_run_config({**app_config, "method": "fedadam"})
    assert switched.federation.first_order_lr == zofed.federation.first_order_lr  # not the ZO lr
    switched = resolve_run_config({**app_config, "method": "fedadam", "lr": 4e-3})
    assert switched.federation.first_order_lr == 4e-3 and switched.optimizer.lr == zofed.optimizer.lr


@pytest.mark.parametrize(("override", "named"), [
    ({"lr": -1.0}, r"'lr' \(optimizer.lr\) = -1.0: Input should be greater than 0"),
    ({"method": "sgd"}, r"'method' \(federation.method\) = 'sgd': "),
    ({"rounds": 2.5}, r"'rounds' \(federation.rounds\) = 2.5: .*integer"),
    ({"local-steps": "ten"}, r"'local-steps' \(federation.local_steps\) = 'ten'"),
    ({"out-dir": 3}, r"'out-dir' \(out_dir\) = 3: Input should be a valid string"),
    ({"seed": True}, r"'seed' \(train.seed\) = True: not a boolean setting"),
])
def test_an_invalid_flat_key_names_itself_and_its_zofed_key(tiny_workspace, tmp_path, override, named):
    app_config = _app_run_config(_config(tiny_workspace, tmp_path / "x"))
    with pytest.raises(ConfigError, match=named):
        resolve_run_config({**app_config, **override})


def test_the_server_app_and_every_client_app_resolve_the_same_overlaid_config(tiny_workspace, tmp_path, monkeypatch):
    """The deployed components (apps.server_app, apps.client_app) both read the flat keys."""
    from flwr.app import Metadata, RecordDict

    import zofed.flower.client as client_module
    import zofed.run.federated as federated
    from zofed.flower.apps import client_app, server_app
    from zofed.flower.messages import TRAIN, train_content

    run_config = {**_app_run_config(_config(tiny_workspace, tmp_path / "x")), "lr": 5e-4, "seed": 3, "rounds": 4}
    seen = {}

    class Stop(Exception):
        pass

    def prepare_run(config, **_):
        seen["server"] = config
        raise Stop

    def client_worker(text):
        seen.setdefault("clients", []).append(parse_config_text(text))
        raise Stop

    monkeypatch.setattr(federated, "prepare_run", prepare_run)
    monkeypatch.setattr(client_module, "client_worker", client_worker)
    with pytest.raises(Stop):
        server_app(None, Context(1, 0, {}, RecordDict(), run_config))
    for partition in (0, 1):
        node_config = {"partition-id": partition, "num-partitions": 2}
        # A train message as the SuperLink delivers it (metadata given: no Flower run in this process).
        metadata = Metadata(run_id=1, message_id=f"m{partition}", src_node_id=0, dst_node_id=partition + 1,
                            reply_to_message_id="", group_id="0", created_at=time.time(), ttl=60.0,
                            message_type=TRAIN)
        with pytest.raises(Stop):
            client_app(Message(train_content(b"", partition, 0), metadata=metadata),
                       Context(1, partition + 1, node_config, RecordDict(), run_config))
    assert seen["server"].optimizer.lr == 5e-4 and seen["server"].train.seed == 3
    assert seen["server"].federation.rounds == 4
    assert seen["clients"] == [seen["server"]] * 2
