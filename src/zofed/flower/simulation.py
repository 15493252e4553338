"""`zofed run --backend flower`: zofed's ServerApp and ClientApp on Flower's simulation engine.

The ServerApp runs in this process (a thread of Flower's simulation runtime) and writes the run directory the
in-process engine writes; every client id is one simulated SuperNode (node config partition-id = client id)
whose ClientApp runs in a Ray worker process that builds the model once and keeps it across rounds. The run is
prepared (model, data, partition) here before the engine starts: the partition says how many SuperNodes to
simulate (a natural split has one client per distinct column value, whatever `num_clients` says), and a bad
config fails before Ray starts.
`flwr.simulation.run_simulation` is Flower 1.42's Python entry point to this engine (Flower marks it deprecated
in favour of `flwr run` against a local SuperLink; zofed keeps it so a run needs no app directory or daemon).
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

from zofed.flower import require_flower
from zofed.run.federated_config import FederatedConfig


def run_flower_simulation(config: FederatedConfig, *, resume: bool = False, show_progress: bool = True,
                          console: Console | None = None, client_app: Any = None) -> dict[str, Any]:
    """Run the configured federation on Flower's simulation engine; returns (and writes) the final results.
    `client_app` replaces zofed's ClientApp (tests use it to inject faults)."""
    require_flower()
    # Ray's notice that it will stop overriding device variables when no GPU is asked for: nothing to act on.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from zofed.flower.apps import make_client_app, make_server_app
    from zofed.flower.config import config_text
    from zofed.run.federated import prepare_run

    console = console or Console()
    run = prepare_run(config, resume=resume, console=console)
    outcome: dict[str, Any] = {}
    server_app = make_server_app(config, resume=resume, console=console, show_progress=show_progress,
                                 outcome=outcome, prepared=run)
    backend = {"client_resources": {"num_cpus": config.flower.client_cpus, "num_gpus": config.flower.client_gpus}}
    try:
        # One SuperNode per client of the partition (the ServerApp waits for len(run.splits) of them).
        run_simulation(server_app, client_app or make_client_app(config_text(config)),
                       num_supernodes=len(run.splits), backend_config=backend)
    except BaseException:
        if "error" in outcome:  # the ServerApp's own error says more than the engine's wrapper
            raise outcome["error"] from None
        raise
    if "error" in outcome:
        raise outcome["error"]
    if "results" not in outcome:
        raise RuntimeError("Flower's simulation ended without the zofed ServerApp finishing; see the log above")
    return outcome["results"]
