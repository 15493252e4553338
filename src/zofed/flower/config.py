"""The resolved run config as text: how the ServerApp and the ClientApps of one run agree on everything.

A deployed app carries the whole zofed config as YAML in its run config (`zofed-config`) and, next to it, the
main settings as flat keys (RUN_CONFIG_KEYS) so Flower's own `flwr run ... --run-config "rounds=10 lr=2e-4"`
changes them (`lr` is the clients' learning rate, whichever key the run's method reads it from: `run_config_key`).
`resolve_run_config` lays the flat keys over the YAML and validates the result with the same schema as any zofed
config; the ServerApp and every ClientApp call it on the run config Flower hands them (the same for every app of
a run), so they resolve the same config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from zofed.run.config import ConfigError
from zofed.run.federated_config import FederatedConfig

CONFIG_KEY = "zofed-config"  # run config key holding the resolved YAML config (deployment)
RESUME_KEY = "zofed-resume"

# Flat run config key -> the zofed config key it sets. The ServerApp and the ClientApps lay these over the YAML.
RUN_CONFIG_KEYS: dict[str, str] = {
    "rounds": "federation.rounds",
    "method": "federation.method",
    "clients-per-round": "federation.clients_per_round",
    "local-steps": "federation.local_steps",
    "lr": "optimizer.lr",
    "eps": "zo.eps",
    "seed": "train.seed",
    "out-dir": "out_dir",
}
# `lr` is the clients' learning rate: optimizer.lr for the zeroth-order methods, this for the methods whose clients
# back-propagate (fedavg, fedadam), which never read optimizer.lr
FIRST_ORDER_LR = "federation.first_order_lr"


def run_config_key(flat: str, method: str) -> str:
    """The zofed key that the flat key `flat` sets in a run of `method`."""
    from zofed.fl.methods import get_method

    if flat == "lr":
        try:
            first_order = get_method(method).first_order
        except ValueError:  # an unknown method: the validation names it
            first_order = False
        return FIRST_ORDER_LR if first_order else RUN_CONFIG_KEYS[flat]
    return RUN_CONFIG_KEYS[flat]


def config_text(config: FederatedConfig) -> str:
    """The YAML every app of the run reads. Method defaults stay unset here, as the user left them (a flat
    `method=` key then brings its own server optimizer); the run directory's config.yaml pins them."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def parse_config_text(text: str) -> FederatedConfig:
    try:
        tree = yaml.safe_load(text)
        return FederatedConfig.model_validate(tree)
    except (yaml.YAMLError, ValidationError) as err:
        raise ConfigError(f"the run's zofed config cannot be used: {err}") from None


def config_value(config: FederatedConfig | dict, dotted: str) -> Any:
    """The value of `section.key` in `config` (as it dumps to YAML); None where a tree lacks it."""
    node: Any = config if isinstance(config, dict) else config.model_dump(mode="json")
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def flat_value(config: FederatedConfig, flat: str) -> Any:
    """What the flat key `flat` holds for `config`: the value of the zofed key it sets in a run of its method."""
    return config_value(config, run_config_key(flat, config.federation.method))


def resolve_run_config(run_config: Mapping[str, Any]) -> FederatedConfig:
    """The run's FederatedConfig: the `zofed-config` YAML with the flat keys present in `run_config` laid over
    it, validated as one config. A flat key whose value the schema refuses fails naming the flat key and the
    zofed key it sets."""
    text = run_config.get(CONFIG_KEY)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"the run config has no {CONFIG_KEY!r}: write the app with `zofed flower-app`")
    written = parse_config_text(text)  # the YAML alone must be valid: an error in it is not a flat key's fault
    tree = yaml.safe_load(text)
    method = run_config.get("method", written.federation.method)
    laid: dict[str, str] = {}  # zofed key -> flat key, for the error message
    for flat in RUN_CONFIG_KEYS:
        if flat not in run_config:
            continue
        value, dotted = run_config[flat], run_config_key(flat, method)
        if isinstance(value, bool):  # pydantic would read true as 1; no flat key is a switch
            raise ConfigError(f"run config key {flat!r} ({dotted}) = {value!r}: not a boolean setting")
        if dotted != run_config_key(flat, written.federation.method) and value == flat_value(written, flat):
            continue  # `method` switched between zeroth and first order, `lr` left as written for the old one
        node = tree
        *sections, leaf = dotted.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
        laid[dotted] = flat
    try:
        return FederatedConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_flat_errors(err, laid, run_config)) from None


def _flat_errors(err: ValidationError, laid: dict[str, str], run_config: Mapping[str, Any]) -> str:
    lines = ["the run config's flat keys give an invalid zofed config:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        # A field error sits at the zofed key; a check across fields sits at its section (or the top level).
        keys = [d for d in laid if d == where] or [d for d in laid if not where or d.startswith(where + ".")]
        named = ", ".join(f"{laid[d]!r} ({d}) = {run_config[laid[d]]!r}" for d in keys)
        lines.append(f"  run config key {named}: {e['msg']}" if keys else f"  {where or '(top level)'}: {e['msg']}")
    return "\n".join(lines)


def num_supernodes(config: FederatedConfig) -> int:
    """SuperNodes the run needs, one per client of its partition: `federation.partition.num_clients`, except for a
    natural split, which has one client per distinct value of its column in the training data (read here, without
    building the model)."""
    partition_config = config.federation.partition
    if partition_config.scheme != "natural":
        return partition_config.num_clients
    from zofed.data.partition import partition
    from zofed.run.setup import load_splits

    train, _ = load_splits(config)
    return len(partition(train, partition_config))
