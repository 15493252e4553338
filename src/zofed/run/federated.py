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
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from zofed import streams
from zofed.atomic_files import remove_stale_temporaries, write_atomic_text
from zofed.data.body_features import STORE_VARIABLE
from zofed.data.generation import showing_generation
from zofed.data.partition import ClientSplit, client_splits, format_summary, plot_partition, summarize
from zofed.data.prefix_memo import MEMO_CAP_BYTES, row_bytes, simulation_memo
from zofed.data.tasks import Task
from zofed.fl.aggregate import make_aggregator
from zofed.fl.attacks import Attack
from zofed.fl.client import ClientContext, load_tensors_
from zofed.fl.methods import get_method
from zofed.fl.plan import FEDERATED_OPTIMIZERS, FederationPlan
from zofed.fl.roles import ClientRole, Screen, ServerRole
from zofed.fl.server_opt import ServerOptimizer
from zofed.models.selection import TrainableParams
from zofed.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from zofed.run.config import ConfigError
from zofed.run.federated_config import FederatedConfig, federation_plan
from zofed.run.metrics import CLIENT_LISTS, MetricsLog
from zofed.run.screening import probe_loss_screen
from zofed.run.setup import Setup, build, eval_indices, save_final
from zofed.run.stored_config import check_resumed_config, config_yaml, dump_config, with_prompt_format
from zofed.run.uplink_log import LOG_NAME, LogError, UplinkLog
from zofed.sim.engine import simulate
from zofed.zo.prefix import PrefixCache, backward_fraction, head_fraction, tensor_pass_shares


def client_eval_indices(split: ClientSplit, cap: int | None, seed: int) -> np.ndarray:
    """The held-out examples a client is evaluated on: all of them, or a seeded sample of `cap` (sorted)."""
    if cap is None or len(split.test) <= cap:
        return split.test
    return np.sort(streams.client_eval(seed, split.client_id).choice(split.test, size=cap, replace=False))


def per_client_metric(setup: Setup, held_out: list[np.ndarray], batch_size: int,
                      prefixes: PrefixCache | None = None) -> tuple[str, list[float]]:
    """The global model on each client's own held-out examples (personalized evaluation; `held_out` holds each
    client's indices into the training data): the task's headline metric (accuracy for classification; ROUGE-L for
    a causal LM that generates, task.generate_eval > 0, else its loss) and its value per client with examples.
    `prefixes`: a split whose memo remembers the examples' frozen prefixes (`held_out_prefixes`)."""
    task = setup.config.task
    # From the task, not from the results: a federation whose clients hold no test examples still has one.
    metric = "accuracy" if task.type != "causal-lm" else "rougeL" if task.generate_eval > 0 else "loss"
    results = [setup.task.evaluate(setup.model, setup.train, batch_size, idx, body=setup.body, prefixes=prefixes)
               for idx in held_out if len(idx)]
    return metric, [r[metric] for r in results]


def per_client_accuracy(setup: Setup, splits: list[ClientSplit], batch_size: int) -> list[float]:
    """Per-client accuracy of a classification task (see per_client_metric)."""
    metric, values = per_client_metric(setup, [s.test for s in splits], batch_size)
    if metric != "accuracy":
        raise ValueError(f"per-client accuracy needs a classification task; this task reports {metric}")
    return values


def worst_decile_mean(values: list[float], higher_is_better: bool = True) -> float:
    """The mean of the worst tenth of the values (the lowest accuracies, or the highest losses)."""
    ordered = sorted(values, reverse=not higher_is_better)
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
    log: UplinkLog | None = None  # the accepted uplinks, hash-chained (run/uplink_log.py); None: not kept
    # the split the learning curve's evaluations run through, remembering each watched example's frozen prefix
    # (`watched_prefixes`); None: each evaluation runs the whole model (or reads the remembered body features)
    watched_split: PrefixCache | None = None

    def client_context(self) -> ClientContext:
        return ClientContext(self.setup.model, self.setup.trainable, self.setup.task, self.setup.train,
                             self.setup.simulated_body)

    def client_role(self) -> ClientRole:
        """The role that trains every simulated client, attackers included."""
        return make_client_role(self.config, self.client_context(), len(self.splits), self.setup.label_names)

    def evaluate(self, round_done: int) -> dict[str, float]:
        """The fixed test subset every `eval_every` rounds and after the last; the model must hold the global
        tensors."""
        fed = self.config.federation
        if round_done % fed.eval_every and round_done != fed.rounds:
            return {}
        t0 = time.perf_counter()
        result = self.setup.task.evaluate_during_training(self.setup.model, self.setup.test,
                                                          self.config.train.eval_batch_size, self.watch,
                                                          body=self.setup.body, prefixes=self.watched_split)
        # generation makes an evaluation cost as much as a round: its time is kept apart from the round's
        return {**{f"eval_{k}": v for k, v in result.items()}, "eval_seconds": round(time.perf_counter() - t0, 2)}

    def evaluate_start(self) -> None:
        """The starting model on the fixed test subset, recorded as round 0: curves then show where training
        began. The model must hold the starting tensors."""
        result = self.setup.task.evaluate_during_training(self.setup.model, self.setup.test,
                                                          self.config.train.eval_batch_size, self.watch,
                                                          body=self.setup.body, prefixes=self.watched_split)
        self.metrics.write({"step": 0, "event": "eval", "round": 0, **{f"eval_{k}": v for k, v in result.items()}})

    def last_round(self) -> dict | None:
        """The record of the round the run resumes after (None for a fresh start)."""
        if self.start_round == 0:
            return None
        rounds = [r for r in self.metrics.read() if r.get("event") == "round" and r.get("round") == self.start_round]
        return rounds[-1] if rounds else None

    def write_round(self, record: dict) -> None:
        """Record a finished round: its uplink-log line, then its metrics record, each on disk before the round's
        checkpoint (`checkpoint`, called after this) is swapped in. A kill anywhere between them leaves records
        past the checkpoint, which a resume cuts back, never a checkpoint without its records."""
        if self.log is not None:
            self.log.append(record["round"], self.server.last_received, self.server.last_rejected)
        self.metrics.write({"step": record["round"], "event": "round", **record})
        _write_csv(self.metrics, self.out / "metrics.csv")

    def checkpoint(self, round_done: int, server: ServerRole) -> None:
        """Swap in the round's checkpoint: the last write of a round, after `write_round`."""
        trainable = {name: t.view_as(p) for name, t, p in zip(self.setup.trainable.names, server.tensors,
                                                               self.setup.trainable.params, strict=True)}
        save_checkpoint(self.out / "checkpoint", {"trainable": trainable, **server.state_tensors()},
                        {"round": round_done, "forward_passes": server.spent})

    @contextmanager
    def progress(self, console: Console, show: bool) -> Iterator[Callable[[dict], None]]:
        """A progress bar over the rounds; yields the `on_round(record)` that writes and shows each round. While it
        is open, a generative task's evaluations show their answers so far on it."""
        columns = [TextColumn("[bold]federated rounds"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[status]}")]
        with Progress(*columns, console=console, disable=not show) as progress:
            bar_total = self.config.federation.rounds
            bar = progress.add_task("rounds", total=bar_total, completed=self.start_round, status="")

            def on_round(record: dict) -> None:
                self.write_round(record)
                private = self.config.federation.dp_noise is not None  # no client's loss leaves it
                shown = "loss withheld (DP)" if private else f"loss {record['train_loss']:.3f}"
                if "eval_accuracy" in record:
                    shown += f" | eval acc {record['eval_accuracy']:.4f}"
                elif "eval_loss" in record:
                    shown += f" | eval loss {record['eval_loss']:.4f}"
                if "eval_rougeL" in record:
                    shown += f" rougeL {record['eval_rougeL']:.4f}"
                if record["rejected"]:
                    shown += f" | rejected {len(record['rejected'])}"
                progress.update(bar, advance=1, status=shown)
                # A bar needs a terminal: in a log file (nohup, CI) each evaluated round and the last get a line
                evaluated = "eval_accuracy" in record or "eval_loss" in record
                if show and not console.is_terminal and (evaluated or record["round"] == bar_total):
                    console.print(f"round {record['round']}/{bar_total} | {shown}", highlight=False)

            with showing_generation(self.setup.task, lambda status: progress.update(bar, status=status)):
                yield on_round

    def finish(self, seconds: float, **extra: Any) -> dict[str, Any]:
        """Load the model the run releases (the tail average once it began), save it, test, and write
        results.json. The model is loaded here, not left to the rounds: a resumed run that had finished its rounds
        runs none, and its checkpoint's last iterate is not what it released."""
        setup, config, fed = self.setup, self.config, self.config.federation
        load_tensors_(setup.trainable.tensors(), self.server.model_tensors())
        save_final(setup, self.out)
        t0 = time.perf_counter()
        test = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size, body=setup.body,
                                   prefixes=test_prefixes(setup, self.watched_split))
        test_seconds = time.perf_counter() - t0
        held_out = [client_eval_indices(s, fed.client_eval_examples, config.train.seed) for s in self.splits]
        held_split = held_out_prefixes(setup, held_out)
        metric, clients = per_client_metric(setup, held_out, config.train.eval_batch_size, held_split)
        setup.save_remembered()
        if held_split is not None:
            held_split.memo.save()
        if self.watched_split is not None and self.watched_split.memo is not None:
            self.watched_split.memo.save()
        records = self.metrics.read()
        history = [r for r in records if r["event"] == "round"]
        key = f"eval_{metric}"
        start = [r[key] for r in records if r["event"] == "eval" and r.get("round") == 0 and key in r]
        evaluated = [r[key] for r in history if key in r]
        rounds = history[-1]["round"] if history else 0  # fewer than fed.rounds when a `stop` ended the run
        results = {"test": test, "test_examples": len(setup.test), "method": fed.method, "rounds": rounds,
                   "stopped_early": rounds < fed.rounds,
                   "client_metric": metric, CLIENT_LISTS[metric]: clients,
                   "client_test_examples": sum(len(idx) for idx in held_out),
                   f"client_{metric}_mean": float(np.mean(clients)) if clients else None,
                   f"client_{metric}_worst10": worst_decile_mean(clients, metric != "loss") if clients else None,
                   "bytes_up_per_client_round": float(np.mean([r["bytes_up_per_client"] for r in history])),
                   "bytes_down_per_client_round": float(np.mean([r["bytes_down_per_client"] for r in history])),
                   "forward_passes": history[-1]["forward_passes"] if history else 0,
                   "forward_passes_per_client_round": (history[-1]["forward_passes"]
                                                       / sum(len(r["clients"]) for r in history)) if history else 0,
                   "rejected_uplinks": sum(len(r["rejected"]) for r in history),
                   f"{key}_start": start[-1] if start else None,
                   f"{key}_final": evaluated[-1] if evaluated else None,
                   "trainable_parameters": setup.trainable.numel(), "seconds_this_sitting": seconds,
                   "test_seconds": round(test_seconds, 2),
                   # the hash of the uplink log's last line: what `zofed replay` checks the log against
                   "uplink_log_head": self.log.prev if self.log is not None else None, **extra}
        if fed.dp_noise is not None and history:  # the privacy the whole run spent
            results.update(dp_epsilon=history[-1]["dp_epsilon"], dp_delta=fed.dp_delta)
        write_atomic_text(self.out / "results.json", json.dumps(results, indent=2))
        return results


def make_client_role(config: FederatedConfig, ctx: ClientContext, num_clients: int,
                     label_names: list[str] | None) -> ClientRole:
    """The client role of a run: honest, or with `config.attack`'s clients lying."""
    attack = Attack.chosen(config.attack.kind, config.attack.fraction, num_clients, config.train.seed,
                           config.attack.scale)
    if attack is not None and attack.kind == "label-flip" and not label_names:
        raise ConfigError("attack.kind label-flip needs labelled data; this run's task has no labels")
    fed = config.federation
    local_dp = (fed.clip_norm, fed.dp_noise) if fed.dp_noise is not None and fed.dp_at == "client" else None
    return ClientRole(ctx, fed.first_order_optimizer, attack, len(label_names or []), local_dp)


def make_server(config: FederatedConfig, trainable: TrainableParams, num_clients: int, pass_fraction: float,
                optimizer: ServerOptimizer | None = None, screen: Screen | None = None, *,
                backward_fraction: float = 1.0, head_fraction: float = 0.0,
                tensor_shares: Sequence[float] = ()) -> ServerRole:
    """The server role of a run, from its config and its starting trainable tensors (and the run's screen, which
    needs the model and probe data: a replay leaves it out, as its log holds only the updates that passed).
    The fractions are the shares of a full pass a client's compute is counted with (`model_shares`)."""
    fed = config.federation
    if config.zo.cache == "features" and pass_fraction != 0:
        raise ConfigError(f"zo.cache: features needs every block of the model frozen (the label head alone: "
                          f"trainable.mode=none trainable.label_head=true); this run's trainable tensors make a "
                          f"perturbed pass run {pass_fraction:.3f} of the blocks")
    plan = federation_plan(config, num_clients, pass_fraction, backward_fraction=backward_fraction,
                           head_fraction=head_fraction, tensor_shares=tuple(tensor_shares))
    try:
        return ServerRole(plan, trainable.tensors(), trainable.masks,
                          optimizer or fed.server_optimizer.build(fed.method, fed.rounds),
                          make_aggregator(fed.aggregator, fed.trim), fed.clip_norm, screen, fed.dp_noise,
                          fed.dp_delta, fed.dp_at == "client", fed.average_start())
    except ValueError as err:  # the method's own settings that cannot go with the rest (e.g. a tilt without momentum)
        raise ConfigError(f"federation: {err}") from None


def plan_passes(server: ServerRole) -> float:
    """A round's compute when every sampled client is charged its plan's full cost (`Method.forward_passes`)."""
    plan = server.plan
    return server.method.forward_passes(server.round_plan(0)) * min(plan.clients_per_round, plan.num_clients)


def model_shares(model: torch.nn.Module, trainable_names: Sequence[str], task: Task) -> dict[str, Any]:
    """The shares of a full forward pass that the cost rule (fl/cost.py) counts a client's steps with, measured
    from the model's weights: back-propagation's, the label head's and each trainable tensor's from its block up
    (`make_server`'s keyword arguments)."""
    classes = task.num_classes or 0
    return {"backward_fraction": backward_fraction(model, trainable_names, task.full_vocabulary, classes),
            "head_fraction": head_fraction(model, classes),
            "tensor_shares": tensor_pass_shares(model, trainable_names, task.full_vocabulary, classes)}


def remembering_split(setup: Setup, tokens: int) -> PrefixCache | None:
    """A split at the run's prefix cache whose memo remembers what each example it meets gives below it
    (data/prefix_memo.py), for examples of `tokens` tokens in all: None without a prefix cache, where the body's
    features are remembered instead, or where the rows could not be kept (`simulation_memo`). An evaluation through
    it reads the rows within rounding of running each batch whole."""
    cache = setup.cache
    if cache is None or setup.body is not None or cache.start == 0 or not setup.task.splits_at_prefix:
        return None
    memo = simulation_memo(cache, tokens)
    return None if memo is None else PrefixCache(setup.model, cache.start, setup.task.full_vocabulary, memo)


def watched_prefixes(setup: Setup, watch: np.ndarray) -> PrefixCache | None:
    """The split the learning curve's evaluations run through (`remembering_split`): every curve point after the
    first runs only the blocks above it."""
    return remembering_split(setup, sum(len(setup.test.input_ids[i]) for i in watch))


def held_out_prefixes(setup: Setup, held_out: list[np.ndarray]) -> PrefixCache | None:
    """The split the clients' held-out examples are evaluated through at the end, when a store keeps rows across
    runs (ZOFED_FEATURE_STORE): a later run of the same prefix reads them instead of running the frozen bottom.
    None without a store, where computing the rows one by one would save nothing (`remembering_split` otherwise)."""
    if not os.environ.get(STORE_VARIABLE):
        return None
    return remembering_split(setup, sum(len(setup.train.input_ids[i]) for idx in held_out for i in idx))


def test_prefixes(setup: Setup, watched: PrefixCache | None) -> PrefixCache | None:
    """The split the final test runs through: the learning curve's (`watched_prefixes`), whose memo already holds
    the watched examples' rows, so only the other test examples run through the frozen bottom (each alone), when
    the whole test split's rows fit the simulator's memory; else None (each batch runs the whole model)."""
    if watched is None or row_bytes(watched, sum(len(ids) for ids in setup.test.input_ids)) > MEMO_CAP_BYTES:
        return None
    return watched


def prepare_run(config: FederatedConfig, *, resume: bool = False, console: Console | None = None) -> FederatedRun:
    """Check the config, build model, data and partition, write the partition files, make (or restore) the
    server role."""
    console = console or Console()
    out = Path(config.out_dir)
    if find_checkpoint(out / "checkpoint") is not None:
        if not resume:
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another out_dir")
        config = check_resumed_config(config, out / "config.yaml")
    fed = config.federation
    method = get_method(fed.method)
    if not method.first_order and config.optimizer.name not in FEDERATED_OPTIMIZERS:
        raise ConfigError(f"federated clients run {', '.join(FEDERATED_OPTIMIZERS)} locally (a fresh state each "
                          f"round, so the server replays their steps from seeds and scalars); "
                          f"optimizer.name={config.optimizer.name!r} is not supported here")
    fixed = method.server_default.name
    if method.first_order and fed.server_optimizer.name not in (None, fixed):  # the server half of the method
        raise ConfigError(f"{fed.method} uses the {fixed} server optimizer: set "
                          f"federation.server_optimizer.name={fixed}")
    server_optimizer = fed.server_optimizer.build(fed.method, fed.rounds)
    out.mkdir(parents=True, exist_ok=True)
    for directory in (out, out / "final"):  # what a killed sitting left half-written
        remove_stale_temporaries(directory)
    setup = build(config)
    config = with_prompt_format(config, setup.task)
    dump_config(config, out / "config.yaml")
    splits = client_splits(setup.train_data, fed.partition)
    summary = summarize(setup.train_data, [s.train for s in splits])
    console.print(format_summary(summary, setup.label_names))
    write_atomic_text(out / "partition.json", json.dumps({"summary": summary, "clients": [
        {"client": s.client_id, "train": s.train.tolist(), "test": s.test.tolist()} for s in splits]}))
    plot_partition(setup.train_data, [s.train for s in splits], out / "partition.png",
                   title=f"{fed.partition.scheme} (alpha {fed.partition.alpha}), {len(splits)} clients")

    screen = None if fed.screen_threshold is None else probe_loss_screen(
        setup, fed.screen_examples, config.train.seed, fed.screen_threshold, fed.screen_score, config.zo.eps)
    server = make_server(config, setup.trainable, len(splits), setup.pass_fraction, server_optimizer, screen,
                         **model_shares(setup.model, setup.trainable.names, setup.task))
    plan = server.plan
    metrics = MetricsLog(out / "metrics.jsonl", config.tensorboard_dir)
    start_round = 0
    if find_checkpoint(out / "checkpoint") is not None:
        saved, meta = load_checkpoint(out / "checkpoint")
        setup.trainable.load_state_dict(saved["trainable"])
        server.load_state(setup.trainable.tensors(), saved)
        start_round = int(meta["round"])
        # (a checkpoint from before it kept the compute: every client of every round charged the plan's cost)
        server.spent = float(meta.get("forward_passes", start_round * plan_passes(server)))
    metrics.truncate_after(start_round if start_round else -1)  # without a checkpoint all records start over
    watch = eval_indices(config, setup.test)
    if not fed.log_uplinks:
        log = None
    elif start_round == 0:
        log = UplinkLog.start(out / LOG_NAME, config_text=config_yaml(config), num_clients=len(splits),
                              num_classes=len(setup.label_names) if setup.label_names else None,
                              start_tensors=server.tensors, server_noised=server.dp_secret is not None)
    else:
        try:
            log = UplinkLog.resume(out / LOG_NAME, start_round)
        except LogError as err:
            raise ConfigError(f"cannot resume {out}: {err}") from None
    run = FederatedRun(config, out, setup, splits, plan, server, metrics, start_round, watch, log,
                       watched_prefixes(setup, watch))
    if start_round == 0:
        run.evaluate_start()
    return run


def run_federated(config: FederatedConfig, *, resume: bool = False, show_progress: bool = True,
                  console: Console | None = None, stop: Callable[[dict], bool] | None = None) -> dict[str, Any]:
    """Run the configured federation on the in-process engine; returns (and writes) the final results. `stop`
    (a round's record -> bool) may end it before `federation.rounds`: asked after each round's checkpoint, and of
    the checkpoint's round when a stopped run is resumed, so a resume stops where the first sitting did."""
    console = console or Console()
    if config.flower.secure_aggregation:
        raise ConfigError("flower.secure_aggregation runs on the Flower backend (zofed run --backend flower); the "
                          "in-process engine has no separate clients to hide numbers from")
    run = prepare_run(config, resume=resume, console=console)
    t0 = time.perf_counter()
    last = run.last_round()
    stopped = stop is not None and last is not None and stop(last)
    with run.progress(console, show_progress) as on_round:
        if not stopped:
            simulate(run.client_context(), [s.train for s in run.splits], run.server, config.federation.rounds,
                     client=run.client_role(), start_round=run.start_round, evaluate=run.evaluate,
                     on_round=on_round, on_checkpoint=run.checkpoint,  # a round's records, then its checkpoint
                     stop=stop)
        return run.finish(time.perf_counter() - t0)  # on the bar: the final test may generate for minutes
