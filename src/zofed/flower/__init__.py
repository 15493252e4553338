"""The Flower backend: zofed's server and client roles carried by Flower (`flwr` 1.42) Messages.

Flower is an optional extra (`pip install "zofed[flower]"`); nothing here imports it until a Flower code path
runs, so the rest of zofed works without it. Modules:

    messages    zofed's encoded bytes inside Flower messages (seeds and scalars up, never Flower arrays)
    rounds      the ServerApp side: find the SuperNodes and their partitions, drive rounds, count failures
    client      the ClientApp side: build the model and partition once per process, train one client
    apps        the ServerApp and ClientApp objects (module attributes for a deployed Flower app)
    config      the run's config as text, the flat `--run-config` keys laid over it, SuperNodes a run needs
    simulation  `zofed run --backend flower`: the same apps on Flower's simulation engine
    deploy      write the Flower app directory (pyproject.toml from template/) for `flwr run`
"""

from __future__ import annotations

import os

INSTALL_HINT = 'the Flower backend needs flwr: install zofed[flower] (pip install "zofed[flower]")'


def require_flower() -> None:
    """Import flwr or fail with the install command. Also keeps Flower's telemetry off unless the user set it."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    try:
        import flwr  # noqa: F401
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
