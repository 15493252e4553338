"""Centralized ZO fine-tuning, top to bottom: build the parts, evaluate, step, checkpoint, save.

Every step's batch and perturbation seed derive from (train.seed, step), so a run resumed from a
checkpoint continues exactly as if it had never stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from zofed.data.builtin import BUILTIN_DATASETS, load_builtin, load_shared
from zofed.data.sources import TextDataset, load_dataset_spec
from zofed.data.tasks import Encoded, Task, make_task
from zofed.models.registry import load_model
from zofed.models.selection import TrainableParams, select_trainable
from zofed.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint, write_atomic_text
from zofed.run.config import ConfigError, FinetuneConfig, check_resumed_config, dump_config
from zofed.run.metrics import MetricsLog
from zofed.zo.noise import derive_seed
from zofed.zo.optim import OptState, learning_rate, make_optimizer
from zofed.zo.perturb import Perturbation
from zofed.zo.step import zo_step


@dataclass
class Setup:
    """Everything a run (or an evaluation of its result) needs, built from one config."""

    config: FinetuneConfig
    model: torch.nn.Module
    trainable: TrainableParams
    task: Task
    train: Encoded
    test: Encoded
    label_names: list[str] | None
    train_data: TextDataset


def load_splits(config: FinetuneConfig) -> tuple[TextDataset, TextDataset]:
    """Train and test datasets named by the data section."""
    data, seed = config.data, config.train.seed
    if data.source in BUILTIN_DATASETS:
        train, test = load_builtin(data.source, seed=seed)
    elif data.source.startswith("shared:"):
        train, test = load_shared(data.source.removeprefix("shared:"), seed=seed)
    else:
        options = {"format": data.format, "text_columns": data.text_columns, "label_column": data.label_column,
                   "label_names": data.label_names}
        train = load_dataset_spec(data.source, **options)
        if data.test_source:
            test = load_dataset_spec(data.test_source, **options)
        else:  # no test file given: hold out a seeded fifth of the training file
            train, test = train.train_test_split(0.2, seed)
    if data.train_examples is not None and data.train_examples < len(train):
        train = train.subset(np.random.default_rng(seed).permutation(len(train))[: data.train_examples])
    if data.test_examples is not None and data.test_examples < len(test):
        test = test.subset(np.random.default_rng(seed + 1).permutation(len(test))[: data.test_examples])
    return train, test


def build(config: FinetuneConfig) -> Setup:
    """Data, model, trainable selection and task from the config (shared by centralized and federated runs)."""
    train, test = load_splits(config)
    num_classes = len(train.label_names) if train.label_names else None
    kind = config.model.kind or ("encoder" if config.task.type == "encoder-classification" else "causal-lm")
    loaded = load_model(config.model.name, kind=kind, num_labels=num_classes if kind == "encoder" else None,
                        head_seed=config.trainable.init_seed)
    model, trainable = select_trainable(loaded.model, config.trainable)
    model.eval()
    task = make_task(config.task, loaded.tokenizer, num_classes)
    return Setup(config, model, trainable, task, task.encode(train), task.encode(test), train.label_names, train)


def eval_indices(config: FinetuneConfig, test: Encoded) -> np.ndarray:
    """The fixed test subset watched during training (the full test split is evaluated at the end)."""
    n = min(config.data.eval_examples, len(test))
    return np.sort(np.random.default_rng(config.train.seed + 2).permutation(len(test))[:n])


def batch_indices(config: FinetuneConfig, step: int, n_train: int) -> np.ndarray:
    rng = np.random.default_rng([config.train.seed, step])
    return rng.choice(n_train, size=min(config.train.batch_size, n_train), replace=False)


def _checkpoint(out: Path, setup: Setup, opt_state: OptState, step: int) -> None:
    save_checkpoint(out / "checkpoint", {"trainable": setup.trainable.state_dict(),
                                         "optimizer": opt_state.to_tensors()}, {"step": step})


def finetune(config: FinetuneConfig, *, resume: bool = False, show_progress: bool = True,
             setup: Setup | None = None) -> dict[str, Any]:
    """Run ZO fine-tuning as configured; returns the final results (also written to results.json)."""
    out = Path(config.out_dir)
    existing = find_checkpoint(out / "checkpoint")
    if existing is not None:
        if not resume:
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another out_dir")
        check_resumed_config(config, out / "config.yaml")
    out.mkdir(parents=True, exist_ok=True)
    dump_config(config, out / "config.yaml")
    setup = setup or build(config)
    tensors = setup.trainable.tensors()
    optimizer = make_optimizer(config.optimizer.name, **config.optimizer.hyperparameters())
    opt_state = optimizer.init(tensors)
    metrics = MetricsLog(out / "metrics.jsonl")
    start = 0
    if existing is not None:
        saved, meta = load_checkpoint(out / "checkpoint")
        setup.trainable.load_state_dict(saved["trainable"])
        opt_state = OptState.from_tensors(saved["optimizer"])
        start = int(meta["step"])
        metrics.truncate_after(start)
    perturbation = Perturbation(kind=config.zo.noise, masks=setup.trainable.masks)
    watch = eval_indices(config, setup.test)
    steps, every = config.train.steps, config.train.eval_every
    forward_passes = 2 * config.zo.queries * start

    columns = [TextColumn("[bold]ZO fine-tuning"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[status]}")]
    progress = Progress(*columns, disable=not show_progress, transient=False)

    def evaluate(step: int) -> dict[str, float]:
        result = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size, watch)
        metrics.write({"step": step, "event": "eval", "forward_passes": forward_passes,
                       **{f"eval_{k}": v for k, v in result.items()}})
        if show_progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items())
            progress.console.print(f"step {step:>5}: eval on {len(watch)} test examples: {shown}")
        return result

    t0 = time.perf_counter()
    with progress:
        last_eval = evaluate(start) if start == 0 else {}
        bar = progress.add_task("steps", total=steps, completed=start, status="")
        for step in range(start, steps):
            batch = setup.task.collate(setup.train, batch_indices(config, step, len(setup.train)))
            lr = learning_rate(step, config.optimizer.lr, config.optimizer.schedule, steps, config.optimizer.warmup)
            opt_state, record = zo_step(
                tensors, lambda b=batch: setup.task.loss(setup.model, b), optimizer, opt_state,
                seed=derive_seed(config.train.seed, step), eps=config.zo.eps, lr=lr, queries=config.zo.queries,
                perturbation=perturbation)
            forward_passes += 2 * config.zo.queries
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
    return finish(setup, out, train_seconds=train_seconds, forward_passes=forward_passes, eval_curve=curve)


def save_final(setup: Setup, out: Path) -> None:
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    tmp = final / "trainable.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in setup.trainable.state_dict().items()}, str(tmp))
    tmp.replace(final / "trainable.safetensors")


def finish(setup: Setup, out: Path, **extra: Any) -> dict[str, Any]:
    """Save the trained tensors and evaluate on the whole test split."""
    save_final(setup, out)
    test = setup.task.evaluate(setup.model, setup.test, setup.config.train.eval_batch_size)
    results = {"test": test, "test_examples": len(setup.test), "trainable_parameters": setup.trainable.numel(),
               "steps": setup.config.train.steps, **extra}
    write_atomic_text(out / "results.json", json.dumps(results, indent=2))
    return results


def load_run(run_dir: str | Path) -> Setup:
    """Rebuild a finished (or checkpointed) run's model with its trained tensors loaded."""
    from zofed.run.config import load_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a zofed run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    setup = build(config)
    final = run_dir / "final" / "trainable.safetensors"
    if final.is_file():
        setup.trainable.load_state_dict(load_file(str(final)))
    elif find_checkpoint(run_dir / "checkpoint") is not None:
        setup.trainable.load_state_dict(load_checkpoint(run_dir / "checkpoint")[0]["trainable"])
    else:
        raise ConfigError(f"{run_dir} holds no trained weights (final/ or checkpoint/)")
    return setup

