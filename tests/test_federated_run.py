"""`zofed run`: a federated run on the in-process engine, its run directory, resume, and config errors."""

import csv
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.data.partition import ClientSplit
from zofed.run.config import ConfigError
from zofed.run.federated import client_eval_indices, run_federated, worst_decile_mean
from zofed.run.federated_config import ServerOptimizerSection
from zofed.run.report import load_run_summary
from zofed.run.stored_config import dump_config

_config = tiny_federated_config


def test_run_writes_round_metrics_csv_partition_and_results(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    results = run_federated(_config(tiny_workspace, out, "federation.client_eval_examples=2"), show_progress=False)
    start, *rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (start["event"], start["round"]) == ("eval", 0)  # the starting model, before any round
    assert [r["event"] for r in rounds] == ["round"] * 3 and [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["accepted"] == 2 and 0 < r["bytes_up_per_client"] < 400 for r in rounds)
    assert all("eval_accuracy" in r and r["peak_rss_mib"] > 0 for r in rounds)
    assert results["eval_accuracy_start"] == start["eval_accuracy"]
    assert results["eval_accuracy_final"] == rounds[-1]["eval_accuracy"]
    with (out / "metrics.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (out / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(json.loads((out / "partition.json").read_text())["clients"]) == 4
    assert 0.0 <= results["client_accuracy_worst10"] <= results["client_accuracy_mean"] <= 1.0
    clients = json.loads((out / "partition.json").read_text())["clients"]
    assert results["client_test_examples"] == sum(min(2, len(c["test"])) for c in clients) < sum(
        len(c["test"]) for c in clients)
    assert all(round(2 * a, 6) == int(2 * a) for a in results["client_accuracies"])  # at most 2 examples each
    assert results["bytes_down_per_client_round"] > results["bytes_up_per_client_round"]
    assert results["forward_passes"] == 3 * 2 * 2 * 2


def test_resumed_federated_run_ends_bit_identical(tiny_workspace, tmp_path):
    run_federated(_config(tiny_workspace, tmp_path / "whole"), show_progress=False)
    # A first sitting that died before its first checkpoint left a record behind: a fresh start drops it.
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "metrics.jsonl").write_text(json.dumps({"step": 1, "event": "round_failed"}) + "\n")
    run_federated(_config(tiny_workspace, tmp_path / "split", "federation.rounds=2"), show_progress=False)
    run_federated(_config(tiny_workspace, tmp_path / "split"), resume=True, show_progress=False)
    whole = load_file(str(tmp_path / "whole" / "final" / "trainable.safetensors"))
    split = load_file(str(tmp_path / "split" / "final" / "trainable.safetensors"))
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    logs = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("whole", "split")}
    assert [(r["event"], r["round"]) for r in logs["split"]] == [("eval", 0), *(("round", k) for k in (1, 2, 3))]
    assert logs["split"][0] == logs["whole"][0]  # the resumed sitting did not evaluate the start again


def test_a_run_with_local_zo_adam_resumes_bit_identical_and_differs_from_mezo(tiny_workspace, tmp_path):
    adam = ("optimizer.name=zo-adam", "optimizer.lr=0.005")
    run_federated(_config(tiny_workspace, tmp_path / "whole", *adam), show_progress=False)
    run_federated(_config(tiny_workspace, tmp_path / "split", *adam, "federation.rounds=2"), show_progress=False)
    run_federated(_config(tiny_workspace, tmp_path / "split", *adam), resume=True, show_progress=False)
    run_federated(_config(tiny_workspace, tmp_path / "mezo", "optimizer.lr=0.005"), show_progress=False)
    final = {name: load_file(str(tmp_path / name / "final" / "trainable.safetensors"))
             for name in ("whole", "split", "mezo")}
    assert all(torch.equal(final["whole"][k], final["split"][k]) for k in final["whole"])
    assert any(not torch.equal(final["whole"][k], final["mezo"][k]) for k in final["whole"])
    rounds = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["accepted"] == 2 and r["aggregate_seconds"] >= 0 for r in rounds)


def test_resume_refuses_a_run_made_with_another_config(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    run_federated(_config(tiny_workspace, out, "federation.rounds=1"), show_progress=False)
    before = (out / "final" / "trainable.safetensors").read_bytes()
    with pytest.raises(ConfigError, match=r"federation.method \('zofed' -> 'zo-seeds'\)"):
        run_federated(_config(tiny_workspace, out, "federation.method=zo-seeds"), resume=True, show_progress=False)
    assert (out / "final" / "trainable.safetensors").read_bytes() == before
    assert "method: zofed" in (out / "config.yaml").read_text()  # the stored config is left as it was


def test_resume_compares_the_server_optimizer_as_it_will_run(tiny_workspace, tmp_path):
    """The stored config spells out the method's defaults (`relative: false` for zo-seeds' sgd), and a new config
    that leaves them unset continues it, as does a config stored unpinned; a setting that really changes the run
    is refused, and so is a method default that changed since the run was stored."""
    out = tmp_path / "run"
    run_federated(_config(tiny_workspace, out, "federation.method=zo-seeds", "federation.rounds=1"),
                  show_progress=False)
    stored = (out / "config.yaml").read_text()
    assert "relative: false" in stored and "name: sgd" in stored
    (out / "config.yaml").write_text(stored.replace("relative: false", "relative: null"))
    results = run_federated(_config(tiny_workspace, out, "federation.method=zo-seeds", "federation.rounds=2"),
                            resume=True, show_progress=False)
    assert results["rounds"] == 2
    # zofed's run stored under an older default (one second moment per tensor) is not resumed under today's
    zofed = tmp_path / "zofed"
    run_federated(_config(tiny_workspace, zofed, "federation.rounds=1"), show_progress=False)
    text = (zofed / "config.yaml").read_text()
    assert "granularity: global" in text
    (zofed / "config.yaml").write_text(text.replace("granularity: global", "granularity: tensor"))
    with pytest.raises(ConfigError, match=r"granularity \('tensor' -> 'global'\)"):
        run_federated(_config(tiny_workspace, zofed, "federation.rounds=2"), resume=True, show_progress=False)
    with pytest.raises(ConfigError, match=r"federation.server_optimizer.lr \(1.0 -> 0.5\)"):
        run_federated(_config(tiny_workspace, out, "federation.method=zo-seeds", "federation.rounds=3",
                              "federation.server_optimizer.lr=0.5"), resume=True, show_progress=False)
    with pytest.raises(ConfigError, match="federation.server_optimizer: relative steps need an adaptive"):
        run_federated(_config(tiny_workspace, out, "federation.method=zo-seeds", "federation.rounds=3",
                              "federation.server_optimizer.relative=true"), resume=True, show_progress=False)


def test_federated_config_errors(tiny_workspace, tmp_path):
    with pytest.raises(ConfigError, match="federation.method"):
        _config(tiny_workspace, tmp_path, "federation.method=fedsomething")
    with pytest.raises(ConfigError, match="federation.partition.alpha"):
        _config(tiny_workspace, tmp_path, "federation.partition.alpha=0")
    with pytest.raises(ConfigError, match="mezo, zo-sgd-momentum, zo-adam locally .*'sparse-mezo' is not supported"):
        run_federated(_config(tiny_workspace, tmp_path / "r", "optimizer.name=sparse-mezo"), show_progress=False)
    with pytest.raises(ConfigError, match="warm start needs a tensor-wise adaptive"):
        run_federated(_config(tiny_workspace, tmp_path / "w", "federation.method=zo-seeds",
                              "federation.server_optimizer.warm_start=true"), show_progress=False)
    with pytest.raises(ConfigError, match="relative steps need an adaptive"):
        run_federated(_config(tiny_workspace, tmp_path / "rel", "federation.method=zo-seeds",
                              "federation.server_optimizer.relative=true"), show_progress=False)


def test_cli_run_and_a_partition_that_cannot_be_made(tiny_workspace, tmp_path):
    path = tmp_path / "fed.yaml"
    dump_config(_config(tiny_workspace, tmp_path / "cli", "federation.rounds=1"), path)
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert "client_accuracy_mean" in result.output
    bad = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "bad"),
                              "--set", "federation.partition.num_clients=150"])
    assert bad.exit_code == 2 and "client" in bad.output


def test_worst_decile_mean():
    assert worst_decile_mean([0.9] * 18 + [0.1, 0.3]) == pytest.approx(0.2)
    assert worst_decile_mean([0.5]) == 0.5


def test_report_compares_runs_with_plots_and_a_table(tiny_workspace, tmp_path):
    for method in ("zo-seeds", "fedmezo"):
        run_federated(_config(tiny_workspace, tmp_path / method, "federation.rounds=2", f"federation.method={method}"),
                      show_progress=False)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "zo-seeds"), str(tmp_path / "fedmezo"),
                                      "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report" / "report.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "report" / "report.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| zo-seeds") or line.startswith("| fedmezo")]
    assert len(rows) == 2
    up = {row.split("|")[1].strip(): float(row.split("|")[7].replace(",", "")) for row in rows}
    assert up["fedmezo"] > 10 * up["zo-seeds"]  # dense uploads cost far more than seeds and scalars
    summary = load_run_summary(tmp_path / "zo-seeds")  # the curves start from the starting model, no bytes sent
    assert summary.rounds == [0, 1, 2] and summary.cumulative_up[0] == 0.0 < summary.cumulative_up[1]
    bad = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "not a finished zofed run" in " ".join(bad.output.split())


def test_first_order_methods_name_their_server_optimizer(tiny_workspace, tmp_path):
    with pytest.raises(ConfigError, match="federation.server_optimizer.name=adam"):
        run_federated(_config(tiny_workspace, tmp_path / "r", "federation.method=fedadam",
                              "federation.server_optimizer.name=sgd"), show_progress=False)
    results = run_federated(_config(tiny_workspace, tmp_path / "a", "federation.method=fedadam",
                                    "federation.server_optimizer.lr=0.01", "federation.rounds=1"), show_progress=False)
    assert results["method"] == "fedadam" and results["bytes_up_per_client_round"] > 1000


def test_zofed_defaults_to_relative_global_adam_and_other_choices_do_not_inherit_it():
    """zofed's server step is relative by default; an optimizer the user names instead takes its own absolute lr,
    and an explicit relative=false wins."""
    zofed = ServerOptimizerSection().resolved("zofed", 10)
    assert (zofed["name"], zofed["granularity"], zofed["relative"], zofed["lr"]) == ("adam", "global", True, 1e-2)
    assert [type(p).__name__ for p in ServerOptimizerSection().build("zofed", 10).pieces] == [
        "Moments", "TrustRatio", "Schedule"]
    yogi = ServerOptimizerSection(name="yogi").resolved("zofed", 10)
    assert not yogi["relative"] and yogi["lr"] == 3e-3
    absolute = ServerOptimizerSection(relative=False).resolved("zofed", 10)
    assert not absolute["relative"] and absolute["lr"] == 3e-3
    assert not ServerOptimizerSection().resolved("zo-seeds", 10)["relative"]
    assert not ServerOptimizerSection().resolved("fedadam", 10)["relative"]
    assert ServerOptimizerSection().resolved("zofed", 10)["decay_rounds"] == 0
    assert ServerOptimizerSection(decay="cosine").build("zofed", 10).lr_at(10) == 0.0
    ramp = ServerOptimizerSection(beta1_start=0.5).resolved("zofed", 10)
    assert (ramp["beta1_start"], ramp["ramp_rounds"]) == (0.5, 10)  # the ramp spans the run, as a cosine does
    with pytest.raises(ConfigError, match="beta1 ramp needs an adaptive"):
        ServerOptimizerSection(beta1_start=0.5).build("zo-seeds", 10)
    assert "relative_to" not in zofed  # the default leaves the settings of earlier runs as they were
    assert ServerOptimizerSection(relative_to="start").resolved("zofed", 10)["relative_to"] == "start"
    with pytest.raises(ConfigError, match="federation.server_optimizer: relative_to start .* needs relative steps"):
        ServerOptimizerSection(relative_to="start").build("zo-seeds", 10)


def test_a_cosine_server_step_cannot_be_stretched_over_more_rounds_on_resume(tiny_workspace, tmp_path):
    """The cosine schedule spans the run's rounds, so a resume that adds rounds would change every step after
    it: refused with the setting named (a constant step may resume over more rounds, tested above)."""
    out = tmp_path / "run"
    run_federated(_config(tiny_workspace, out, "federation.rounds=1", "federation.server_optimizer.decay=cosine"),
                  show_progress=False)
    with pytest.raises(ConfigError, match=r"federation.server_optimizer.decay_rounds \(1 -> 2\)"):
        run_federated(_config(tiny_workspace, out, "federation.rounds=2", "federation.server_optimizer.decay=cosine"),
                      resume=True, show_progress=False)


def test_a_federated_causal_lm_run_finishes_and_scores_each_client_by_its_loss(tiny_workspace, tmp_path):
    """A causal-LM task reports a loss, not an accuracy: the per-client evaluation after training read
    `accuracy` and crashed."""
    out = tmp_path / "lm"
    results = run_federated(_config(tiny_workspace, out, "task.type=causal-lm", "federation.method=zo-seeds"),
                            show_progress=False)
    assert results["client_metric"] == "loss" and "accuracy" not in results["test"]
    assert len(results["client_losses"]) == 4 and all(np.isfinite(results["client_losses"]))
    assert results["client_loss_worst10"] == max(results["client_losses"])  # the worst tenth of 4 is the highest
    assert results["eval_loss_start"] is not None and results["eval_loss_final"] is not None


@pytest.mark.parametrize(("method", "per_step"), [("zo-seeds", 2), ("fedavg", 3), ("fedmezo", 4)])
def test_client_compute_is_counted_in_full_forward_passes_for_every_method(tiny_workspace, tmp_path, method,
                                                                           per_step):
    """Two forwards per ZO query and step (fedmezo here with 2 queries), a forward plus a backward worth two per
    back-propagated step: FedAvg rows used to report the ZO count."""
    extra = ["zo.queries=2"] if method == "fedmezo" else []
    results = run_federated(_config(tiny_workspace, tmp_path / method, f"federation.method={method}", *extra),
                            show_progress=False)
    rounds, clients, steps = 3, 2, 2
    assert results["forward_passes_per_client_round"] == per_step * steps
    assert results["forward_passes"] == per_step * steps * clients * rounds


def test_sampling_settings_are_refused_for_methods_that_do_not_read_them(tiny_workspace, tmp_path):
    """federation.sampling.* shapes zofed's personalized sampling only: set for another method it would be
    silently ignored, so it is an error naming the key; its default (as a dumped config holds it) is fine."""
    with pytest.raises(ConfigError, match="sampling.blocks is a setting of zofed's personalized sampling"):
        _config(tiny_workspace, tmp_path, "federation.method=decomfl", "federation.sampling.blocks=2")
    assert _config(tiny_workspace, tmp_path, "federation.method=decomfl",
                   "federation.sampling.mix=0.3").federation.sampling.mix == 0.3
    assert _config(tiny_workspace, tmp_path, "federation.sampling.blocks=2").federation.sampling.blocks == 2
    with pytest.raises(ConfigError, match="unknown aggregator 'krum'"):
        _config(tiny_workspace, tmp_path, "federation.aggregator=krum")
    with pytest.raises(ConfigError, match="federation.trim is a setting of the trimmed-mean aggregator, not of mean"):
        _config(tiny_workspace, tmp_path, "federation.trim=0.2")


def test_a_run_with_float16_scalars_sends_fewer_bytes_replays_its_log_and_refuses_other_widths(tiny_workspace,
                                                                                                tmp_path):
    from zofed.run.replay import replay_run

    full = run_federated(_config(tiny_workspace, tmp_path / "full", "zo.queries=4"), show_progress=False)
    half = run_federated(_config(tiny_workspace, tmp_path / "half", "zo.queries=4", "federation.scalar_bits=16"),
                         show_progress=False)
    # 2 local steps of 4 queries: 8 scalars at 2 bytes instead of 4 (the loss's digits move the header a little)
    assert 14 <= full["bytes_up_per_client_round"] - half["bytes_up_per_client_round"] <= 18
    assert replay_run(tmp_path / "half").matches  # a third party rebuilds the model from the float16 log alone
    with pytest.raises(ConfigError, match="federation.scalar_bits"):
        _config(tiny_workspace, tmp_path, "federation.scalar_bits=8")


def test_client_evaluation_reads_a_seeded_sample_of_at_most_the_cap():
    split = ClientSplit(client_id=3, train=np.arange(10), test=np.arange(100, 400, 3))
    sample = client_eval_indices(split, 20, seed=0)
    assert len(sample) == 20 and len(set(sample.tolist())) == 20 and set(sample) <= set(split.test)
    assert np.all(np.diff(sample) > 0)  # sorted, like the split
    assert np.array_equal(sample, client_eval_indices(split, 20, seed=0))  # the same examples every time
    assert not np.array_equal(sample, client_eval_indices(split, 20, seed=1))
    other = ClientSplit(client_id=4, train=split.train, test=split.test)
    assert not np.array_equal(sample, client_eval_indices(other, 20, seed=0))  # each client its own draw
    assert client_eval_indices(split, None, seed=0) is split.test
    assert client_eval_indices(split, 100, seed=0) is split.test  # a split within the cap is read whole


def test_a_run_logged_to_a_file_prints_a_line_per_evaluated_round_and_the_last(tiny_workspace, tmp_path):
    log = io.StringIO()  # not a terminal: no bar can be drawn, as under nohup or in CI
    run_federated(_config(tiny_workspace, tmp_path / "run", "federation.eval_every=2"),
                  console=Console(file=log, width=200))
    lines = [line for line in log.getvalue().splitlines() if line.startswith("round ")]
    assert [line.split(" | ")[0] for line in lines] == ["round 2/3", "round 3/3"]
    assert "eval acc" in lines[0] and "loss" in lines[1]


def test_a_stop_ends_the_run_after_a_round_and_a_resume_of_the_stopped_run_stops_at_once(tiny_workspace, tmp_path):
    asked = []

    def at_round_two(record: dict) -> bool:
        asked.append(record["round"])
        return record["round"] == 2

    config = _config(tiny_workspace, tmp_path / "run", "federation.rounds=5")
    results = run_federated(config, show_progress=False, stop=at_round_two)
    assert asked == [1, 2] and results["rounds"] == 2 and results["stopped_early"]
    rounds = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["round"] for r in rounds] == [1, 2]
    stopped = load_file(str(tmp_path / "run" / "final" / "trainable.safetensors"))
    # the same run without a stop, cut at round 2 by its rounds, ends with the same tensors
    whole = run_federated(_config(tiny_workspace, tmp_path / "two", "federation.rounds=2"), show_progress=False)
    assert not whole["stopped_early"]
    two = load_file(str(tmp_path / "two" / "final" / "trainable.safetensors"))
    assert all(torch.equal(stopped[k], two[k]) for k in two)
    # resumed, it asks the stop of its checkpoint's round and trains no further
    again = run_federated(config, resume=True, show_progress=False, stop=at_round_two)
    assert asked == [1, 2, 2] and again["rounds"] == 2
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    # without the stop the resume goes on to the configured rounds
    assert run_federated(config, resume=True, show_progress=False)["rounds"] == 5
