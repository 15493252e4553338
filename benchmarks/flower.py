"""Benchmark: the Flower backend against the in-process engine on the same config.

One tiny random-init causal LM (LoRA r=2) and a toy sentiment set, 2 clients (one SuperNode each), 3 rounds of
the default method (zofed) with 4 local steps of batch 8, run three ways: in-process, Flower's simulation
engine, and a Flower deployment of real processes on 127.0.0.1 (SuperLink, 2 SuperNodes, `flwr run`, no TLS).
Every process uses one torch thread, so the three final models can be compared bit for bit.

Reported per backend: wall time of the whole run, each round's wall time (send to aggregate, no evaluation),
the rest (start-up, evaluation, writing the run directory), uplink bytes per client message (zofed's bytes,
and on Flower the whole Flower message), and whether the final model equals the in-process one.
Writes docs/results/flower.json. Run: `make bench-flower` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # flower_local: the local-deployment harness
from flower_local import run_insecure

from zofed.atomic_files import write_atomic_text
from zofed.flower.deploy import write_app
from zofed.flower.simulation import run_flower_simulation
from zofed.models.tiny import tiny_causal_lm
from zofed.run.config import load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "flower.json"
ROUNDS, CLIENTS, LOCAL_STEPS, BATCH = 3, 2, 4, 8


def workspace(root: Path) -> Path:
    """The tiny model directory and toy data the tests use (tests/conftest.py), written once."""
    tiny = tiny_causal_lm(seed=1)
    tiny.model.save_pretrained(root / "model")
    tiny.tokenizer.save_pretrained(root / "model")
    for name, n, seed in (("train", 200, 0), ("test", 60, 1)):
        rng = np.random.default_rng(seed)
        with (root / f"{name}.jsonl").open("w") as f:
            for _ in range(n):
                label = int(rng.integers(2))
                word = rng.choice(["good", "great"] if label else ["bad", "awful"])
                filler = " ".join(f"w{int(i)}" for i in rng.integers(0, 20, size=3))
                f.write(json.dumps({"text": f"the movie {filler} was {word}", "label": label}) + "\n")
    return root


def config(ws: Path, out: Path) -> FederatedConfig:
    overrides = [f"model.name={ws / 'model'}", f"data.source={ws / 'train.jsonl'}",
                 f"data.test_source={ws / 'test.jsonl'}", "data.eval_examples=20",
                 "task.template='review : {text} . sentiment :'", "task.verbalizer=[negative, positive]",
                 "trainable.mode=lora", "trainable.lora_r=2", "optimizer.lr=0.02", "zo.eps=0.01",
                 f"train.batch_size={BATCH}", f"federation.rounds={ROUNDS}", f"federation.clients_per_round={CLIENTS}",
                 f"federation.local_steps={LOCAL_STEPS}", f"federation.partition.num_clients={CLIENTS}",
                 "federation.partition.alpha=1.0", f"out_dir={out}"]
    return load_config(None, overrides, schema=FederatedConfig)


def summarize(out: Path, seconds: float, reference: Path | None) -> dict:
    rounds = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "round"]
    round_seconds = [r["round_seconds"] for r in rounds]
    row = {"total_seconds": round(seconds, 2), "round_seconds": round_seconds,
           "mean_round_seconds": round(float(np.mean(round_seconds)), 3),
           "other_seconds": round(seconds - sum(round_seconds), 2),
           "uplink_bytes_per_client_message": float(np.mean([r["bytes_up_per_client"] for r in rounds])),
           "downlink_bytes_per_client_message": float(np.mean([r["bytes_down_per_client"] for r in rounds])),
           "test": json.loads((out / "results.json").read_text())["test"]}
    if "flower_bytes_up_per_client" in rounds[0]:
        row["flower_uplink_bytes_per_client_message"] = float(np.mean([r["flower_bytes_up_per_client"]
                                                                      for r in rounds]))
        row["flower_downlink_bytes_per_client_message"] = float(np.mean([r["flower_bytes_down_per_client"]
                                                                        for r in rounds]))
        row["flower_connect_seconds"] = round(json.loads((out / "results.json").read_text())
                                              ["flower_connect_seconds"], 2)
    if reference is not None:
        a = load_file(str(reference / "final" / "trainable.safetensors"))
        b = load_file(str(out / "final" / "trainable.safetensors"))
        row["final_model_equals_inprocess"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # as in the Flower workers and deployed processes: comparable, bit-equal models
    rows = {}
    with tempfile.TemporaryDirectory(prefix="zofed-flower-bench-") as tmp:
        root = Path(tmp)
        ws = workspace(root)
        t0 = time.perf_counter()
        run_federated(config(ws, root / "inprocess"), show_progress=False)
        rows["inprocess"] = summarize(root / "inprocess", time.perf_counter() - t0, None)
        print("inprocess", rows["inprocess"], flush=True)
        t0 = time.perf_counter()
        run_flower_simulation(config(ws, root / "simulation"), show_progress=False)
        rows["flower_simulation"] = summarize(root / "simulation", time.perf_counter() - t0, root / "inprocess")
        print("flower_simulation", rows["flower_simulation"], flush=True)
        app = write_app(config(ws, root / "deployment"), root / "app").parent
        run = run_insecure(app, root / "processes", num_supernodes=CLIENTS)
        if run["returncode"] != 0 or run["survivors"]:
            sys.exit(f"the deployment failed (left running: {run['survivors']}):\n{run['output'][-4000:]}")
        rows["flower_deployment"] = summarize(root / "deployment", run["seconds"], root / "inprocess")
        print("flower_deployment", rows["flower_deployment"], flush=True)
    result = {
        "benchmark": "benchmarks/flower.py",
        "setup": {"model": "tiny random-init causal LM (zofed.models.tiny, seed 1), LoRA r=2",
                  "method": "zofed", "clients": CLIENTS, "clients_per_round": CLIENTS, "rounds": ROUNDS,
                  "local_steps": LOCAL_STEPS, "batch_size": BATCH, "torch_threads_per_process": 1,
                  "flwr": __import__("flwr").__version__, "torch": torch.__version__,
                  "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "definitions": {
            "total_seconds": "the whole run: in-process and simulation from the call to its return; deployment "
                             "from starting the SuperLink to `flwr run` returning",
            "round_seconds": "each round from the first downlink to the aggregate (no evaluation)",
            "other_seconds": "total minus the rounds: start-up, evaluation, writing the run directory",
            "flower_connect_seconds": "ServerApp waiting for the SuperNodes and their partition answers",
            "uplink_bytes_per_client_message": "zofed's encoded ClientUpdate",
            "flower_uplink_bytes_per_client_message": "the whole Flower reply message as Flower serializes it"},
        "backends": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic_text(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
