"""Centralized ZO fine-tuning end to end on a tiny random-init model saved to a local directory."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from zofed.cli import app
from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm
from zofed.run.config import ConfigError, load_config
from zofed.run.finetune import finetune
from zofed.run.setup import load_run
from zofed.zo.optim import make_optimizer
from zofed.zo.step import zo_step


def _config(ws, out, *extra, **train):
    overrides = [f"model.name={ws / 'model'}", f"data.source={ws / 'train.jsonl'}",
                 f"data.test_source={ws / 'test.jsonl'}", "data.eval_examples=40",
                 "task.template='review : {text} . sentiment :'", "task.verbalizer=[negative, positive]",
                 "trainable.mode=all", "optimizer.name=zo-adam", "optimizer.lr=0.01", "zo.eps=0.01",
                 "train.batch_size=8", "train.eval_every=5", "train.checkpoint_every=5", f"out_dir={out}"]
    overrides += [*extra, *(f"train.{k}={v}" for k, v in train.items())]
    return load_config(None, overrides)


def test_mezo_lowers_the_loss_of_a_tiny_causal_lm_on_a_fixed_batch():
    tiny = tiny_causal_lm(seed=0)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode="all"))
    task = make_task(TaskConfig(template="review : {text} sentiment :", verbalizer=["negative", "positive"]),
                     tiny.tokenizer, 2)
    data = TextDataset([{"text": t} for t in ["good movie", "bad movie", "great", "awful it was"]],
                       [1, 0, 1, 0], ["negative", "positive"], "fixed")
    batch = task.collate(task.encode(data), [0, 1, 2, 3])
    before = task.loss(model, batch)
    opt = make_optimizer("mezo")
    state = opt.init(trainable.tensors())
    for step in range(150):
        state, _ = zo_step(trainable.tensors(), lambda: task.loss(model, batch), opt, state, seed=step,
                           eps=1e-2, lr=0.05)
    assert task.loss(model, batch) < 0.8 * before
    assert all(p.grad is None for p in model.parameters())  # the ZO path never allocates gradients


def test_finetune_writes_metrics_weights_and_results_that_eval_reloads(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    results = finetune(_config(tiny_workspace, out, steps=10), show_progress=False)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert sum(r["event"] == "train" for r in lines) == 10
    assert evals[-1]["forward_passes"] == 20
    assert json.loads((out / "results.json").read_text())["test"] == results["test"]
    setup = load_run(out)
    again = setup.task.evaluate(setup.model, setup.test, 32)
    assert again == pytest.approx(results["test"], rel=1e-6)
    saved = load_file(str(out / "final" / "trainable.safetensors"))
    assert set(saved) == set(setup.trainable.names)


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tiny_workspace, tmp_path):
    finetune(_config(tiny_workspace, tmp_path / "whole", steps=10), show_progress=False)
    finetune(_config(tiny_workspace, tmp_path / "split", steps=5), show_progress=False)  # "killed" after step 5
    finetune(_config(tiny_workspace, tmp_path / "split", steps=10), resume=True, show_progress=False)
    whole = load_file(str(tmp_path / "whole" / "final" / "trainable.safetensors"))
    split = load_file(str(tmp_path / "split" / "final" / "trainable.safetensors"))
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    split_steps = [json.loads(x)["step"] for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert split_steps.count(5) == 2  # one train and one eval record at step 5, nothing duplicated


def test_existing_run_is_not_overwritten_without_resume(tiny_workspace, tmp_path):
    finetune(_config(tiny_workspace, tmp_path / "run", steps=5), show_progress=False)
    with pytest.raises(ConfigError, match="--resume"):
        finetune(_config(tiny_workspace, tmp_path / "run", steps=5), show_progress=False)
    with pytest.raises(ConfigError, match=r"train.seed \(0 -> 7\)"):
        finetune(_config(tiny_workspace, tmp_path / "run", steps=5, seed=7), resume=True,
                 show_progress=False)


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_decaying_schedule_cannot_resume_with_other_steps_but_a_constant_one_can(tiny_workspace, tmp_path):
    """linear and cosine span train.steps: more steps would put the steps left on another curve than the steps
    taken. A constant lr (with or without warm-up) does not depend on train.steps."""
    finetune(_config(tiny_workspace, tmp_path / "constant", "optimizer.warmup=2", steps=2), show_progress=False)
    finetune(_config(tiny_workspace, tmp_path / "constant", "optimizer.warmup=2", steps=4), resume=True,
             show_progress=False)
    assert json.loads((tmp_path / "constant" / "results.json").read_text())["steps"] == 4
    cosine = tmp_path / "cosine"
    finetune(_config(tiny_workspace, cosine, "optimizer.schedule=cosine", steps=2), show_progress=False)
    before = _tree(cosine)
    with pytest.raises(ConfigError, match=r"train.steps=4.*optimizer.schedule=cosine spans its train.steps=2"):
        finetune(_config(tiny_workspace, cosine, "optimizer.schedule=cosine", steps=4), resume=True,
                 show_progress=False)
    assert _tree(cosine) == before  # refused before anything was written
    finetune(_config(tiny_workspace, cosine, "optimizer.schedule=cosine", steps=2), resume=True,
             show_progress=False)  # the same steps: nothing left to do, but a valid resume


def test_a_fresh_run_starts_its_metrics_over(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "event": "train", "loss": 9.9, "stale": True}) + "\n")
    finetune(_config(tiny_workspace, out, steps=2), show_progress=False)  # no checkpoint: a crashed earlier sitting
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("stale" in r for r in records)
    assert [(r["step"], r["event"]) for r in records] == [(0, "eval"), (1, "train"), (2, "train"), (2, "eval")]


def test_a_centralized_run_of_a_federated_config_writes_a_centralized_run_dir(tiny_workspace, tmp_path):
    """The benchmarks' centralized reference: a federated config with train.steps set in place (no validation)."""
    from toy_federation import tiny_federated_config

    out = tmp_path / "reference"
    config = tiny_federated_config(tiny_workspace, out)
    config = config.model_copy(update={"train": config.train.model_copy(update={
        "steps": 2, "eval_every": 2, "checkpoint_every": 2})})
    finetune(config, show_progress=False)
    assert "federation" not in (out / "config.yaml").read_text()
    assert load_run(out).config.train.steps == 2
    finetune(config, resume=True, show_progress=False)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.lrr"):
        load_config(None, ["optimizer.lrr=0.1"])
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_config(None, ["optimizer.lr=-1"])
    with pytest.raises(ConfigError, match="unknown ZO optimizer 'sgd'"):
        load_config(None, ["optimizer.name=sgd"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_file_and_overrides_merge_section_by_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: {name: zo-adam, lr: 0.002}\ntrain: {steps: 7}\n")
    cfg = load_config(path, ["optimizer.lr=0.5"])
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.train.steps, cfg.train.batch_size) == ("zo-adam", 0.5, 7, 16)


def test_cli_finetune_and_eval(tiny_workspace, tmp_path):
    out = tmp_path / "cli"
    cfg = _config(tiny_workspace, out, steps=5)
    path = tmp_path / "c.yaml"
    from zofed.run.stored_config import dump_config

    dump_config(cfg, path)
    runner = CliRunner()
    result = runner.invoke(app, ["finetune", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "test accuracy" in result.output
    result = runner.invoke(app, ["eval", str(out)])
    assert result.exit_code == 0 and "accuracy=" in result.output
    assert json.loads((out / "eval.json").read_text())["test_examples"] == 60
    bad = runner.invoke(app, ["finetune", "--config", str(path), "--set", "train.stepz=3"])
    assert bad.exit_code == 2 and "train.stepz" in bad.output
    missing = runner.invoke(app, ["finetune", "--set", f"data.source={tmp_path / 'nope.csv'}"])
    assert missing.exit_code == 2 and "nope.csv" in missing.output


@pytest.mark.parametrize("name", ["demo.yaml", "sst2_centralized.yaml", "federated_tweets.yaml", "federated_demo.yaml"])
def test_shipped_configs_validate(name):
    from pathlib import Path

    from zofed.run.federated_config import FederatedConfig

    path = Path(__file__).resolve().parents[1] / "configs" / name
    schema = FederatedConfig if name.startswith("federated") else None
    cfg = load_config(path, schema=schema) if schema else load_config(path)
    assert len(cfg.task.verbalizer) >= 2 and cfg.train.batch_size >= 1
