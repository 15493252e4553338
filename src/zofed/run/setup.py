"""What every run shares: the model, trainable selection, task and data built from one config.

The centralized trainer (finetune.py), the federated runner (federated.py), the Flower apps and the benchmarks
all start from `build`; `load_run` rebuilds a finished run's model with its trained tensors, and `save_final`
writes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from zofed import streams
from zofed.atomic_files import write_atomic_text
from zofed.data.body_features import STORE_VARIABLE, BodyFeatures, fingerprint
from zofed.data.builtin import BUILTIN_DATASETS, load_builtin, load_shared
from zofed.data.dataset import TextDataset
from zofed.data.spec import load_dataset_spec
from zofed.data.task_factory import make_task
from zofed.data.tasks import Encoded, PromptClassification, Task
from zofed.models.placement import DTYPES, place_model, resolve_device
from zofed.models.registry import load_model
from zofed.models.selection import TrainableParams, select_trainable
from zofed.run.checkpoint import find_checkpoint, load_checkpoint
from zofed.run.config import ConfigError, FinetuneConfig
from zofed.zo.feature_scale import combine, feature_noise_scales, top_channel_masks
from zofed.zo.prefix import PrefixCache, first_trainable_layer


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
    cache: PrefixCache | None = None  # zo.cache prefix or features: the frozen bottom runs once per batch
    # the frozen body's remembered features (`body_memo`), which evaluations read instead of running the body
    body: BodyFeatures | None = None

    @property
    def pass_fraction(self) -> float:
        """The share of the model's blocks a perturbed pass runs (1.0: the whole model)."""
        return self.cache.fraction if self.cache is not None else 1.0

    @property
    def train_body(self) -> BodyFeatures | None:
        """The memo training losses read too (zo.cache: features, every block frozen); None: they run the body."""
        return self.body if self.config.zo.cache == "features" else None

    @property
    def simulated_body(self) -> BodyFeatures | None:
        """The memo the in-process simulator's training losses read: `train_body`, and with zo.cache: none the same
        remembered features (its clients are charged whole passes; remembering saves the simulator's time only)."""
        return self.body if self.config.zo.cache in ("features", "none") else None

    def save_remembered(self) -> None:
        """Merge the remembered features into their store, when the run keeps one (ZOFED_FEATURE_STORE)."""
        if self.body is not None:
            self.body.save()


def hold_out(train: TextDataset, column: str, values: list[str]) -> tuple[TextDataset, TextDataset]:
    """The records whose `column` is one of `values` as the test set, the rest as the training set."""
    missing = [i for i, f in enumerate(train.fields) if column not in f]
    if missing:
        raise ConfigError(f"data.heldout_column={column!r}: {train.name} example {missing[0]} has no such field "
                          f"(fields: {sorted(train.fields[missing[0]])})")
    found = {f[column] for f in train.fields}
    absent = [v for v in values if v not in found]
    if absent:
        raise ConfigError(f"data.heldout_values: {absent} not among {train.name}'s {column!r} values {sorted(found)}")
    chosen = np.asarray([f[column] in values for f in train.fields])
    if chosen.all():
        raise ConfigError(f"data.heldout_values {values} hold every record of {train.name}: nothing is left to "
                          "train on")
    test = train.subset(np.flatnonzero(chosen))
    test.name = f"{train.name} ({column} {', '.join(values)})"
    return train.subset(np.flatnonzero(~chosen)), test


def load_splits(config: FinetuneConfig) -> tuple[TextDataset, TextDataset]:
    """Train and test datasets named by the data section."""
    data, seed = config.data, config.train.seed
    if data.source in BUILTIN_DATASETS:
        train, test = load_builtin(data.source, seed=seed)
    elif data.source.startswith("shared:"):
        train, test = load_shared(data.source.removeprefix("shared:"), seed=seed)
    else:
        options = {"format": data.format, "encoding": data.encoding, "on_bad_lines": data.on_bad_lines,
                   "text_columns": data.text_columns, "optional_columns": data.optional_columns,
                   "label_column": data.label_column,
                   "label_names": data.label_names}
        train = load_dataset_spec(data.source, **options)
        if data.test_source:
            test = load_dataset_spec(data.test_source, **options)
        elif data.heldout_column:  # the held-out task below is the test set
            test = train
        else:  # no test file given: hold out a seeded fifth of the training file
            train, test = train.train_test_split(0.2, seed)
    if data.heldout_column:
        train, test = hold_out(train, data.heldout_column, data.heldout_values)
    if data.validation_examples is not None:
        if data.validation_examples >= len(train):
            raise ConfigError(f"data.validation_examples={data.validation_examples} leaves nothing of the "
                              f"{len(train)} training examples to train on")
        perm = streams.validation_split(seed).permutation(len(train))
        validation = train.subset(np.sort(perm[: data.validation_examples]))
        train = train.subset(np.sort(perm[data.validation_examples:]))
        if data.evaluate_on == "validation":
            test = validation
    if data.train_examples is not None and data.train_examples < len(train):
        train = train.subset(streams.training_cap(seed).permutation(len(train))[: data.train_examples])
    if data.test_examples is not None and data.test_examples < len(test):
        test = test.subset(streams.test_cap(seed).permutation(len(test))[: data.test_examples])
    return train, test


def build(config: FinetuneConfig) -> Setup:
    """Data, model, trainable selection and task from the config (shared by centralized and federated runs)."""
    device = run_device(config)  # before the slow loads: a missing GPU fails at once
    train, test = load_splits(config)
    num_classes = len(train.label_names) if train.label_names else None
    model, trainable, task = build_model(config, num_classes, device, train.label_names)
    cache = prefix_cache(config, model, trainable, task)
    body = body_memo(config, model, trainable, cache) if isinstance(task, PromptClassification) else None
    return Setup(config, model, trainable, task, task.encode(train), task.encode(test), train.label_names, train, cache,
                 body)


def run_device(config: FinetuneConfig) -> torch.device:
    try:
        return resolve_device(config.model.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def build_model(config: FinetuneConfig, num_classes: int | None, device: torch.device,
                label_names: list[str] | None = None) -> tuple[torch.nn.Module, TrainableParams, Task]:
    """The model with its starting trainable tensors (and their noise masks), and the task, without any data:
    what the run's server starts from (`zofed replay` rebuilds it from the config alone). `label_names` stand in
    for an unset task.verbalizer (data/tasks.py); the run's stored config pins the words they gave."""
    kind = config.model.kind or ("encoder" if config.task.type == "encoder-classification" else "causal-lm")
    loaded = load_model(config.model.name, kind=kind, num_labels=num_classes if kind == "encoder" else None,
                        head_seed=config.trainable.init_seed)
    task = make_task(config.task, loaded.tokenizer, num_classes, label_names)
    if config.trainable.label_head and not isinstance(task, PromptClassification):
        raise ConfigError(f"trainable.label_head trains the verbalizer's output rows of a prompt-classification "
                          f"task, not of task.type {config.task.type}; an encoder's classifier is trained with "
                          "trainable.also_train")
    label_words = task.label_token_ids if isinstance(task, PromptClassification) else None
    model, trainable = select_trainable(loaded.model, config.trainable, label_words)
    place_model(model, trainable.params, device, DTYPES[config.model.dtype])
    if trainable.masks is not None:
        trainable.masks = [None if m is None else m.to(device) for m in trainable.masks]
    model.eval()
    # measured on the starting model, before any checkpoint is loaded
    if config.zo.precondition == "features":
        trainable.masks = combine(trainable.masks, feature_noise_scales(model, trainable.names, trainable.params))
    elif config.zo.precondition == "channels":
        trainable.masks = combine(trainable.masks, top_channel_masks(model, trainable.names, trainable.params,
                                                                     config.zo.channels))
    task.device = device
    return model, trainable, task


def prefix_cache(config: FinetuneConfig, model: torch.nn.Module, trainable: TrainableParams,
                 task: Task) -> PrefixCache | None:
    """The split of the model at its first trainable block, when `zo.cache` asks for one (prefix or features),
    or, with auto, wherever the model and task allow one that runs less than the whole model."""
    if config.zo.cache == "none":
        return None
    auto = config.zo.cache == "auto"
    if config.task.type not in ("prompt-classification", "causal-lm"):
        if auto:
            return None
        raise ConfigError(f"zo.cache: {config.zo.cache} works with task.type prompt-classification or causal-lm, "
                          f"not {config.task.type}")
    start = first_trainable_layer(model, trainable.names)
    if start is None:
        if auto:
            return None
        raise ConfigError(f"zo.cache: {config.zo.cache} needs a decoder-only model (blocks in `layers`, a final "
                          "`norm`) whose trainable tensors all lie in its blocks or above them, none in the embeddings")
    cache = PrefixCache(model, start, output_layer=task.full_vocabulary, trainable=trainable.named())
    return None if auto and cache.fraction >= 1.0 else cache


def body_memo(config: FinetuneConfig, model: torch.nn.Module, trainable: TrainableParams,
              cache: PrefixCache | None) -> BodyFeatures | None:
    """The frozen body's remembered features: for every loss with zo.cache: features (every block frozen), and for
    the simulator's with none, kept across runs in the directory ZOFED_FEATURE_STORE names (one file per model) when
    it is set; else for evaluations when the prefix cache splits at the final norm; None when the body may train.

    Remembering saves the simulator's time and changes no result: a remembered row is computed exactly as a
    recomputed one (each example alone, PromptClassification.last_features)."""
    whole = frozen_body(model, trainable) if config.task.type == "prompt-classification" else None
    if config.zo.cache == "features" and whole is None:
        raise ConfigError("zo.cache: features needs a prompt-classification task on a decoder whose body is "
                          "frozen (only the label head or the final norm trains: trainable.mode=none with "
                          "trainable.label_head=true); with trainable blocks use zo.cache: prefix")
    if config.zo.cache in ("features", "none") and whole is not None:  # none: for the simulator (`simulated_body`)
        store = os.environ.get(STORE_VARIABLE) or None
        return BodyFeatures(whole, None if store is None else Path(store),
                            None if store is None else fingerprint(model, trainable.names))
    # evaluations only, under the same test of a frozen body (a trained tied output embedding is not frozen)
    return BodyFeatures(cache) if cache is not None and whole is not None else None


def frozen_body(model: torch.nn.Module, trainable: TrainableParams) -> PrefixCache | None:
    """The split at the final norm when no trainable tensor is part of the body below it (a tied output embedding
    is the input embedding), else None."""
    start = first_trainable_layer(model, trainable.names)
    if start is None:
        return None
    cache = PrefixCache(model, start)
    below = {p.data_ptr() for name, p in cache.backbone.named_parameters() if not name.startswith("norm.")}
    if cache.start != len(cache.layers) or any(p.data_ptr() in below for p in trainable.params):
        return None
    return cache


def eval_indices(config: FinetuneConfig, test: Encoded) -> np.ndarray:
    """The fixed test subset watched during training (the full test split is evaluated at the end)."""
    n = min(config.data.eval_examples, len(test))
    return np.sort(streams.watched_subset(config.train.seed).permutation(len(test))[:n])


def save_final(setup: Setup, out: Path) -> None:
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in setup.trainable.state_dict().items()}
    write_atomic_text(final / "trainable.safetensors", save(tensors))


def load_run(run_dir: str | Path) -> Setup:
    """Rebuild a finished (or checkpointed) run's model with its trained tensors loaded: a centralized run's
    (zofed finetune) or a federated one's (zofed run, whose config.yaml has a federation section)."""
    import yaml

    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig

    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a zofed run directory (no config.yaml)")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        tree = None  # load_config reports what is wrong with it
    federated = isinstance(tree, dict) and "federation" in tree
    config = load_config(path, schema=FederatedConfig if federated else FinetuneConfig)
    setup = build(config)
    final = run_dir / "final" / "trainable.safetensors"
    if final.is_file():
        setup.trainable.load_state_dict(load_file(str(final)))
    elif find_checkpoint(run_dir / "checkpoint") is not None:
        setup.trainable.load_state_dict(load_checkpoint(run_dir / "checkpoint")[0]["trainable"])
    else:
        raise ConfigError(f"{run_dir} holds no trained weights (final/ or checkpoint/)")
    return setup

