"""Crash safety with real processes: a `zofed run` killed with SIGKILL twenty times, at random moments and
during checkpoint writes and log appends, then at exact points of a round's writes (after its checkpoint swap,
between its metrics record and its checkpoint, inside a metrics or log line), and resumed each time, ends with
the uninterrupted run's model bit for bit and every round's metrics record once; after every kill the run
directory is usable (a complete checkpoint or none, a readable log, the records of every checkpointed round).

The writes themselves: a round's log line and metrics record reach the disk before its checkpoint, on both
backends; files are replaced through private temporary files, flushed; a torn last metrics line is dropped."""

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config

from zofed.atomic_files import remove_stale_temporaries, write_atomic_text
from zofed.run.checkpoint import find_checkpoint, load_checkpoint
from zofed.run.config import ConfigError, load_config
from zofed.run.federated_config import FederatedConfig
from zofed.run.metrics import MetricsLog
from zofed.run.replay import replay_run
from zofed.run.stored_config import dump_config
from zofed.run.uplink_log import LOG_NAME, read_log

KILLS = 20
ROUNDS = 40

# `zofed run` that SIGKILLs itself at an exact point of the first round it records (argv[1] names the point).
KILL_AT = """
import json, os, signal, sys
from zofed.run import federated
from zofed.run.metrics import MetricsLog
from zofed.run.uplink_log import UplinkLog

point = sys.argv.pop(1)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def torn(path, line):  # what a kill in the middle of an append leaves: part of a line
    with open(path, "a") as f:
        f.write(line[: len(line) // 2])
    die()


save, write, append = federated.save_checkpoint, MetricsLog.write, UplinkLog.append


def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    die()


def write_then_die(self, record):
    if record["event"] != "round":
        return write(self, record)
    if point == "inside a metrics record":
        torn(self.path, json.dumps(record))
    write(self, record)
    die()


def append_torn(self, *args):
    torn(self.path, json.dumps({"round": args[0], "prev": self.prev, "uplinks": [], "rejected": []}))


if point == "after a checkpoint swap":
    federated.save_checkpoint = save_then_die
elif point == "inside a log line":
    UplinkLog.append = append_torn
else:  # "after a metrics record" (before its checkpoint) or "inside a metrics record"
    MetricsLog.write = write_then_die
from zofed.cli import app
app()
"""
EXACT_POINTS = ["after a checkpoint swap", "after a metrics record", "inside a metrics record", "inside a log line"]


def _start(config: Path, out: Path, kill_at: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every process: the same float sums
    program = ["-m", "zofed.cli"] if kill_at is None else ["-c", KILL_AT, kill_at]
    return subprocess.Popen([sys.executable, *program, "run", str(config), "--out", str(out), "--resume"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _kill_when(process: subprocess.Popen, moment: str, out: Path, rng: np.random.Generator) -> str:
    """SIGKILL `process` at `moment`; returns what was going on (or "finished" if it ended first)."""
    deadline = time.monotonic() + 60
    log, metrics = out / LOG_NAME, out / "metrics.jsonl"
    logged, recorded = _lines(log), _lines(metrics)
    if moment == "random":
        time.sleep(rng.uniform(0.0, 4.0))  # from the process start: loading the model, or any round's phase
    while process.poll() is None and time.monotonic() < deadline and moment != "random":
        if moment == "checkpoint write" and (out / "checkpoint.tmp").exists():
            break
        if moment == "after a log append" and _lines(log) > logged:
            break  # the round is logged and its checkpoint not yet (or just) written
        if moment == "local steps" and _lines(metrics) > recorded + 1:
            time.sleep(rng.uniform(0.0, 0.15))  # into the next round's client training
            break
        time.sleep(0.0005)
    if process.poll() is not None:
        return "finished"
    process.send_signal(signal.SIGKILL)
    process.wait()
    return moment


def _assert_usable(out: Path) -> int:
    """The run directory after a kill: its config loads, its checkpoint (if any) is whole, its log reads and
    holds at least the checkpoint's rounds. Returns the checkpoint's round."""
    if not (out / "config.yaml").is_file():
        return 0  # killed before the run wrote anything
    load_config(out / "config.yaml", schema=FederatedConfig)
    round_done = 0
    if find_checkpoint(out / "checkpoint") is not None:
        tensors, meta = load_checkpoint(out / "checkpoint")
        assert "trainable" in tensors and "server_optimizer" in tensors
        round_done = int(meta["round"])
    if (out / LOG_NAME).is_file():
        text = (out / LOG_NAME).read_text()
        whole = out.parent / "whole-lines.jsonl"  # a torn last line (a kill mid-append) is the resume's to cut
        whole.write_text(text if text.endswith("\n") else text[: text.rfind("\n") + 1])
        _, rounds, _ = read_log(whole) if _lines(whole) else ({}, [], "")
        assert len(rounds) >= round_done  # a round is logged before its checkpoint, never after
    recorded = {r["round"] for r in MetricsLog(out / "metrics.jsonl").read() if r["event"] == "round"}
    assert recorded >= set(range(1, round_done + 1))  # and recorded before it, never after
    return round_done


def test_a_run_killed_twenty_times_ends_with_the_uninterrupted_model(tiny_workspace, tmp_path):
    config = tmp_path / "run.yaml"
    dump_config(tiny_federated_config(tiny_workspace, tmp_path / "unused", f"federation.rounds={ROUNDS}",
                                      "federation.eval_every=5"), config)
    reference = tmp_path / "reference"
    assert _start(config, reference).wait() == 0
    out = tmp_path / "killed"
    rng = np.random.default_rng(0)
    moments = ["random", "checkpoint write", "after a log append", "local steps"]
    seen, progress, torn = [], [], 0
    for kill in range(KILLS):
        process = _start(config, out)
        seen.append(_kill_when(process, moments[kill % len(moments)], out, rng))
        torn += (out / "checkpoint.tmp").exists()  # a kill that tore a checkpoint write
        progress.append(_assert_usable(out))
    assert "finished" not in seen, f"the run ended before {KILLS} kills: {seen}"
    assert torn >= 1, "no kill landed inside a checkpoint write"
    for point in EXACT_POINTS:
        process = _start(config, out, kill_at=point)
        assert process.wait() == -signal.SIGKILL, f"{point}: {process.stderr.read().decode()[-2000:]}"
        progress.append(_assert_usable(out))
    assert progress[-1] > 0 and progress == sorted(progress), progress  # resumes never go backwards
    finish = _start(config, out)
    assert finish.wait() == 0, finish.stderr.read().decode()[-2000:]
    got, want = load_file(out / "final/trainable.safetensors"), load_file(reference / "final/trainable.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert replay_run(out).matches  # the log of a run resumed twenty-four times replays to its model
    recorded = [r["round"] for r in MetricsLog(out / "metrics.jsonl").read() if r["event"] == "round"]
    assert recorded == list(range(1, ROUNDS + 1))  # every round's record once: none lost, none twice
    assert not list(out.glob(".*.tmp")) and not list((out / "final").glob(".*.tmp"))  # no half-written leftovers


def test_a_round_is_logged_and_recorded_before_its_checkpoint(tiny_workspace, tmp_path, monkeypatch):
    from zofed.run import federated

    out, seen, save = tmp_path / "run", [], federated.save_checkpoint

    def save_checkpoint(directory, tensors, meta):  # what the disk holds when the checkpoint goes in
        recorded = [r["round"] for r in MetricsLog(out / "metrics.jsonl").read() if r["event"] == "round"]
        seen.append((meta["round"], recorded[-1] if recorded else None, _lines(out / LOG_NAME) - 1))
        save(directory, tensors, meta)

    monkeypatch.setattr(federated, "save_checkpoint", save_checkpoint)
    federated.run_federated(tiny_federated_config(tiny_workspace, out), show_progress=False)
    assert seen == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]


def test_the_flower_backend_records_a_round_before_its_checkpoint(monkeypatch):
    rounds = pytest.importorskip("zofed.flower.rounds", exc_type=ImportError)
    calls = []
    monkeypatch.setattr(rounds, "connect_clients", lambda grid, num_clients, timeout: {})
    monkeypatch.setattr(rounds, "min_clients", lambda run: 1)
    monkeypatch.setattr(rounds, "run_round", lambda server, round_id, deliver, min_accepted: {"round": round_id + 1})
    monkeypatch.setattr(rounds, "load_tensors_", lambda tensors, new: None)
    config = SimpleNamespace(federation=SimpleNamespace(rounds=3),
                             flower=SimpleNamespace(node_timeout=1.0, reply_timeout=1.0, secure_aggregation=False))
    run = SimpleNamespace(config=config, start_round=1, splits=[], server=SimpleNamespace(model_tensors=list),
                          setup=SimpleNamespace(trainable=SimpleNamespace(tensors=list)), evaluate=lambda r: {},
                          checkpoint=lambda round_done, server: calls.append(("checkpoint", round_done)))
    rounds.serve(None, run, lambda record: calls.append(("record", record["round"])))
    assert calls == [("record", 2), ("checkpoint", 2), ("record", 3), ("checkpoint", 3)]


def test_two_writers_of_one_file_each_replace_it_whole(tmp_path, monkeypatch):
    """A second writer renames its file in while the first is between its write and its rename: each writes its
    own temporary file, so the first still lands, whole (the last rename wins), and no temporary file is left."""
    path, replace, nested = tmp_path / "results.json", os.replace, []

    def interleaved(src, dst):
        if not nested:
            nested.append(src)
            write_atomic_text(path, "second writer")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interleaved)
    write_atomic_text(path, "first writer")
    assert path.read_text() == "first writer" and os.listdir(tmp_path) == ["results.json"]


def test_writes_reach_the_disk_before_they_count(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def recorded(fd):
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    write_atomic_text(tmp_path / "results.json", "{}")
    assert synced == ["file", "dir"]  # the data before its rename, the rename before returning
    log = MetricsLog(tmp_path / "metrics.jsonl")
    synced.clear()
    log.write({"step": 1})
    log.write({"step": 2})
    assert synced == ["file", "dir", "file"]  # every record; the directory once, when the file is made


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_one_named(tmp_path, caplog):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2):
        log.write({"step": step, "event": "round"})
    with log.path.open("a") as f:
        f.write('{"step": 3, "ev')  # a kill in the middle of an append
    with caplog.at_level(logging.WARNING, logger="zofed"):
        assert [r["step"] for r in log.read()] == [1, 2]
    assert "torn last line 3" in caplog.text
    log.truncate_after(2)  # a resume from round 2 cuts the torn line away
    assert log.path.read_text().splitlines() == ['{"step": 1, "event": "round"}', '{"step": 2, "event": "round"}']
    lines = log.path.read_text().splitlines()
    log.path.write_text("\n".join([lines[0], '{"step": 2, "ev', lines[1]]) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl, line 2: not a JSON record"):
        log.read()
    log.path.write_text(lines[0] + "\n" + lines[1] + "x\n")  # a damaged last line, whole: not a torn append
    with pytest.raises(ConfigError, match=r"metrics.jsonl, line 2: not a JSON record"):
        log.truncate_after(3)


def test_a_resume_removes_what_killed_writers_left_half_written(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(gone.stdout), os.getpid()
    stale = tmp_path / f".results.json.{dead}-0123abcd.tmp"  # a writer killed between its write and its rename
    busy = tmp_path / f".metrics.csv.{alive}-89abcdef.tmp"  # a writer still at work
    for path in (stale, busy, tmp_path / ".notes.tmp"):
        path.write_text("{")
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, ".notes.tmp"])
