"""The Flower ServerApp and ClientApp of zofed (Message API).

`server_app` and `client_app` are the components a deployed Flower app names (template/pyproject.toml); both
read the run's config from the run config with `resolve_run_config` (the `zofed-config` YAML with the flat keys
such as `rounds` or `lr` laid over it), so a `flwr run --run-config` override reaches the server and every
client alike. The simulation backend builds its own pair with `make_server_app(config, ...)` and
`make_client_app(config_text)` so nothing travels through files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from zofed.flower.client import answer_query, train_client
from zofed.flower.secure import secure_mod


def make_server_app(config: Any = None, *, resume: bool = False, console: Any = None, show_progress: bool = False,
                    outcome: dict[str, Any] | None = None, prepared: Any = None) -> ServerApp:
    """A ServerApp running one zofed federation. `config` (a FederatedConfig) defaults to the run config's
    `zofed-config` text; `prepared` (a FederatedRun from `prepare_run`) is used instead of preparing the run
    here, so the simulation can size its SuperNodes from the partition without building twice; `outcome`
    receives "results" or the "error" that ended the run."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from rich.console import Console

        from zofed.flower.config import RESUME_KEY, resolve_run_config
        from zofed.flower.rounds import serve
        from zofed.run.federated import prepare_run

        try:
            out = console or Console()
            run = prepared
            if run is None:
                cfg, again = config, resume
                if cfg is None:  # a deployed app: the run config, with any `flwr run --run-config` overrides
                    cfg, again = resolve_run_config(context.run_config), bool(context.run_config.get(RESUME_KEY))
                run = prepare_run(cfg, resume=again, console=out)
            t0 = time.perf_counter()
            with run.progress(out, show_progress) as on_round:
                connect = serve(grid, run, _reported(on_round, out, quiet=show_progress))
            results = run.finish(time.perf_counter() - t0, backend="flower", flower_connect_seconds=connect)
            out.print(f"zofed run finished: test {results['test']}, rejected uplinks {results['rejected_uplinks']}"
                      f", uplink log head {results['uplink_log_head']}")  # to keep outside the run directory
            if outcome is not None:
                outcome["results"] = results
        except BaseException as err:
            if outcome is not None:
                outcome["error"] = err
            raise

    return app


def _reported(on_round: Callable[[dict], None], console: Any, quiet: bool) -> Callable[[dict], None]:
    """Write each round; without a progress bar (a deployed ServerApp's log) also print one line a round."""
    def write(record: dict) -> None:
        on_round(record)
        if not quiet:
            console.print(f"round {record['round']}: accepted {record['accepted']}, rejected "
                          f"{len(record['rejected'])} (client errors {record['client_errors']}, missing "
                          f"{record['missing']}), train loss {record['train_loss']:.4f}, {record['round_seconds']} s")
    return write


def make_client_app(config_text: str | None = None) -> ClientApp:
    """A ClientApp training the client its SuperNode's `partition-id` names; `config_text` defaults to the
    run config's, resolved as the ServerApp resolves it."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return answer_query(message, context)

    @app.train(mods=[secure_mod])  # SecAgg+ for the messages of a secure round; others pass through
    def train(message: Message, context: Context) -> Message:
        return train_client(message, context, config_text)

    return app


server_app = make_server_app()
client_app = make_client_app()
