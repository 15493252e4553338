"""The uplink log and `zofed replay`: a federated run's final model rebuilt from its log alone, bit for bit, a
changed log caught, and a resumed run's log cut back to its checkpoint."""

import hashlib
import json

import pytest
import torch
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.config import ConfigError
from zofed.run.federated import run_federated
from zofed.run.replay import agreement, replay_run
from zofed.run.stored_config import dump_config
from zofed.run.uplink_log import LOG_NAME, LogError, read_log


def test_a_run_replays_from_its_log_bit_for_bit(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    results = run_federated(tiny_federated_config(tiny_workspace, out), show_progress=False)  # zofed, 3 rounds
    header, rounds, head = read_log(out / LOG_NAME)
    assert header["num_clients"] == 4 and [r.round for r in rounds] == [1, 2, 3]
    assert all(len(r.uplinks) == 2 and not r.rejected for r in rounds)
    assert results["uplink_log_head"] == head
    shown = CliRunner().invoke(app, ["replay", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "replayed 3 rounds, 6 uplinks" in shown.output and "bit for bit" in shown.output
    assert head in shown.output.replace("\n", "")
    traced = replay_run(out, trace=True)
    assert traced.matches and [r.round for r in traced.trace] == [1, 2, 3]
    steps = [r.step for r in traced.trace]
    assert min(steps) > 0 and traced.trace[0].distance == pytest.approx(steps[0])
    assert all(r.distance <= sum(steps[:i + 1]) * (1 + 1e-9) for i, r in enumerate(traced.trace))  # the triangle
    last = traced.trace[-1]
    assert last.largest_rms > last.largest_start_rms
    assert replay_run(out).trace == ()  # no trace unless asked: the check alone copies nothing
    # (None where every update was zero: a step that drew a LoRA A while its B is still 0 changes no loss)
    agreed = [r.agreement for r in traced.trace if r.agreement is not None]
    assert agreed and all(-1 <= a <= 1 for a in agreed)
    shown = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["replay", str(out), "--trace"])
    assert shown.exit_code == 0 and "grown the most" in shown.output and last.largest in shown.output
    assert "clients agree" in shown.output and f"{agreed[-1]:+.3f}" in shown.output


def test_agreement_is_the_shared_inner_product_over_the_own_squared_length():
    a, b = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])
    assert agreement([[a], [a]]) == pytest.approx(1.0) and agreement([[a], [-a]]) == pytest.approx(-1.0)
    assert agreement([[a], [b]]) == 0.0 and agreement([[a]]) is None and agreement([[0 * a], [0 * a]]) is None
    assert agreement([[a], [2 * a]]) == pytest.approx(2 / 2.5)  # <a, 2a> over the mean of |a|^2 and |2a|^2
    assert agreement([[a, b], [a, -b], [a, b]]) == pytest.approx((5 - 9 + 14 - 9 + 5) / 3 / 14)  # tensors joined


def test_a_changed_log_is_caught(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds"), show_progress=False)
    lines = (out / LOG_NAME).read_text().splitlines()
    record = json.loads(lines[1])
    record["uplinks"] = record["uplinks"][:1]  # the server drops one client's round from the record
    (out / LOG_NAME).write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    with pytest.raises(LogError, match=r"line 3 \(round 2\): its hash link does not match line 2"):
        replay_run(out)
    # the same change in the last round breaks no link, but the replayed model is no longer the final one
    record = json.loads(lines[3])
    record["uplinks"] = record["uplinks"][:1]
    (out / LOG_NAME).write_text("\n".join([*lines[:3], json.dumps(record, sort_keys=True,
                                                                    separators=(",", ":"))]) + "\n")
    done = replay_run(out)
    assert not done.matches and done.max_abs_difference > 0
    shown = CliRunner().invoke(app, ["replay", str(out)])
    assert shown.exit_code == 2 and "does not describe this model" in shown.output
    (out / LOG_NAME).unlink()
    with pytest.raises(LogError, match="has no uplink log"):
        replay_run(out)
    unlogged = tmp_path / "unlogged"
    config = tiny_federated_config(tiny_workspace, unlogged, "federation.rounds=1", "federation.log_uplinks=false")
    run_federated(config, show_progress=False)
    assert not (unlogged / LOG_NAME).exists()
    partly = tmp_path / "partly"  # logged for one round, then resumed with the log off for two more
    run_federated(tiny_federated_config(tiny_workspace, partly, "federation.rounds=1"), show_progress=False)
    config = tiny_federated_config(tiny_workspace, partly, "federation.rounds=3", "federation.log_uplinks=false")
    run_federated(config, resume=True, show_progress=False)
    with pytest.raises(LogError, match="the uplink log holds 1 rounds and the run 3"):
        replay_run(partly)


def test_a_resumed_run_cuts_its_log_back_to_the_checkpoint_and_replays(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    run_federated(tiny_federated_config(tiny_workspace, out, "federation.rounds=1", "federation.aggregator=median",
                                        "federation.clip_norm=0.5", "attack.kind=scale", "attack.fraction=0.25"),
                  show_progress=False)
    with (out / LOG_NAME).open("a") as f:  # a round logged by a sitting that crashed before its checkpoint
        f.write('{"round": 2, "prev": "x", "uplinks": [], "rejected": []}\n')
    run_federated(tiny_federated_config(tiny_workspace, out, "federation.rounds=3", "federation.aggregator=median",
                                        "federation.clip_norm=0.5", "attack.kind=scale", "attack.fraction=0.25"),
                  resume=True, show_progress=False)
    _, rounds, _ = read_log(out / LOG_NAME)
    assert [r.round for r in rounds] == [1, 2, 3]
    done = replay_run(out)  # the server's settings (median, clipping) are the logged config's
    assert done.matches and done.rounds == 3


def test_steps_relative_to_the_start_resume_and_replay_bit_for_bit(tiny_workspace, tmp_path):
    """The starting RMS a `relative_to=start` step is measured against lives in the optimizer's state: a run
    resumed from its checkpoint keeps it, and the replay rebuilds it from the starting tensors alone."""
    # a server lr large enough that LoRA's B outgrows the floor (its A's starting RMS) within the run
    out, lr = tmp_path / "run", "federation.server_optimizer.lr=2"
    start = "federation.server_optimizer.relative_to=start"
    run_federated(tiny_federated_config(tiny_workspace, out, start, lr, "federation.rounds=1"), show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, out, start, lr), resume=True, show_progress=False)
    straight = tmp_path / "straight"
    run_federated(tiny_federated_config(tiny_workspace, straight, start, lr), show_progress=False)
    assert (out / "final" / "trainable.safetensors").read_bytes() == \
        (straight / "final" / "trainable.safetensors").read_bytes()
    assert replay_run(out).matches
    current = tmp_path / "current"  # the same run measured against the current RMS ends elsewhere
    run_federated(tiny_federated_config(tiny_workspace, current, lr), show_progress=False)
    assert (current / "final" / "trainable.safetensors").read_bytes() != \
        (straight / "final" / "trainable.safetensors").read_bytes()


def test_the_log_head_printed_by_zofed_run_anchors_the_replay(tiny_workspace, tmp_path):
    """The hash chain alone can be rewritten by whoever edits the run directory; the head `zofed run` prints, kept
    elsewhere, cannot: `zofed replay --expect` fails, naming both hashes, on a log rewritten to a valid chain."""
    out, config = tmp_path / "run", tmp_path / "run.yaml"
    dump_config(tiny_federated_config(tiny_workspace, out, "federation.method=zo-seeds"), config)
    runner = CliRunner(env={"COLUMNS": "80"})
    shown = runner.invoke(app, ["run", str(config)])
    assert shown.exit_code == 0, shown.output
    head = json.loads((out / "results.json").read_text())["uplink_log_head"]
    assert head == read_log(out / LOG_NAME)[2] and f"uplink log head: {head}\n" in shown.output
    for expect in (head, head[:32].upper()):  # the full hash, or a prefix of 32 hex digits
        shown = runner.invoke(app, ["replay", str(out), "--expect", expect])
        assert shown.exit_code == 0 and "ends in the expected head" in shown.output, shown.output
    # a forger drops a client from round 2 and rewrites every later link: the chain checks, the head moved
    lines = (out / LOG_NAME).read_text().splitlines()
    rewritten = [lines[0], lines[1]]
    for number, line in enumerate(lines[2:], start=2):
        record = json.loads(line)
        record["prev"] = hashlib.sha256(rewritten[-1].encode()).hexdigest()
        if number == 2:
            record["uplinks"] = record["uplinks"][:1]
        rewritten.append(json.dumps(record, sort_keys=True, separators=(",", ":")))
    (out / LOG_NAME).write_text("\n".join(rewritten) + "\n")
    forged = read_log(out / LOG_NAME)[2]
    shown = runner.invoke(app, ["replay", str(out), "--expect", head])
    assert shown.exit_code == 2
    failure = " ".join(shown.output.split())  # one message, however the terminal wraps it
    assert f"has head {forged}, not the expected {head}" in failure
    shown = runner.invoke(app, ["replay", str(out), "--expect", head[:12]])
    assert shown.exit_code == 2 and "at least 32" in shown.output
    shown = runner.invoke(app, ["replay", str(out), "--expect", "not-a-hash"])
    assert shown.exit_code == 2 and "not a SHA-256 hash" in shown.output


def test_a_resume_refuses_a_log_shorter_than_its_checkpoint(tiny_workspace, tmp_path):
    """A log cut or deleted after its rounds were written is not silently dropped: the resume stops, saying how to
    go on without it."""
    out = tmp_path / "run"
    run_federated(tiny_federated_config(tiny_workspace, out, "federation.rounds=2"), show_progress=False)
    lines = (out / LOG_NAME).read_text().splitlines()
    (out / LOG_NAME).write_text("\n".join(lines[:2]) + "\n")  # the header and round 1 of 2
    with pytest.raises(ConfigError, match=r"uplinks.jsonl holds 1 of the 2 rounds the checkpoint holds.*"
                                          r"federation.log_uplinks=false"):
        run_federated(tiny_federated_config(tiny_workspace, out), resume=True, show_progress=False)
    assert (out / LOG_NAME).read_text().splitlines() == lines[:2]  # left as found
    (out / LOG_NAME).unlink()
    with pytest.raises(ConfigError, match="uplinks.jsonl is missing or empty and holds none of the 2 rounds"):
        run_federated(tiny_federated_config(tiny_workspace, out), resume=True, show_progress=False)
    (out / LOG_NAME).write_text("\n".join([lines[0], lines[1].replace('"round":1', '"round":7'), lines[2]]) + "\n")
    with pytest.raises(ConfigError, match="line 2"):  # the rounds it keeps must check, too
        run_federated(tiny_federated_config(tiny_workspace, out, "federation.rounds=2"), resume=True,
                      show_progress=False)
    results = run_federated(tiny_federated_config(tiny_workspace, out, "federation.log_uplinks=false"),
                            resume=True, show_progress=False)  # the way on, said out loud
    assert results["rounds"] == 3 and results["uplink_log_head"] is None
