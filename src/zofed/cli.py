"""The `zofed` command line."""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

app = typer.Typer(help="Federated fine-tuning of language models with zeroth-order (forward-only) gradients.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()


class Backend(enum.StrEnum):
    inprocess = "inprocess"
    flower = "flower"


@app.callback()
def _setup_logging() -> None:
    """Show zofed's own progress messages (e.g. the one-time model cache build) on the console."""
    logger = logging.getLogger("zofed")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=console, show_path=False, show_time=False))
    logger.setLevel(logging.INFO)


def _fail(message: str) -> None:
    # messages may hold brackets (zofed[flower]); soft wrap: one line the terminal wraps, whole when grepped
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=2)


def _user_errors() -> tuple[type[Exception], ...]:
    from zofed.data.dataset import DataError
    from zofed.data.partition import PartitionError
    from zofed.models.registry import ModelLoadError
    from zofed.run.config import ConfigError

    return (ConfigError, DataError, ModelLoadError, PartitionError)


# finetune and run share one shape: an optional positional CONFIG, --set overrides, then shortcut options that
# win over both (they are the more specific).
ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config file; without one the defaults and options make "
                                                       "the run", show_default=False)]
SetOption = Annotated[list[str] | None, typer.Option("--set", "-s", help="override, repeatable, e.g. optimizer.lr=1e-4 "
                                                                         "or 'task.template=Q: {text} A:'")]
ModelOption = Annotated[str | None, typer.Option(help="model.name: smollm2-135m, minilm-l6, hub id or path")]
DataOption = Annotated[str | None, typer.Option(help="data.source: tweets, a file path, or hub:NAME")]
OutOption = Annotated[str | None, typer.Option(help="out_dir: the run directory")]
ResumeOption = Annotated[bool, typer.Option(help="continue the run in --out (out_dir) from its checkpoint")]
TensorBoardOption = Annotated[str | None, typer.Option(
    "--tensorboard", help="tensorboard_dir: also write the metrics there as TensorBoard scalars, live "
                          "(`tensorboard --logdir DIR`)")]


def _overrides(set_: list[str] | None, shortcuts: dict[str, object | None]) -> list[str]:
    return list(set_ or []) + [f"{key}={value}" for key, value in shortcuts.items() if value is not None]


@app.command()
def finetune(
    config: ConfigArg = None,
    set_: SetOption = None,
    model: ModelOption = None,
    data: DataOption = None,
    steps: Annotated[int | None, typer.Option(help="train.steps: number of ZO steps")] = None,
    out: OutOption = None,
    resume: ResumeOption = False,
    tensorboard: TensorBoardOption = None,
    config_option: Annotated[Path | None, typer.Option("--config", "-c", hidden=True,
                                                       help="deprecated: pass CONFIG as the argument")] = None,
) -> None:
    """Centralized ZO fine-tuning (forward passes only) with periodic evaluation and checkpoints.

    CONFIG is a YAML config file (optional); --set overrides it and the other options override both.
    """
    from zofed.run.config import load_config
    from zofed.run.finetune import finetune as run_finetune

    if config_option is not None:
        if config is not None:
            _fail("give the config file once, as CONFIG (--config is a deprecated alias of it)")
        console.print("[yellow]warning:[/] --config is deprecated: pass the config file as the argument, "
                      "zofed finetune CONFIG")
        config = config_option
    overrides = _overrides(set_, {"model.name": model, "data.source": data, "train.steps": steps, "out_dir": out,
                                  "tensorboard_dir": tensorboard})
    try:
        cfg = load_config(config, overrides)
        console.print(f"[bold]zofed finetune[/] model={cfg.model.name} data={cfg.data.source} "
                      f"trainable={cfg.trainable.mode} optimizer={cfg.optimizer.name} steps={cfg.train.steps} "
                      f"-> {cfg.out_dir}")
        results = run_finetune(cfg, resume=resume, show_progress=True)
    except _user_errors() as err:
        _fail(str(err))
    _print_results(results, Path(cfg.out_dir))


@app.command()
def run(
    config: ConfigArg = None,
    set_: SetOption = None,
    model: ModelOption = None,
    data: DataOption = None,
    rounds: Annotated[int | None, typer.Option(help="federation.rounds: number of federated rounds")] = None,
    out: OutOption = None,
    resume: ResumeOption = False,
    tensorboard: TensorBoardOption = None,
    backend: Annotated[Backend, typer.Option(help="inprocess: one process; flower: Flower's simulation engine "
                                                  "(needs the flower extra, docs/flower.md)")] = Backend.inprocess,
) -> None:
    """Federated ZO fine-tuning (seeds and scalars up, weights down) on the in-process engine or on Flower.

    CONFIG is a YAML config file (optional); --set overrides it and the other options override both.
    """
    from zofed.fl.rounds import RoundFailed
    from zofed.run.config import load_config
    from zofed.run.federated import run_federated
    from zofed.run.federated_config import FederatedConfig

    overrides = _overrides(set_, {"model.name": model, "data.source": data, "federation.rounds": rounds,
                                  "out_dir": out, "tensorboard_dir": tensorboard})
    try:
        cfg = load_config(config, overrides, schema=FederatedConfig)
        fed = cfg.federation
        console.print(f"[bold]zofed run[/] method={fed.method} recipe={fed.recipe} model={cfg.model.name} "
                      f"data={cfg.data.source} trainable={_trainable(cfg)} clients={fed.partition.num_clients} "
                      f"({fed.partition.scheme}) rounds={fed.rounds} "
                      f"backend={backend.value} -> {cfg.out_dir}")
        if backend is Backend.flower:
            results = _run_on_flower(cfg, resume)
        else:
            results = run_federated(cfg, resume=resume, console=console)
    except (*_user_errors(), RoundFailed) as err:
        _fail(str(err))
    nothing = _nothing_accepted(Path(cfg.out_dir))
    if nothing:
        _fail(nothing)
    metric = results["client_metric"]  # the task's headline: accuracy, rougeL or loss
    console.print(_results_table("federated results", results, (
        f"eval_{metric}_start", f"eval_{metric}_final", f"client_{metric}_mean", f"client_{metric}_worst10",
        "bytes_up_per_client_round", "bytes_down_per_client_round", "forward_passes", "rejected_uplinks")))
    console.print(f"run directory: {cfg.out_dir} (metrics.jsonl/.csv, partition.png, results.json)")
    if results.get("uplink_log_head"):  # an anchor for the log outside the run directory
        console.print(f"uplink log head: {results['uplink_log_head']}\n  keep it elsewhere; `zofed replay "
                      f"{cfg.out_dir} --expect HEAD` checks the log against it", highlight=False, soft_wrap=True)


def _nothing_accepted(out: Path) -> str | None:
    """Why a federated run that finished never moved its model: no round accepted an uplink (every client's
    training failed, or every uplink was refused). None when some round did."""
    from zofed.run.metrics import MetricsLog

    rounds = [r for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]
    if not rounds or any(r["accepted"] for r in rounds):
        return None
    first = next((r["rejected"][0] for r in rounds if r["rejected"]), None)
    reason = f" (the first refused: client {first['client']}, {first['reason']})" if first else ""
    return (f"none of the {len(rounds)} rounds accepted an uplink, so the model never moved{reason}; every round's "
            f"rejections are in {out / 'metrics.jsonl'}")


def _trainable(cfg) -> str:
    mode, head = cfg.trainable.mode, cfg.trainable.label_head
    return "label-head" if mode == "none" and head else mode + "+label-head" * head


def _run_on_flower(cfg, resume: bool) -> dict:
    """The Flower simulation backend, imported only here: flwr is an optional extra."""
    from zofed.flower import INSTALL_HINT

    try:
        from zofed.flower.rounds import FederationError
        from zofed.flower.simulation import run_flower_simulation
    except ImportError as err:
        _fail(f"{INSTALL_HINT} ({err})")
    try:
        return run_flower_simulation(cfg, resume=resume, console=console)
    except (ImportError, FederationError) as err:
        _fail(str(err))


@app.command("flower-app")
def flower_app(
    config: Annotated[Path, typer.Argument(help="YAML config of the federated run")],
    out: Annotated[Path, typer.Option(help="directory to write the Flower app into")] = Path("flower-app"),
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="override, e.g. federation.rounds=5")] = None,
    resume: Annotated[bool, typer.Option(help="the ServerApp continues out_dir's run from its checkpoint")] = False,
) -> None:
    """Write a Flower app (pyproject.toml with the resolved config) for `flwr run` on a real deployment."""
    from zofed.flower.config import num_supernodes
    from zofed.flower.deploy import write_app
    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig

    try:
        cfg = load_config(config, list(set_ or []), schema=FederatedConfig)
        path = write_app(cfg, out, resume=resume)
        nodes = num_supernodes(cfg)
    except _user_errors() as err:
        _fail(str(err))
    console.print(f"wrote {path}: start the SuperLink and {nodes} SuperNodes, then "
                  f"`flwr run {out} <connection> --stream` (docs/flower.md)")


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="federated run directories to compare")],
    out: Annotated[Path, typer.Option(help="where to write report.png and report.md")] = Path("report"),
) -> None:
    """Plot accuracy against rounds and bytes, and the per-client spread; write a markdown summary."""
    from zofed.run.report import write_report

    try:
        png, md = write_report(run_dirs, out)
    except _user_errors() as err:
        _fail(str(err))
    console.print(md.read_text(), markup=False)  # the markdown's [alt text] is not rich markup
    console.print(f"wrote {png} and {md}")


def _results_table(title: str, results: dict, keys: tuple[str, ...]) -> Table:
    """Test metrics first, then the named result fields that are present."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results["test"].items():
        table.add_row(f"test {key}", f"{value:.4f}")
    for key in keys:
        if results.get(key) is not None:
            value = results[key]
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    return table


def _print_results(results: dict, out: Path) -> None:
    table = _results_table("results", results, ("test_examples", "trainable_parameters", "steps",
                                                 "forward_passes", "train_seconds"))
    curve = results.get("eval_curve") or {}
    if curve:
        first, last = curve["first"], curve["last"]
        for key in ("eval_accuracy", "eval_rougeL", "eval_loss"):
            if key in first:
                table.add_row(f"{key} step {first['step']} -> {last['step']}", f"{first[key]:.4f} -> {last[key]:.4f}")
    console.print(table)
    console.print(f"run directory: {out} (metrics.jsonl, results.json, final/trainable.safetensors)")


@app.command("eval")
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by zofed finetune or zofed run")],
    examples: Annotated[int | None, typer.Option(help="evaluate only the first N test examples")] = None,
) -> None:
    """Evaluate a fine-tuned run's weights on its test split."""
    from zofed.atomic_files import write_atomic_text
    from zofed.run.setup import load_run

    try:
        setup = load_run(run_dir)
    except _user_errors() as err:
        _fail(str(err))
    indices = list(range(min(examples, len(setup.test)))) if examples else None
    result = setup.task.evaluate(setup.model, setup.test, setup.config.train.eval_batch_size, indices, body=setup.body)
    n = len(indices) if indices is not None else len(setup.test)
    write_atomic_text(run_dir / "eval.json", json.dumps({"test": result, "test_examples": n}, indent=2))
    console.print(" ".join(f"{k}={v:.4f}" for k, v in result.items()) + f" on {n} test examples")


@app.command()
def generate(
    run_dir: Annotated[Path, typer.Argument(help="a causal-lm run directory written by zofed finetune or zofed run")],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="an instruction to answer, repeatable")]
    = None,
    prompts_file: Annotated[Path | None, typer.Option(help="instructions, one per line; or a .jsonl file whose lines "
                                                           "have an instruction (and optionally a context) field")]
    = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="the longest answer, in tokens")] = 128,
) -> None:
    """Answer instructions greedily with a run's tuned model, in the run's prompt format (chat template or
    task.template)."""
    from zofed.run.generate import generate_from_run, read_prompts

    try:
        prompts = [*(prompt or []), *(read_prompts(prompts_file) if prompts_file is not None else [])]
        if not prompts:
            _fail("give at least one --prompt or a --prompts-file")
        answers = generate_from_run(run_dir, prompts, max_new_tokens, show_progress=len(prompts) > 1)
    except _user_errors() as err:
        _fail(str(err))
    except OSError as err:  # an unreadable --prompts-file
        _fail(f"cannot read {prompts_file}: {err}")
    for asked, answer in zip(prompts, answers, strict=True):
        instruction = asked if isinstance(asked, str) else asked["instruction"]
        console.print(f"[bold]> {escape(instruction)}[/]")
        console.print(escape(answer), highlight=False)


@app.command("export")
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by zofed finetune or zofed run")],
    out: Annotated[Path, typer.Option(help="a new directory for the model (it must not exist, or be empty)")],
    merge: Annotated[bool, typer.Option(help="LoRA runs: write the full model with the adapter merged in, "
                                             "instead of the adapter directory")] = False,
) -> None:
    """Write a run's tuned model as a save_pretrained directory that transformers (or peft) load without zofed."""
    from zofed.run.export import export_run

    try:
        exported = export_run(run_dir, out, merge=merge)
    except _user_errors() as err:
        _fail(str(err))
    console.print(f"{exported.kind} written to {exported.out}: {', '.join(exported.files)}")
    if exported.kind == "peft adapter":
        console.print("load it with peft.PeftModel.from_pretrained(base_model, DIR), or export with --merge")


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="a federated run directory written by zofed run")],
    trace: Annotated[bool, typer.Option(help="also show how each round moved the model: the server step's "
                                             "length, the distance from the start, the tensor grown the most, and "
                                             "how far the round's clients' updates agreed (0: mostly noise)")] = False,
    expect: Annotated[str | None, typer.Option(
        metavar="HASH", help="the log head `zofed run` printed (results.json's uplink_log_head), kept outside the "
                             "run directory: the replay fails unless the log ends in it. The full SHA-256 or a "
                             "prefix of at least 32 hex digits")] = None,
) -> None:
    """Rebuild a federated run's final model from its uplink log alone (no data) and check it against final/.

    Whoever can edit the run directory can rewrite the log's hash chain from any line on; --expect checks the
    log against a head kept elsewhere."""
    from zofed.run.replay import replay_run
    from zofed.run.uplink_log import LogError

    try:
        done = replay_run(run_dir, trace=trace, expect=expect)
    except (*_user_errors(), LogError) as err:
        _fail(str(err))
    if done.trace:
        table = Table(title="how each round moved the model (the server's iterate)")
        for column in ("round", "step", "from start", "grown the most", "its RMS (start → now)", "clients agree"):
            table.add_column(column)
        for r in done.trace:
            table.add_row(str(r.round), f"{r.step:.4g}", f"{r.distance:.4g}", r.largest,
                          f"{r.largest_start_rms:.3g} → {r.largest_rms:.3g}",
                          "-" if r.agreement is None else f"{r.agreement:+.3f}")
        console.print(table)
    console.print(f"replayed {done.rounds} rounds, {done.uplinks} uplinks; log head {done.head}")
    if not done.matches:
        _fail(f"the replayed model differs from {done.final} (largest difference {done.max_abs_difference:.3g}): "
              "the log does not describe this model")
    console.print(f"the replayed model equals {done.final} bit for bit"
                  + (", and the log ends in the expected head" if expect is not None else ""))


@app.command()
def methods() -> None:
    """List the registered federated methods (federation.method) and their server optimizer defaults."""
    from zofed.fl.methods import get_method, method_names

    table = Table(title="federated methods")
    for column in ("method", "what it does", "server default"):
        table.add_column(column)
    for name in method_names():
        method = get_method(name)
        default = method.server_default
        server = f"{default.name} lr {default.lr:g}" + (f", {default.granularity}" if default.name != "sgd" else "")
        table.add_row(name + (" (default)" if name == "zofed" else ""), method.summary,
                      server + (", relative" if default.relative else ""))
    console.print(table)


@app.command()
def models() -> None:
    """List the built-in models (they install from PyPI and work offline)."""
    from zofed.models.registry import BUILTIN_MODELS

    for name, spec in BUILTIN_MODELS.items():
        console.print(f"{name}: {spec}")


if __name__ == "__main__":
    app()
