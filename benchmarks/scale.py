"""Benchmark: memory and time of the in-process engine as the number of clients grows (10, 100, 1,000).

Same model (MiniLM-L6 encoder, LoRA on query/value plus the classifier head), same data (built-in tweets,
IID split), the same number of clients sampled per round and local steps; only the population changes.
Each population runs in a fresh process whose resident-set peak (VmHWM) is read after the rounds.
Target: peak memory at 1,000 clients at most 1.2 times that at 10.

Run: `make bench-scale` (writes docs/results/scale.json and docs/results/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SETTINGS = {"model": "minilm-l6", "trainable": "lora (query, value) + classifier", "data": "tweets, iid split",
            "method": "zo-seeds", "clients_per_round": 5, "local_steps": 2, "rounds": 3, "batch_size": 16}


def worker(num_clients: int) -> dict:
    from zofed.data.partition import PartitionConfig, client_splits
    from zofed.fl.client import ClientContext
    from zofed.fl.plan import FederationPlan
    from zofed.fl.roles import ServerRole
    from zofed.run.config import FederatedConfig, load_config
    from zofed.run.setup import build
    from zofed.sim.engine import simulate

    config = load_config(None, [
        "model.name=minilm-l6", "data.source=tweets", "task.type=encoder-classification", "task.max_length=64",
        "trainable.mode=lora", "trainable.lora_targets=[query, value]", "trainable.also_train=[classifier]",
        f"train.batch_size={SETTINGS['batch_size']}", f"federation.partition.num_clients={num_clients}",
        "federation.partition.scheme=iid"], schema=FederatedConfig)
    setup = build(config)
    splits = client_splits(setup.train_data, PartitionConfig(scheme="iid", num_clients=num_clients))
    ctx = ClientContext(setup.model, setup.trainable, setup.task, setup.train)
    Path("/proc/self/clear_refs").write_text("5")  # measure the federation, not the model load
    t0 = time.perf_counter()
    plan = FederationPlan("zo-seeds", num_clients, SETTINGS["clients_per_round"], SETTINGS["local_steps"], lr=1e-3,
                          eps=1e-3, batch_size=SETTINGS["batch_size"])
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks)
    result = simulate(ctx, [s.train for s in splits], server, SETTINGS["rounds"])
    seconds = (time.perf_counter() - t0) / SETTINGS["rounds"]
    status = Path("/proc/self/status").read_text()
    peak_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    return {"clients": num_clients, "peak_rss_mib": round(peak_kib / 1024, 1), "seconds_per_round": round(seconds, 2),
            "bytes_up_per_client": result.history[-1]["bytes_up_per_client"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    rows = []
    for n in args.clients:
        out = subprocess.run([sys.executable, __file__, "--worker", str(n)], check=True, capture_output=True,
                             text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["peak_rss_mib"]
    for row in rows:
        row["peak_over_smallest"] = round(row["peak_rss_mib"] / base, 3)
    meta = {**SETTINGS, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# In-process engine at scale", "",
             ", ".join(f"{k}: {v}" for k, v in meta.items()) + ". Reproduce: `make bench-scale`.", "",
             "| clients | peak RSS (MiB) | peak / smallest population | seconds per round | uplink bytes per client |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['clients']:,} | {r['peak_rss_mib']} | **{r['peak_over_smallest']}** | {r['seconds_per_round']} "
              f"| {r['bytes_up_per_client']:.0f} |" for r in rows]
    (RESULTS / "scale.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
