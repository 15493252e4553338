"""Write the Flower app directory of a run: the template pyproject.toml with the resolved config inside.

The config travels as one TOML string in the app's run config, so the SuperLink and every SuperNode get the
same text with the app bundle and no config file has to be copied to the machines. Paths inside it (model
directory, data files, out_dir) are read where each app runs: the ServerApp on the SuperLink's machine, the
ClientApps on the SuperNodes' machines.
"""

from __future__ import annotations

import json
import tomllib
from importlib.resources import files
from pathlib import Path

from zofed.flower.config import config_text
from zofed.run.config import ConfigError, FederatedConfig


def render_app_pyproject(config: FederatedConfig, *, resume: bool = False) -> str:
    template = files("zofed.flower").joinpath("template/pyproject.toml").read_text(encoding="utf-8")
    # A JSON string without ASCII escaping is a valid TOML basic string (YAML output holds no raw DEL); the
    # parse below proves it for this config.
    text = template.replace("zofed-resume = false", f"zofed-resume = {'true' if resume else 'false'}").replace(
        '"ZOFED_CONFIG_YAML"', json.dumps(config_text(config), ensure_ascii=False))
    parsed = tomllib.loads(text)
    if parsed["tool"]["flwr"]["app"]["config"]["zofed-config"] != config_text(config):
        raise ConfigError("the config did not survive the TOML round trip into the Flower app")
    return text


def write_app(config: FederatedConfig, directory: str | Path, *, resume: bool = False) -> Path:
    """Create `directory`/pyproject.toml for `flwr run`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pyproject.toml"
    path.write_text(render_app_pyproject(config, resume=resume), encoding="utf-8")
    return path
