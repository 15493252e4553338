"""A federated run on the in-process engine, top to bottom: build, partition, simulate rounds, evaluate, save.

The setup, the per-round evaluation, checkpoints and metrics, and the final results live in `FederatedRun`,
shared with the Flower backend (zofed.flower), so both engines write the same run directory.

The run directory holds the resolved config, the partition (summary, JSON, plot), metrics per round as JSON
lines and CSV, a checkpoint after every round (global trainable tensors, server optimizer state, round), the
final trainable tensors and results.json. Rounds derive everything from (run seed, round), so a run resumed
from its checkpoint ends exactly where an uninterrupted one would.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from zofed.data.partition import ClientSplit, client_splits, format_summary, plot_partition, summarize
from zofed.fl.client import ClientContext
from zofed.fl.first_order import FIRST_ORDER_METHODS, SERVER_OPTIMIZER_OF
from zofed.fl.personal import BlockSampling
from zofed.fl.roles import FederationPlan, ServerRole
from zofed.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint, write_atomic_text
from zofed.run.config import ConfigError, FederatedConfig, check_resumed_config, dump_config
from zofed.run.metrics import MetricsLog
from zofed.run.setup import Setup, build, eval_indices, save_final
from zofed.sim.engine import simulate


def per_client_accuracy(setup: Setup, splits: list[ClientSplit], batch_size: int) -> list[float]:
    """The global model's accuracy on each client's own held-out examples (personalized evaluation)."""
    evaluate = setup.task.evaluate
    return [evaluate(setup.model, setup.train, batch_size, s.test)["accuracy"] for s in splits if len(s.test)]


def worst_decile_mean(values: list[float]) -> float:
    ordered = sorted(values)
    return float(np.mean(ordered[: max(1, len(ordered) // 10)]))


def _write_csv(metrics: MetricsLog, path: Path) -> None:
    rows = [{k: (json.dumps(v) if isinstance(v, list | dict) else v) for k, v in r.items()} for r in metrics.read()]
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic_text(path, buffer.getvalue())


@dataclass
class FederatedRun:
    """Everything a federated run shares whatever engine carries its messages: the built model and data, the
    partition, the server role (restored from the run directory's checkpoint when resuming), and the run
    directory's writers. The engine drives the rounds; this object evaluates, checkpoints and records them."""

    config: FederatedConfig
    out: Path
    setup: Setup
    splits: list[ClientSplit]
    plan: FederationPlan
    server: ServerRole
    metrics: MetricsLog
    start_round: int
    watch: np.ndarray

    def client_context(self) -> ClientContext:
        return ClientContext(self.setup.model, self.setup.trainable, self.setup.task, self.setup.train)

    def evaluate(self, round_done: int) -> dict[str, float]:
        """The fixed test subset every `eval_every` rounds and after the last; the model must hold the global
        tensors."""
        fed = self.config.federation
        if round_done % fed.eval_every and round_done != fed.rounds:
            return {}
        result = self.setup.task.evaluate(self.setup.model, self.setup.test, self.config.train.eval_batch_size,
                                          self.watch)
        return {f"eval_{k}": v for k, v in result.items()}

    def evaluate_start(self) -> None:
        """The starting model on the fixed test subset, recorded as round 0: curves then show where training
        began. The model must hold the starting tensors."""
        result = self.setup.task.evaluate(self.setup.model, self.setup.test, self.config.train.eval_batch_size,
                                          self.watch)
        self.metrics.write({"step": 0, "event": "eval", "round": 0, **{f"eval_{k}": v for k, v in result.items()}})

    def checkpoint(self, round_done: int, server: ServerRole) -> None:
        trainable = {name: t.view_as(p) for name, t, p in zip(self.setup.trainable.names, server.tensors,
                                                               self.setup.trainable.params, strict=True)}
        save_checkpoint(self.out / "checkpoint", {"trainable": trainable, **server.state_tensors()},
                        {"round": round_done})

    def write_round(self, record: dict) -> None:
        self.metrics.write({"step": record["round"], "event": "round", **record})
        _write_csv(self.metrics, self.out / "metrics.csv")

    @contextmanager
    def progress(self, console: Console, show: bool) -> Iterator[Callable[[dict], None]]:
        """A progress bar over the rounds; yields the `on_round(record)` that writes and shows each round."""
        columns = [TextColumn("[bold]federated rounds"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[status]}")]
        with Progress(*columns, console=console, disable=not show) as progress:
            bar = progress.add_task("rounds", total=self.config.federation.rounds, completed=self.start_round,
                                    status="")

            def on_round(record: dict) -> None:
                self.write_round(record)
                shown = f"loss {record['train_loss']:.3f}"
                if "eval_accuracy" in record:
                    shown += f" | eval acc {record['eval_accuracy']:.4f}"
                if record["rejected"]:
                    shown += f" | rejected {len(record['rejected'])}"
                progress.update(bar, advance=1, status=shown)

            yield on_round

    def finish(self, seconds: float, **extra: Any) -> dict[str, Any]:
        """Save the final tensors (the model must hold the global ones), test, and write results.json."""
        setup, config, fed = self.setup, self.config, self.config.federation
        save_final(setup, self.out)
        test = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size)
        clients = per_client_accuracy(setup, self.splits, config.train.eval_batch_size)
        records = self.metrics.read()
        history = [r for r in records if r["event"] == "round"]
        start = [r["eval_accuracy"] for r in records if r["event"] == "eval" and r.get("round") == 0]
        evaluated = [r["eval_accuracy"] for r in history if "eval_accuracy" in r]
        results = {"test": test, "test_examples": len(setup.test), "method": fed.method, "rounds": fed.rounds,
                   "client_accuracies": clients,
                   "client_accuracy_mean": float(np.mean(clients)) if clients else None,
                   "client_accuracy_worst10": worst_decile_mean(clients) if clients else None,
                   "bytes_up_per_client_round": float(np.mean([r["bytes_up_per_client"] for r in history])),
                   "bytes_down_per_client_round": float(np.mean([r["bytes_down_per_client"] for r in history])),
                   "forward_passes": history[-1]["forward_passes"] if history else 0,
                   "rejected_uplinks": sum(len(r["rejected"]) for r in history),
                   "eval_accuracy_start": start[-1] if start else None,
                   "eval_accuracy_final": evaluated[-1] if evaluated else None,
                   "trainable_parameters": setup.trainable.numel(), "seconds_this_sitting": seconds, **extra}
        write_atomic_text(self.out / "results.json", json.dumps(results, indent=2))
        return results


def prepare_run(config: FederatedConfig, *, resume: bool = False, console: Console | None = None) -> FederatedRun:
    """Check the config, build model, data and partition, write the partition files, make (or restore) the
    server role."""
    console = console or Console()
    out = Path(config.out_dir)
    if find_checkpoint(out / "checkpoint") is not None:
        if not resume:
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another out_dir")
        check_resumed_config(config, out / "config.yaml")
    fed = config.federation
    first_order = fed.method in FIRST_ORDER_METHODS
    if not first_order and config.optimizer.name != "mezo":
        raise ConfigError(f"federated clients run MeZO locally (their steps must be rebuilt from seeds and scalars); "
                          f"optimizer.name={config.optimizer.name!r} is not supported here yet")
    if first_order and fed.server_optimizer.name not in (None, SERVER_OPTIMIZER_OF[fed.method]):
        raise ConfigError(f"{fed.method} uses the {SERVER_OPTIMIZER_OF[fed.method]} server optimizer: set "
                          f"federation.server_optimizer.name={SERVER_OPTIMIZER_OF[fed.method]}")
    server_optimizer = fed.server_optimizer.build(fed.method, fed.rounds)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(config, out / "config.yaml")
    setup = build(config)
    splits = client_splits(setup.train_data, fed.partition)
    summary = summarize(setup.train_data, [s.train for s in splits])
    console.print(format_summary(summary, setup.label_names))
    write_atomic_text(out / "partition.json", json.dumps({"summary": summary, "clients": [
        {"client": s.client_id, "train": s.train.tolist(), "test": s.test.tolist()} for s in splits]}))
    plot_partition(setup.train_data, [s.train for s in splits], out / "partition.png",
                   title=f"{fed.partition.scheme} (alpha {fed.partition.alpha}), {len(splits)} clients")

    method = fed.round_method()
    local_lr = fed.first_order_lr if first_order else config.optimizer.lr
    plan = FederationPlan(method, len(splits), fed.clients_per_round, fed.local_steps, local_lr,
                          config.zo.eps, config.train.seed, config.zo.queries, config.train.batch_size,
                          config.zo.noise, fed.pool_size)
    server = ServerRole(plan, setup.trainable.tensors(), setup.trainable.masks, server_optimizer,
                        BlockSampling(fed.sampling.mix, fed.sampling.prior_weight, fed.sampling.tilt,
                                      fed.sampling.blocks, fed.sampling.shared_seeds))
    metrics = MetricsLog(out / "metrics.jsonl")
    start_round = 0
    if find_checkpoint(out / "checkpoint") is not None:
        saved, meta = load_checkpoint(out / "checkpoint")
        setup.trainable.load_state_dict(saved["trainable"])
        server.load_state(setup.trainable.tensors(), saved)
        start_round = int(meta["round"])
    metrics.truncate_after(start_round if start_round else -1)  # without a checkpoint all records start over
    watch = eval_indices(config, setup.test)
    run = FederatedRun(config, out, setup, splits, plan, server, metrics, start_round, watch)
    if start_round == 0:
        run.evaluate_start()
    return run


def run_federated(config: FederatedConfig, *, resume: bool = False, show_progress: bool = True,
                  console: Console | None = None) -> dict[str, Any]:
    """Run the configured federation on the in-process engine; returns (and writes) the final results."""
    console = console or Console()
    run = prepare_run(config, resume=resume, console=console)
    fed, plan = config.federation, run.plan
    t0 = time.perf_counter()
    with run.progress(console, show_progress) as on_round:
        simulate(run.client_context(), [s.train for s in run.splits], method=plan.method, rounds=fed.rounds,
                 clients_per_round=fed.clients_per_round, local_steps=fed.local_steps, lr=plan.lr,
                 eps=plan.eps, run_seed=plan.run_seed, batch_size=plan.batch_size, queries=plan.queries,
                 noise=plan.noise, pool_size=plan.pool_size, first_order_optimizer=fed.first_order_optimizer,
                 evaluate=run.evaluate, on_round=on_round, start_round=run.start_round, server=run.server,
                 on_checkpoint=run.checkpoint)
    return run.finish(time.perf_counter() - t0)
