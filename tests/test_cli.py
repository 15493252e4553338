"""The command line: `zofed finetune` and `zofed run` share one shape, the README's commands parse, and `zofed eval`
reads both kinds of run directory."""

import json
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.config import load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig

ROOT = Path(__file__).resolve().parents[1]
# Everything but the model and the data, which the tests pass with --model and --data.
BASE = {"data": {"eval_examples": 20}, "task": {"template": "review : {text} . sentiment :",
                                                 "verbalizer": ["negative", "positive"]},
        "trainable": {"mode": "lora", "lora_r": 2}, "optimizer": {"lr": 0.02}, "zo": {"eps": 0.01},
        "train": {"batch_size": 8}}
FEDERATION = {"rounds": 3, "clients_per_round": 2, "local_steps": 1, "partition": {"num_clients": 4, "alpha": 1.0}}


def _stored(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def _shortcuts(ws: Path, out: Path) -> list[str]:
    return ["--model", str(ws / "model"), "--data", str(ws / "train.jsonl"),
            "--set", f"data.test_source={ws / 'test.jsonl'}", "--out", str(out)]


def test_finetune_and_run_take_a_positional_config_and_the_same_shortcuts(tiny_workspace, tmp_path):
    centralized, federated = tmp_path / "centralized.yaml", tmp_path / "federated.yaml"
    centralized.write_text(yaml.safe_dump(BASE))
    federated.write_text(yaml.safe_dump({**BASE, "federation": FEDERATION}))
    runner = CliRunner()
    out = tmp_path / "finetune"
    result = runner.invoke(app, ["finetune", str(centralized), *_shortcuts(tiny_workspace, out), "--steps", "2"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["finetune", str(centralized), *_shortcuts(tiny_workspace, out), "--steps", "3",
                                 "--resume"])
    assert result.exit_code == 0, result.output
    stored = _stored(out)
    assert (stored["model"]["name"], stored["data"]["source"]) == (str(tiny_workspace / "model"),
                                                                   str(tiny_workspace / "train.jsonl"))
    assert stored["train"]["steps"] == 3

    out = tmp_path / "run"
    result = runner.invoke(app, ["run", str(federated), *_shortcuts(tiny_workspace, out), "--rounds", "1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["run", str(federated), *_shortcuts(tiny_workspace, out), "--rounds", "2",
                                 "--resume"])
    assert result.exit_code == 0, result.output
    stored = _stored(out)
    assert (stored["model"]["name"], stored["data"]["source"]) == (str(tiny_workspace / "model"),
                                                                   str(tiny_workspace / "train.jsonl"))
    assert stored["federation"]["rounds"] == 2
    assert json.loads((out / "results.json").read_text())["rounds"] == 2


def test_finetune_config_option_is_a_deprecated_alias(tiny_workspace, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    runner = CliRunner()
    out = tmp_path / "old"
    result = runner.invoke(app, ["finetune", "--config", str(path), *_shortcuts(tiny_workspace, out), "--steps", "0"])
    assert result.exit_code == 0, result.output
    assert "--config is deprecated" in result.output and (out / "results.json").is_file()
    twice = runner.invoke(app, ["finetune", str(path), "-c", str(path)])
    assert twice.exit_code == 2 and "once" in twice.output


def test_a_template_with_colons_and_a_newline_passes_through_set(tiny_workspace, tmp_path):
    out = tmp_path / "template"
    result = CliRunner().invoke(app, ["finetune", *_shortcuts(tiny_workspace, out), "--steps", "0",
                                      "--set", "task.template=Review: {text}\nSentiment:",
                                      "--set", "task.verbalizer=[negative, positive]"])
    assert result.exit_code == 0, result.output  # a yaml ParserError traceback before
    assert _stored(out)["task"]["template"] == "Review: {text}\nSentiment:"


def test_eval_reads_a_federated_run_directory(tiny_workspace, tmp_path):
    out = tmp_path / "federated"
    results = run_federated(tiny_federated_config(tiny_workspace, out), show_progress=False)
    result = CliRunner().invoke(app, ["eval", str(out)])
    assert result.exit_code == 0, result.output
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["test"]["accuracy"] == results["test"]["accuracy"]
    assert evaluated["test_examples"] == results["test_examples"] == 60


def _readme_commands() -> list[str]:
    """The zofed commands of README.md's "Using it" section, and of the Makefile's demo targets."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it", 1)[1].split("\n## ", 1)[0]
    commands = [line.removeprefix(".venv/bin/zofed ") for line in section.splitlines()
                if line.startswith(".venv/bin/zofed ")]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "demo-centralized"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
        for line in recipe.splitlines():
            line = line.strip().replace("$(ARGS)", "").replace("$(DEMO_OUT)", "runs/demo-x")
            line = re.sub(r"\$\$\(date[^)]*\)", "x", line)
            if line.startswith("$(VENV)/bin/zofed "):
                commands.append(line.removeprefix("$(VENV)/bin/zofed "))
    return commands


def test_readme_and_makefile_commands_are_valid(monkeypatch):
    """Each command parses, and each finetune/run command's config (file, --set and options) validates."""
    commands = _readme_commands()
    assert sum(c.startswith("finetune ") for c in commands) >= 3 and sum(c.startswith("run ") for c in commands) >= 3
    monkeypatch.chdir(ROOT)
    group = typer.main.get_command(app)
    for command in commands:
        name, *args = shlex.split(command, comments=True)
        ctx = group.get_command(None, name).make_context(name, args)  # raises on an unknown option or argument
        if name in ("finetune", "run"):
            params = ctx.params
            shortcuts = {"model.name": params["model"], "data.source": params["data"], "out_dir": params["out"],
                         "train.steps": params.get("steps"), "federation.rounds": params.get("rounds")}
            overrides = list(params["set_"] or []) + [f"{k}={v}" for k, v in shortcuts.items() if v is not None]
            schema = FederatedConfig if name == "run" else None
            cfg = load_config(params["config"], overrides, **({"schema": schema} if schema else {}))
            assert cfg.out_dir != "runs/finetune" and cfg.out_dir != "runs/federated", command


@pytest.mark.parametrize("command", ["finetune", "run"])
def test_own_data_options_from_the_readme_work_on_both_commands(command, tmp_path):
    readme = " ".join((ROOT / "README.md").read_text().split())
    own = re.search(r"Your own data[^`]*`finetune` and `run` alike: `(--data path/to/[^`]*)`", readme).group(1)
    own = own.replace("path/to/", f"{tmp_path}/")
    ctx = typer.main.get_command(app).get_command(None, command).make_context(command, shlex.split(own))
    assert ctx.params["data"] == f"{tmp_path}/train.csv"
    cfg = load_config(None, [*ctx.params["set_"], f"data.source={ctx.params['data']}"],
                      **({"schema": FederatedConfig} if command == "run" else {}))
    assert (cfg.data.test_source, cfg.data.text_columns, cfg.data.label_column) == (
        f"{tmp_path}/test.csv", ["review"], "stars")


def test_methods_lists_every_registered_method_with_its_server_default():
    from zofed.fl.methods import method_names

    result = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in method_names():
        assert name in result.output
    assert "adam lr 0.01, global, relative" in result.output  # zofed's own server step
