"""Centralized ZO fine-tuning, top to bottom: build the parts, evaluate, step, checkpoint, save.

Every step's batch and perturbation seed derive from (train.seed, step), so a run resumed from a
checkpoint continues exactly as if it had never stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from zofed import streams
from zofed.atomic_files import remove_stale_temporaries, write_atomic_text
from zofed.data.generation import showing_generation
from zofed.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from zofed.run.config import ConfigError, FinetuneConfig
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.setup import Setup, build, eval_indices, save_final
from zofed.run.stored_config import check_resumed_config, dump_config, with_prompt_format
from zofed.zo.noise import derive_seed
from zofed.zo.optim import OptState, learning_rate, make_optimizer
from zofed.zo.perturb import Perturbation
from zofed.zo.prefix import forward_equivalents
from zofed.zo.step import zo_step


def batch_indices(config: FinetuneConfig, step: int, n_train: int) -> np.ndarray:
    rng = streams.centralized_batch(config.train.seed, step)
    return rng.choice(n_train, size=min(config.train.batch_size, n_train), replace=False)


def _checkpoint(out: Path, setup: Setup, opt_state: OptState, step: int) -> None:
    save_checkpoint(out / "checkpoint", {"trainable": setup.trainable.state_dict(),
                                         "optimizer": opt_state.to_tensors()}, {"step": step})


def finetune(config: FinetuneConfig, *, resume: bool = False, show_progress: bool = True,
             setup: Setup | None = None) -> dict[str, Any]:
    """Run ZO fine-tuning as configured; returns the final results (also written to results.json)."""
    if isinstance(config, FederatedConfig):
        # A centralized run of a federated config (the benchmarks' centralized reference) is a centralized run: its
        # config.yaml must load as one (a federated config refuses train.steps), and resume as one.
        federated_only = set(type(config).model_fields) - set(FinetuneConfig.model_fields)  # federation, flower, ...
        config = FinetuneConfig.model_validate(config.model_dump(exclude=federated_only))
    out = Path(config.out_dir)
    existing = find_checkpoint(out / "checkpoint")
    if existing is not None:
        if not resume:
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another out_dir")
        config = check_resumed_config(config, out / "config.yaml")
    out.mkdir(parents=True, exist_ok=True)
    for directory in (out, out / "final"):  # what a killed sitting left half-written
        remove_stale_temporaries(directory)
    setup = setup or build(config)
    config = with_prompt_format(config, setup.task)
    dump_config(config, out / "config.yaml")
    tensors = setup.trainable.tensors()
    optimizer = make_optimizer(config.optimizer.name, **config.optimizer.hyperparameters())
    opt_state = optimizer.init(tensors)
    metrics = MetricsLog(out / "metrics.jsonl", config.tensorboard_dir)
    start = 0
    if existing is not None:
        saved, meta = load_checkpoint(out / "checkpoint")
        setup.trainable.load_state_dict(saved["trainable"])
        opt_state = OptState.from_tensors(saved["optimizer"])
        start = int(meta["step"])
    metrics.truncate_after(start if existing is not None else -1)  # without a checkpoint all records start over
    perturbation = Perturbation(kind=config.zo.noise, masks=setup.trainable.masks)
    watch = eval_indices(config, setup.test)
    steps, every = config.train.steps, config.train.eval_every
    estimator = config.zo.resolved_estimator(None)  # a centralized run: central unless set
    step_cost = forward_equivalents(setup.pass_fraction, config.zo.queries, estimator)  # per step
    forward_passes = step_cost * start

    columns = [TextColumn("[bold]ZO fine-tuning"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[status]}")]
    progress = Progress(*columns, disable=not show_progress, transient=False)

    def evaluate(step: int) -> dict[str, float]:
        result = setup.task.evaluate_during_training(setup.model, setup.test, config.train.eval_batch_size, watch,
                                                     body=setup.body)
        metrics.write({"step": step, "event": "eval", "forward_passes": forward_passes,
                       **{f"eval_{k}": v for k, v in result.items()}})
        if show_progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items())
            progress.console.print(f"step {step:>5}: eval on {len(watch)} test examples: {shown}")
        return result

    t0 = time.perf_counter()
    # the lambda reads `bar` when an evaluation generates, after it is made
    with progress, showing_generation(setup.task, lambda status: progress.update(bar, status=status)):
        bar = progress.add_task("steps", total=steps, completed=start, status="")
        last_eval = evaluate(start) if start == 0 else {}
        for step in range(start, steps):
            batch = setup.task.collate(setup.train, batch_indices(config, step, len(setup.train)))
            lr = learning_rate(step, config.optimizer.lr, config.optimizer.schedule, steps, config.optimizer.warmup)
            loss = (setup.task.cached_loss(setup.model, setup.cache, batch, body=setup.train_body)
                    if setup.cache is not None
                    else lambda b=batch: setup.task.loss(setup.model, b))
            opt_state, record = zo_step(
                tensors, loss, optimizer, opt_state,
                seed=derive_seed(config.train.seed, step), eps=config.zo.eps, lr=lr, queries=config.zo.queries,
                perturbation=perturbation, estimator=estimator)
            forward_passes += step_cost
            metrics.write({"step": step + 1, "event": "train", "loss": record.loss, "grads": list(record.grads),
                           "lr": lr, "forward_passes": forward_passes})
            if (step + 1) % every == 0 or step + 1 == steps:
                last_eval = evaluate(step + 1)
            if (step + 1) % config.train.checkpoint_every == 0 or step + 1 == steps:
                _checkpoint(out, setup, opt_state, step + 1)
            status = " ".join(f"{k} {v:.3f}" for k, v in last_eval.items())
            progress.update(bar, advance=1, status=f"loss {record.loss:.3f} | eval {status}")
        train_seconds = time.perf_counter() - t0
        evals = [r for r in metrics.read() if r["event"] == "eval"]
        curve = {"first": evals[0], "last": evals[-1]} if evals else {}
        # on the bar: the final test may generate for minutes
        return finish(setup, out, train_seconds=train_seconds, forward_passes=forward_passes, eval_curve=curve)


def finish(setup: Setup, out: Path, **extra: Any) -> dict[str, Any]:
    """Save the trained tensors and evaluate on the whole test split."""
    save_final(setup, out)
    test = setup.task.evaluate(setup.model, setup.test, setup.config.train.eval_batch_size, body=setup.body)
    setup.save_remembered()
    results = {"test": test, "test_examples": len(setup.test), "trainable_parameters": setup.trainable.numel(),
               "steps": setup.config.train.steps, **extra}
    write_atomic_text(out / "results.json", json.dumps(results, indent=2))
    return results
