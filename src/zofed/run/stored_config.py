"""The config a run stores beside its results (`config.yaml`), and the check that a resumed run continues it.

A stored config says what ran: the settings a method or model resolves at run time (the server optimizer's
defaults, a causal-lm task's prompt format) are written out, so that a later zofed whose defaults changed names
the change on resume instead of continuing the run under other settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from zofed.atomic_files import write_atomic_text
from zofed.data.tasks import Task
from zofed.run.config import ConfigError, FinetuneConfig, load_config
from zofed.run.federated_config import FederatedConfig


def pinned(config: FinetuneConfig) -> FinetuneConfig:
    """The config with the method's defaults written out: the clients' estimator, and the server optimizer's
    name, lr, granularity and relative steps."""
    method = config.federation.method if isinstance(config, FederatedConfig) else None
    zo = config.zo.model_copy(update={"estimator": config.zo.resolved_estimator(method)})
    config = config.model_copy(update={"zo": zo})
    if not isinstance(config, FederatedConfig):
        return config
    fed = config.federation
    settings = fed.server_optimizer.resolved(fed.method, fed.rounds)
    explicit = {k: settings[k] for k in ("name", "lr", "granularity", "relative") if k in settings}
    section = fed.server_optimizer.model_copy(update=explicit)
    return config.model_copy(update={"federation": fed.model_copy(update={"server_optimizer": section})})


def with_prompt_format(config: FinetuneConfig, task: Task) -> FinetuneConfig:
    """The config with a causal-lm task's `prompt_format: auto` replaced by the format the model resolved it to
    (chat where the tokenizer has a chat template): auto could resolve otherwise under another zofed or model.
    An unset task.verbalizer likewise takes the label names the task answers with (`zofed replay` has no data)."""
    verbalizer = getattr(task, "verbalizer", None)  # prompt classification: an unset one takes the label names
    if verbalizer and verbalizer != config.task.verbalizer:
        config = config.model_copy(update={"task": config.task.model_copy(update={"verbalizer": verbalizer})})
    prompt_format = getattr(task, "prompt_format", None)  # causal-lm tasks only
    if prompt_format is None or config.task.prompt_format == prompt_format:
        return config
    task = config.task.model_copy(update={"prompt_format": prompt_format})
    return config.model_copy(update={"task": task})


def config_yaml(config: FinetuneConfig) -> str:
    """The YAML a run stores beside its results: every key, with the method defaults pinned."""
    return yaml.safe_dump(pinned(config).model_dump(mode="json"), sort_keys=False)


def dump_config(config: FinetuneConfig, path: Path) -> None:
    write_atomic_text(path, config_yaml(config))  # written whole or not at all


# What a resumed run may change: where it lives (and its TensorBoard copy), how long it goes on, how it is
# evaluated (in batches, how many generations are scored and how many of each client's examples), and whether it
# keeps its uplink log (a log switched off stops growing, and `zofed replay` then refuses the run; switching it on
# again mid-run is refused, as the log misses the rounds run without it)
# (train.steps only under a constant lr schedule, federation.rounds only without a cosine server decay).
RESUMABLE_CHANGES = frozenset({"out_dir", "tensorboard_dir", "train.steps", "federation.rounds",
                               "train.eval_batch_size", "task.generate_eval", "task.max_new_tokens",
                               "task.curve_max_new_tokens", "federation.log_uplinks",
                               "federation.client_eval_examples"})


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config tree as dotted keys (`zo.cache`)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resolved_view(config: FinetuneConfig) -> dict[str, Any]:
    """The config as flat keys, with the estimator and the server optimizer as they will run: an unset field and
    the method default it resolves to are the same run (a stored `relative: false` and a new unset one both mean
    sgd's absolute steps)."""
    flat = flatten(config.model_dump(mode="json"))
    method = config.federation.method if isinstance(config, FederatedConfig) else None
    flat["zo.estimator"] = config.zo.resolved_estimator(method)
    if isinstance(config, FederatedConfig):
        prefix = "federation.server_optimizer."
        flat = {k: v for k, v in flat.items() if not k.startswith(prefix)}
        section, fed = config.federation.server_optimizer, config.federation
        section.build(fed.method, fed.rounds)  # settings that do not go together fail here, naming the section
        flat.update({prefix + k: v for k, v in section.resolved(fed.method, fed.rounds).items()})
        # the round the tail average starts at is a share of the rounds: more rounds would move it
        flat["federation.average_start"] = fed.average_start()
    return flat


def check_resumed_config(config: FinetuneConfig, stored_path: Path) -> FinetuneConfig:
    """A resumed run must continue the run it finds: its stored config may differ only in RESUMABLE_CHANGES.
    Anything else (another method, model, seed, learning rate) would mix two runs in one directory.

    Returns the config to continue with: a new `task.prompt_format: auto` takes the format the stored run
    resolved it to."""
    if not stored_path.is_file():
        raise ConfigError(f"{stored_path.parent} has a checkpoint but no config.yaml: cannot tell what run it holds")
    stored = _resolved_view(load_config(stored_path, schema=type(config)))
    new = _resolved_view(config)
    if new["task.prompt_format"] == "auto":
        new["task.prompt_format"] = stored["task.prompt_format"]
        config = config.model_copy(update={"task": config.task.model_copy(
            update={"prompt_format": stored["task.prompt_format"]})})
    if not new["task.verbalizer"]:  # the stored run answered with its label names (data/tasks.py)
        new["task.verbalizer"] = stored["task.verbalizer"]
        config = config.model_copy(update={"task": config.task.model_copy(
            update={"verbalizer": stored["task.verbalizer"]})})
    changed = [f"{key} ({stored.get(key)!r} -> {new.get(key)!r})" for key in sorted(stored.keys() | new.keys())
               if key not in RESUMABLE_CHANGES and stored.get(key) != new.get(key)]
    if changed:
        raise ConfigError(f"cannot resume {stored_path.parent}: its run was made with another config; "
                          f"changed: {', '.join(changed)}")
    schedule = config.optimizer.schedule
    if not isinstance(config, FederatedConfig) and schedule != "constant" \
            and stored["train.steps"] != new["train.steps"]:
        # A linear or cosine lr spans train.steps: more (or fewer) steps would give the steps left another curve
        # than the one the steps already taken followed, a run that no single config describes.
        raise ConfigError(f"cannot resume {stored_path.parent} with train.steps={new['train.steps']}: its "
                          f"optimizer.schedule={schedule} spans its train.steps={stored['train.steps']}; resume with "
                          f"train.steps={stored['train.steps']}, or start a new run (a constant schedule can be "
                          f"extended)")
    return config
