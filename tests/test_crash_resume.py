"""Crash safety with real processes: a `zofed run` killed with SIGKILL twenty times, at random moments and
during checkpoint writes and log appends, and resumed each time, ends with the uninterrupted run's model bit for
bit; after every kill the run directory is usable (a complete checkpoint or none, a readable log)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config

from zofed.run.checkpoint import find_checkpoint, load_checkpoint
from zofed.run.config import load_config
from zofed.run.federated_config import FederatedConfig
from zofed.run.replay import replay_run
from zofed.run.stored_config import dump_config
from zofed.run.uplink_log import LOG_NAME, read_log

KILLS = 20
ROUNDS = 40


def _start(config: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every process: the same float sums
    return subprocess.Popen([sys.executable, "-m", "zofed.cli", "run", str(config), "--out", str(out), "--resume"],
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
        _, rounds, _ = read_log(out / LOG_NAME) if _lines(out / LOG_NAME) else ({}, [], "")
        assert len(rounds) >= round_done  # a round is logged before its checkpoint, never after
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
    assert progress[-1] > 0 and progress == sorted(progress), progress  # resumes never go backwards
    finish = _start(config, out)
    assert finish.wait() == 0, finish.stderr.read().decode()[-2000:]
    got, want = load_file(out / "final/trainable.safetensors"), load_file(reference / "final/trainable.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert replay_run(out).matches  # the log of a run resumed twenty times replays to its model
