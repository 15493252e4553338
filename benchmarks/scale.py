"""Benchmark: the in-process engine and the server as the federation grows.

Part `population`: memory and time as the number of clients grows (10, 100, 1,000). Same model (MiniLM-L6
encoder, LoRA on query/value plus the classifier head), same data (built-in tweets, IID split), the same number
of clients sampled per round and local steps; only the population changes. Each population runs in a fresh
process whose resident-set peak (VmHWM) is read after the rounds. Target: peak memory at 1,000 clients at most
1.2 times that at 10.

Part `aggregation`: the server's seconds per round as the clients per round grow (10, 100, 1,000), with zofed's
method and server optimizer on SmolLM2 (the demo's trainable set, every RMSNorm gain, and every parameter), with
private and with shared step seeds. The uplinks are made from each client's real step seeds and downlink state
with random scalars (the server's work does not depend on the scalars' values; the clients' training is not
timed), then received (decoded and checked) and aggregated (rebuilt, pooled, observed, applied) as in a run.
Target: aggregation seconds at 1,000 clients per round at most twice those at 10.

Run: `make bench-scale` (writes docs/results/scale.json and docs/results/scale.md); `--part aggregation` runs
one part. Measure on a quiet machine: each row records the load average beside it.
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

from zofed.atomic_files import write_atomic_text

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SETTINGS = {"model": "minilm-l6", "trainable": "lora (query, value) + classifier", "data": "tweets, iid split",
            "method": "zo-seeds", "clients_per_round": 5, "local_steps": 2, "rounds": 3, "batch_size": 16}


def worker(num_clients: int) -> dict:
    from zofed.data.partition import PartitionConfig, client_splits
    from zofed.fl.client import ClientContext
    from zofed.fl.plan import FederationPlan
    from zofed.fl.roles import ServerRole
    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig
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


AGG_SETTINGS = {"model": "smollm2-135m", "method": "zofed (its default server optimizer)", "local_steps": 4,
                "queries": 1, "rounds": 4, "timed_rounds": "2-4 (the first draws from equal distributions)"}
AGG_TRAINABLE = {"gains": ["trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']"],
                 "all": ["trainable.mode=all"]}


def aggregation_worker(trainable: str, shared: bool, per_round: int) -> dict:
    """Server seconds per round (receive, rebuild, observe, optimizer) for `per_round` clients a round."""
    import numpy as np

    from zofed.fl.protocol import ClientUpdate, encode
    from zofed.fl.roles import ServerRole
    from zofed.fl.server import RoundInbox
    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig, federation_plan
    from zofed.run.setup import build

    torch.set_num_threads(1)
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "federated_demo.yaml", [
        *AGG_TRAINABLE[trainable], f"federation.sampling.shared_seeds={str(shared).lower()}",
        f"federation.clients_per_round={per_round}", f"federation.partition.num_clients={per_round}",
        f"federation.local_steps={AGG_SETTINGS['local_steps']}"], schema=FederatedConfig)
    setup = build(config)
    plan = federation_plan(config, per_round)
    server = ServerRole(plan, setup.trainable.tensors(), setup.trainable.masks,
                        config.federation.server_optimizer.build("zofed", AGG_SETTINGS["rounds"]))
    del setup
    rng = np.random.default_rng(0)
    timed: list[dict[str, float]] = []
    for r in range(AGG_SETTINGS["rounds"]):
        local = server.round_plan(r)
        uplinks = []
        for c in server.sample(r):
            server.send_state(local, c)
            seeds = server.method.step_seeds(local, c)
            grads = rng.normal(size=(local.local_steps, local.queries)).astype(np.float32)
            uplinks.append((c, encode(ClientUpdate(r, c, np.zeros(0, np.uint64), seeds.base_seed, grads, 8,
                                                   {"train_loss": 1.0}))))
        t0 = time.perf_counter()
        inbox = RoundInbox()
        for c, data in uplinks:
            server.receive(inbox, local, c, data)
        receive = time.perf_counter() - t0
        server.aggregate(local, inbox)
        assert len(inbox.accepted) == per_round, inbox.rejected
        if r > 0:
            timed.append({"receive": receive, **server.last_seconds})
    mean = {k: float(np.mean([t[k] for t in timed])) for k in timed[0]}
    return {"trainable": trainable, "trainable_values": server.num_trainable, "seeds": "shared" if shared else
            "private", "clients_per_round": per_round, **{f"{k}_s": round(v, 4) for k, v in mean.items()},
            "aggregate_s": round(mean["rebuild"] + mean["observe"] + mean["optimizer"], 4),
            "server_s": round(sum(mean.values()), 4), "load_1min": round(os.getloadavg()[0], 2)}


def run_worker(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], check=True, capture_output=True, text=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def population_part(clients: list[int]) -> dict:
    rows = [run_worker("population", str(n)) for n in clients]
    base = rows[0]["peak_rss_mib"]
    for row in rows:
        row["peak_over_smallest"] = round(row["peak_rss_mib"] / base, 3)
    return {"meta": SETTINGS, "rows": rows}


def aggregation_part(per_round: list[int], trainables: list[str]) -> dict:
    rows = [run_worker("aggregation", t, seeds, str(n)) for t in trainables for seeds in ("private", "shared")
            for n in per_round]
    for row in rows:
        base = next(r for r in rows if r["trainable"] == row["trainable"] and r["seeds"] == row["seeds"])
        row["aggregate_over_smallest"] = round(row["aggregate_s"] / base["aggregate_s"], 2)
        row["server_over_smallest"] = round(row["server_s"] / base["server_s"], 2)
    return {"meta": AGG_SETTINGS, "rows": rows}


def population_lines(part: dict) -> list[str]:
    lines = ["## Population", "", ", ".join(f"{k}: {v}" for k, v in part["meta"].items()) + ".", "",
             "| clients | peak RSS (MiB) | peak / smallest population | seconds per round | uplink bytes per client |",
             "|---|---|---|---|---|"]
    return lines + [f"| {r['clients']:,} | {r['peak_rss_mib']} | **{r['peak_over_smallest']}** | "
                    f"{r['seconds_per_round']} | {r['bytes_up_per_client']:.0f} |" for r in part["rows"]]


def aggregation_lines(part: dict) -> list[str]:
    lines = ["## Server aggregation per round", "", ", ".join(f"{k}: {v}" for k, v in part["meta"].items()) + ".",
             "Receive decodes and checks every uplink; rebuild regenerates the noise and pools the clients' terms; "
             "observe files zofed's block probes; optimizer applies the server step. Aggregation is rebuild + "
             "observe + optimizer, server time adds receive; each ratio compares with the same setting's smallest "
             "round.", "",
             "| trainable (values) | seeds | clients per round | receive s | rebuild s | observe s | optimizer s | "
             "aggregation s | / smallest | server s | / smallest | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in part["rows"]:
        lines.append(f"| {r['trainable']} ({r['trainable_values']:,}) | {r['seeds']} | {r['clients_per_round']:,} | "
                     f"{r['receive_s']} | {r['rebuild_s']} | {r['observe_s']} | {r['optimizer_s']} | "
                     f"{r['aggregate_s']} | **{r['aggregate_over_smallest']}** | {r['server_s']} | "
                     f"{r['server_over_smallest']} | {r['load_1min']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["population", "aggregation", "both"], default="both")
    parser.add_argument("--clients", type=int, nargs="*", default=[10, 100, 1000],
                        help="populations (part population) and clients per round (part aggregation)")
    parser.add_argument("--trainable", nargs="*", choices=sorted(AGG_TRAINABLE), default=["gains", "all"])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        row = worker(int(rest[0])) if kind == "population" else \
            aggregation_worker(rest[0], rest[1] == "shared", int(rest[2]))
        print(json.dumps(row))
        return
    path = RESULTS / "scale.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if "rows" in results:  # the population part's layout before the aggregation part existed
        results = {"population": results}
    if args.part in ("population", "both"):
        results["population"] = population_part(args.clients)
    if args.part in ("aggregation", "both"):
        results["aggregation"] = aggregation_part(args.clients, args.trainable)
    results["machine"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_atomic_text(path, json.dumps(results, indent=2))
    lines = ["# The engine and the server at scale", "",
             f"machine: {results['machine']['machine']}, torch {results['machine']['torch']}. "
             "Reproduce: `make bench-scale`.", ""]
    if "population" in results:
        lines += population_lines(results["population"]) + [""]
    if "aggregation" in results:
        lines += aggregation_lines(results["aggregation"]) + [""]
    write_atomic_text(RESULTS / "scale.md", "\n".join(lines))


if __name__ == "__main__":
    main()
