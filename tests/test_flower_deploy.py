"""The Flower backend deployed as real processes on 127.0.0.1: a SuperLink, two SuperNodes (node config
carrying the partition) and `flwr run` of the app `zofed flower-app` writes; then the same with TLS and
SuperNode authentication, where a SuperNode whose key was never registered is refused.

Every process a test starts is stopped by its PID in a `finally` (tests/flower_local.py), with the processes
Flower started under it (SuperExec, ServerApp and ClientApp processes); every wait has a timeout so a hang
fails the test instead of blocking CI.
"""

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("flwr", reason="the Flower backend needs flwr (pip install 'zofed[flower]')")

from flower_local import LocalDeployment, free_port, run_insecure  # noqa: E402
from toy_federation import tiny_federated_config  # noqa: E402

from zofed.flower.deploy import write_app  # noqa: E402
from zofed.run.federated import run_federated  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240  # seconds for a whole `flwr run`


def _config(ws, out, *extra):
    return tiny_federated_config(ws, out, "data.eval_examples=20", "federation.rounds=2",
                                 "federation.partition.num_clients=2", "flower.node_timeout=90",
                                 "flower.reply_timeout=150", *extra)


def _rounds(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "round"]


def test_superlink_and_two_supernodes_run_two_rounds(tiny_workspace, tmp_path):
    # The app is written for 1 round at another lr and out_dir; Flower's --run-config sets them back through the
    # flat keys, so the run must equal the in-process one below.
    cfg = _config(tiny_workspace, tmp_path / "elsewhere", "federation.rounds=1", "optimizer.lr=0.05")  # zofed
    app = write_app(cfg, tmp_path / "app").parent
    run = run_insecure(app, tmp_path / "processes", num_supernodes=2, timeout=RUN_TIMEOUT,
                       run_config=f"rounds=2 lr=0.02 out-dir='{tmp_path / 'deployed'}'")
    print(f"deployment: {run['seconds']:.1f} s from the SuperLink's start to the run's end")
    assert run["survivors"] == [], f"processes left running: {run['survivors']}"
    assert run["returncode"] == 0, run["output"][-4000:]
    out = tmp_path / "deployed"
    assert (out / "results.json").exists(), run["output"][-4000:]
    assert not (tmp_path / "elsewhere").exists()  # out-dir replaced the app's out_dir
    results = json.loads((out / "results.json").read_text())
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["accepted"] == 2 and r["rejected"] == [] and r["missing"] == r["client_errors"] == 0 for r in rounds)
    assert results["backend"] == "flower" and results["method"] == "zofed"
    assert 0 < results["bytes_up_per_client_round"] < 400  # seeds and scalars, not weights
    assert "round 2: accepted 2" in run["output"]  # the ServerApp's log reaches `flwr run --stream`
    # The SuperNodes built model and data from the config inside the app: the same model as in-process.
    run_federated(_config(tiny_workspace, tmp_path / "inprocess"), show_progress=False)
    a = load_file(str(tmp_path / "inprocess" / "final" / "trainable.safetensors"))
    b = load_file(str(out / "final" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tls_and_supernode_authentication_refuse_an_unregistered_node(tiny_workspace, tmp_path):
    assert shutil.which("openssl") and shutil.which("ssh-keygen"), "scripts/make_flower_certs.sh needs both"
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "scripts" / "make_flower_certs.sh"), str(certs), "3"], check=True,
                   timeout=120, capture_output=True)
    ca = certs / "ca.crt"
    cfg = _config(tiny_workspace, tmp_path / "secure", "federation.rounds=1", "federation.local_steps=1")
    app = write_app(cfg, tmp_path / "app").parent
    deployment = LocalDeployment(tmp_path / "processes")
    port = free_port()
    address = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        deployment.superlink(port, "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(certs / "server.pem"),
                             "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth")
        deployment.wait_healthy(port, ca=ca)
        deployment.connection("zofed-tls", address, ca)
        for n in (1, 2):  # supernode_3's key is never registered
            registered = deployment.flwr("supernode", "register", str(certs / f"supernode_{n}.pub"), "zofed-tls")
            assert registered.returncode == 0 and "registered successfully" in registered.stdout, registered
        nodes = [deployment.supernode(f"supernode{n}", address, partition, 2, "--root-certificates", str(ca),
                                      "--auth-supernode-private-key", str(certs / f"supernode_{n}"))
                 for n, partition in ((1, 0), (2, 1), (3, 1))]  # the intruder claims partition 1 as well
        intruder_exit = nodes[2].wait(timeout=60)  # refused: the SuperNode gives up instead of joining
        run = deployment.flwr("run", str(app), "zofed-tls", "--stream", timeout=RUN_TIMEOUT)
        listed = deployment.flwr("supernode", "list", "zofed-tls", "--format", "json")
    finally:
        survivors = deployment.stop_all()
    print(f"TLS deployment: {time.monotonic() - t0:.1f} s")
    assert survivors == [], f"processes left running: {survivors}"
    assert intruder_exit != 0 and "Failed to activate SuperNode" in deployment.log("supernode3").read_text()
    assert "No SuperNode found with the given public key" in deployment.log("superlink").read_text()
    output = run.stdout + run.stderr
    assert run.returncode == 0 and (tmp_path / "secure" / "results.json").exists(), output[-4000:]
    # Had the intruder joined, two nodes would hold partition 1 and the ServerApp would have refused to start.
    (only,) = _rounds(tmp_path / "secure")
    assert only["accepted"] == 2 and only["rejected"] == []
    assert listed.returncode == 0 and len(json.loads(listed.stdout)["nodes"]) == 2, listed.stdout
