"""Write the Flower app directory of a run: the template pyproject.toml with the resolved config inside.

The config travels as one TOML string in the app's run config, so the SuperLink and every SuperNode get the
same text with the app bundle and no config file has to be copied to the machines; the main settings travel
next to it as flat keys (config.RUN_CONFIG_KEYS) that `flwr run --run-config` can change. Paths inside it
(model directory, data files, out_dir) are read where each app runs: the ServerApp on the SuperLink's machine,
the ClientApps on the SuperNodes' machines.
"""

from __future__ import annotations

import json
import re
import tomllib
from importlib.resources import files
from pathlib import Path

from zofed.atomic_files import write_atomic_text
from zofed.flower.config import (
    CONFIG_KEY,
    RUN_CONFIG_KEYS,
    config_text,
    flat_value,
    num_supernodes,
    resolve_run_config,
)
from zofed.run.config import ConfigError
from zofed.run.federated_config import FederatedConfig


def render_app_pyproject(config: FederatedConfig, *, resume: bool = False) -> str:
    """The app's pyproject.toml: the flat keys set to the config's values, the config's YAML, the resume flag,
    and a comment saying how many SuperNodes the run needs (for a natural split this reads the training data)."""
    template = files("zofed.flower").joinpath("template/pyproject.toml").read_text(encoding="utf-8")
    # A JSON string without ASCII escaping is a valid TOML basic string (YAML output holds no raw DEL), and a JSON
    # number a valid TOML one; the parse below proves it for this config.
    text = template.replace("zofed-resume = false", f"zofed-resume = {'true' if resume else 'false'}").replace(
        '"ZOFED_CONFIG_YAML"', json.dumps(config_text(config), ensure_ascii=False))
    for flat in RUN_CONFIG_KEYS:
        line = f"{flat} = {json.dumps(flat_value(config, flat), ensure_ascii=False)}"
        # A function as the replacement: the line is taken literally (a path may hold backslashes).
        text, found = re.subn(rf"^{re.escape(flat)} = .*$", lambda _, line=line: line, text, count=1,
                              flags=re.MULTILINE)
        if not found:
            raise ConfigError(f"the Flower app template has no run config key {flat!r}")
    nodes = num_supernodes(config)
    text = text.replace("\n[project]", f"\n# This run needs {nodes} SuperNodes, one per client: SuperNode N (N = 0 .. "
                                       f"{nodes - 1}) started with\n# --node-config \"partition-id=N "
                                       f"num-partitions={nodes}\".\n\n[project]", 1)
    app_config = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
    if app_config[CONFIG_KEY] != config_text(config) or resolve_run_config(app_config) != config:
        raise ConfigError("the config did not survive the TOML round trip into the Flower app")
    return text


def write_app(config: FederatedConfig, directory: str | Path, *, resume: bool = False) -> Path:
    """Create `directory`/pyproject.toml for `flwr run`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pyproject.toml"
    write_atomic_text(path, render_app_pyproject(config, resume=resume))
    return path
