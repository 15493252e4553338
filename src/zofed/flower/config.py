"""The resolved run config as text: how the ServerApp and the ClientApps of one run agree on everything."""

from __future__ import annotations

import yaml
from pydantic import ValidationError

from zofed.run.config import ConfigError, FederatedConfig


def config_text(config: FederatedConfig) -> str:
    """The YAML every app of the run reads (the same text `dump_config` writes to the run directory)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def parse_config_text(text: str) -> FederatedConfig:
    try:
        tree = yaml.safe_load(text)
        return FederatedConfig.model_validate(tree)
    except (yaml.YAMLError, ValidationError) as err:
        raise ConfigError(f"the run's zofed config cannot be used: {err}") from None
