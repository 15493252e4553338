"""Benchmark: why the server keeps two aggregation paths (fl/aggregate.py, fl/pooled.py), timed in one process.

A round of zofed uplinks (random scalars, each client its own example count and block distribution, private or
shared step seeds) on small trainable tensors is aggregated by `WeightedMean` both ways: the general path (one
`Contribution` per client, pooled term by term: what every other aggregator and every other round needs) and the
fast path (the round pooled on arrays, `update_pooled`). Both regenerate the same noise rows (tests check the
means are equal bit for bit), so the gap is the per-client bookkeeping. Best of a few repeats, one thread.

Run: `.venv/bin/python benchmarks/paths.py` (writes docs/results/paths.json).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from zofed.atomic_files import write_atomic_text
from zofed.fl.aggregate import WeightedMean
from zofed.fl.personal import BlockSampling
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import ClientUpdate, encode
from zofed.fl.roles import ServerRole
from zofed.fl.server import RoundInbox

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "paths.json"
SIZES = (4096, 64, 4096, 64, 2048, 2)  # small trainable tensors, as a classifier head and norm gains
STEPS, REPEATS = 3, 3


def _round(clients: int, shared: bool) -> tuple[ServerRole, object, RoundInbox]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in SIZES]
    plan = FederationPlan("zofed", clients, clients, STEPS, lr=1e-2, eps=1e-2, run_seed=7,
                          sampling=BlockSampling(shared_seeds=shared))
    server = ServerRole(plan, tensors, None)
    local, inbox, rng = server.round_plan(0), RoundInbox(), np.random.default_rng(0)
    for c in server.sample(0):
        server.send_state(local, c)
        seeds = server.method.step_seeds(local, c)
        grads = rng.normal(size=(local.local_steps, local.queries)).astype(np.float32)
        explicit = np.asarray(seeds.seeds, np.uint64) if seeds.base_seed is None else np.zeros(0, np.uint64)
        update = ClientUpdate(0, c, explicit, seeds.base_seed, grads, 3 + c % 7, {"train_loss": 1.0})
        server.receive(inbox, local, c, encode(update))
    return server, local, inbox


def _general(server: ServerRole, local, inbox: RoundInbox) -> list[torch.Tensor]:
    contributions = [server.contribution(u, local) for u in inbox.accepted]
    return WeightedMean().update(server.tensors, contributions, {})[0]


def _pooled(server: ServerRole, local, inbox: RoundInbox) -> list[torch.Tensor]:
    server._steps = None  # the round's arrays are part of the fast path's cost
    return WeightedMean().update_pooled(server.tensors, server.pooled_terms(local, inbox.accepted), {})[0]


def _best(fn, *args) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for clients in (100, 1000):
        for shared in (False, True):
            server, local, inbox = _round(clients, shared)
            args = (server, local, inbox)
            same = all(torch.equal(a, b) for a, b in zip(_general(*args), _pooled(*args), strict=True))
            general_s, pooled_s = _best(_general, *args), _best(_pooled, *args)
            rows.append({"clients": clients, "shared_seeds": shared, "general_s": round(general_s, 4),
                         "pooled_s": round(pooled_s, 4), "ratio": round(general_s / pooled_s, 1),
                         "bit_identical": same, "load_1min": round(os.getloadavg()[0], 2)})
            print(rows[-1], flush=True)
    out = {"machine": f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "threads": 1, "trainable_sizes": list(SIZES), "local_steps": STEPS,
           "repeats": REPEATS, "rows": rows}
    write_atomic_text(RESULTS, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
