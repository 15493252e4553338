"""`--tensorboard DIR`: a run's metrics also as TensorBoard scalars, equal to its metrics.jsonl, and a resume that
drops the events past its checkpoint as the metrics log drops its records."""

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.federated import run_federated
from zofed.run.tensorboard import TensorBoardLog, scalars


def _board(directory: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_are_a_records_finite_numbers_at_its_round():
    step, values = scalars({"step": 3, "round": 2, "event": "round", "eval_accuracy": 0.5, "accepted": 4,
                            "train_loss": float("nan"), "dp": True, "method": "zofed"})
    assert step == 2 and values == {"round/eval_accuracy": 0.5, "round/accepted": 4.0}


def test_a_runs_board_holds_its_metrics_and_a_resume_keeps_one_event_a_round(tiny_workspace, tmp_path):
    board = tmp_path / "board"
    out = tmp_path / "run"
    run_federated(tiny_federated_config(tiny_workspace, out, "federation.rounds=2", f"tensorboard_dir={board}"),
                  show_progress=False)
    # a sitting killed after logging round 3 and before its checkpoint: the resume must drop that event
    TensorBoardLog(board).write({"step": 3, "round": 3, "event": "round", "bytes_up_per_client": -1.0})
    run_federated(tiny_federated_config(tiny_workspace, out, f"tensorboard_dir={board}"), resume=True,
                  show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = _board(board)
    accuracy = [(r["round"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    assert [round(v, 6) for _, v in seen["eval/eval_accuracy"] + seen["round/eval_accuracy"]] == \
        [round(v, 6) for _, v in accuracy]
    rounds = [r for r in records if r["event"] == "round"]
    assert seen["round/bytes_up_per_client"] == [(r["round"], r["bytes_up_per_client"]) for r in rounds]  # once each


def test_the_cli_flag_writes_the_board(tiny_workspace, tmp_path):
    config = tiny_federated_config(tiny_workspace, tmp_path / "unused")
    overrides = [f"model.name={config.model.name}", f"data.source={config.data.source}",
                 f"data.test_source={config.data.test_source}", "trainable.mode=lora", "trainable.lora_r=2",
                 "task.template='review : {text} . sentiment :'", "task.verbalizer=[negative, positive]",
                 "federation.partition.num_clients=4", "federation.clients_per_round=2", "federation.local_steps=1",
                 "data.eval_examples=10"]
    args = ["run", "--rounds", "1", "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")]
    result = CliRunner().invoke(app, [*args, *[a for o in overrides for a in ("--set", o)]])
    assert result.exit_code == 0, result.output
    assert _board(tmp_path / "tb")["round/accepted"] == [(1, 2.0)]
