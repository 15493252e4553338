"""benchmarks/robustness.py without running a model: the noise it picks for a target epsilon, each row's config,
and the report's verdicts computed from the rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ranking_protocol  # noqa: E402
import robustness  # noqa: E402

from zofed.fl.privacy import epsilon_spent  # noqa: E402


def test_the_noise_for_an_epsilon_spends_at_most_it_and_barely_less():
    for epsilon in (1.0, 8.0):
        noise = robustness.noise_for_epsilon(epsilon, 50, 5, 32)
        assert epsilon_spent(noise, 50, 5, 32, robustness.DELTA) <= epsilon
        assert epsilon_spent(noise / 1.02, 50, 5, 32, robustness.DELTA) > epsilon


def _row(attack, fraction, defense, accuracy, **extra):
    return {"dataset": "agnews", "row": "zofed-averaged-cached", "lr": 0.003, "attack": attack, "fraction": fraction,
            "defense": defense, "seed": 0, "final_accuracy": accuracy, **extra}


def test_the_report_judges_the_targets_from_the_rows():
    rows = [_row("none", 0.0, "mean", 0.78), _row("scale", 0.2, "mean", 0.60), _row("scale", 0.2, "clip", 0.77),
            _row("scale", 0.2, "median", 0.74), _row("sign-flip", 0.2, "mean", 0.76),
            _row("sign-flip", 0.2, "median", 0.72),
            _row("none", 0.0, "dp-8@q0.5", 0.75, dp_epsilon=7.9, dp_noise=0.8, clip_norm=1.25),
            _row("none", 0.0, "clip", 0.775), _row("none", 0.0, "median", 0.70)]
    text = "\n".join(robustness.report_lines(rows))
    assert "## agnews, zofed-averaged-cached (client lr 0.003)" in text
    assert "| attack | share | mean | clip | median |" in text  # a column for each defense that has a row
    assert "| none | 0% | 0.7800 (+0.0) | 0.7750 (-0.5) | 0.7000 (-8.0) |" in text  # a defense's own price
    assert "| scale | 20% | 0.6000 (-18.0) | 0.7700 (-1.0) | 0.7400 (-4.0) |" in text
    assert "- scale: the plain mean loses 18.0 points (loses at least 5: met); the best defense, clip, loses 1.0 " \
           "points (loses at most 2: met)" in text
    assert "- sign-flip: the plain mean loses 2.0 points (loses at least 5: missed, the attack is too weak here); " \
           "the best defense, median, loses 6.0 points (loses at most 2: missed)" in text
    # scale is the one real attack (the plain mean loses 18); clip's worst case over it and no attack is 1 point,
    # median's 8 (its own price, with no attack)
    assert "- One defense against no attack and every real attack (scale): clip, whose worst case loses 1.0 points " \
           "(loses at most 2: met); the others' worst: median loses 8.0 points" in text
    rows.append(_row("random", 0.2, "mean", 0.79))
    rows.append(_row("random", 0.2, "screen", 0.78))
    text = "\n".join(robustness.report_lines(rows))
    assert "- random: the plain mean gains 1.0 (loses at least 5: missed, the attack is too weak here); the best " \
           "defense, screen, loses nothing (loses at most 2: met)" in text
    assert "| 7.90 | 1.25 (0.5) | 0.8 | 0 | 0.7500 | -3.0 |" in text
    assert "not run yet" in "\n".join(robustness.report_lines([_row("scale", 0.2, "mean", 0.6)]))


def _tuned(row: str, lr: float, accuracy: float, seed: int = 0) -> dict:
    """A tuning row of the ranking's current protocol (benchmarks/ranking.yaml)."""
    return {"phase": "tune", "table": "head", "row": row, "dataset": "agnews", "alpha": 0.1, "seed": seed, "lr": lr,
            "final_accuracy": accuracy, "protocol": ranking_protocol.row_digest(ranking_protocol.protocol(), "head",
                                                                                 row)}


def test_each_row_runs_the_chosen_zofed_row_with_its_attack_and_defense(tmp_path, monkeypatch):
    table = {"rows": {"a": _tuned("zofed", 0.001, 0.78), "b": _tuned("zofed", 0.003, 0.83),
                      "c": {**_tuned("zofed", 0.01, 0.9), "protocol": "old"}}}  # another protocol's: ignored
    results = tmp_path / "results"
    results.mkdir()
    (results / "ranking.json").write_text(__import__("json").dumps(table))
    monkeypatch.setattr(robustness, "RESULTS", results)
    # the attacked row is zofed's as it ships (the head recipe) at the lr its tuning chose
    row = "zofed"
    config = robustness.row_config("agnews", row, "scale", 0.2, "median", 0, 1.5, tmp_path / "run")
    assert (config.attack.kind, config.attack.fraction, config.federation.aggregator) == ("scale", 0.2, "median")
    assert config.federation.method == "zofed" and config.optimizer.lr == 0.003
    assert config.trainable.label_head and config.federation.recipe == "head"
    assert config.federation.server_optimizer.name == "sgd"
    clipped = robustness.row_config("agnews", row, "stale", 0.1, "clip", 0, 1.5, tmp_path / "run")
    assert clipped.federation.clip_norm == 1.5 and clipped.federation.aggregator == "mean"
    priced = robustness.row_config("agnews", row, "none", 0.0, "trimmed-mean", 0, 1.5, tmp_path / "run")
    assert priced.attack.kind == "none" and priced.federation.aggregator == "trimmed-mean"  # a defense's own price
    private = robustness.row_config("agnews", row, "none", 0.0, "dp-3@q0.5", 0, 1.5, tmp_path / "run")
    fed = private.federation
    assert private.attack.kind == "none" and fed.clip_norm == 1.5
    assert epsilon_spent(fed.dp_noise, fed.partition.num_clients, fed.clients_per_round, fed.rounds, 1e-5) <= 3.0
    with pytest.raises(SystemExit, match="never tuned on sst5"):
        robustness.row_config("sst5", row, "none", 0.0, "mean", 0, None, tmp_path / "run")


def test_the_clip_norms_come_from_the_reference_rows_kept_quantiles_or_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(robustness, "ROOT", tmp_path)
    reference = {**_row("none", 0.0, "mean", 0.78), "run_dir": "runs/gone", "honest_norm_quantiles": {"0.9": 4.5}}
    table = {"rows": {"ref": reference}}
    assert robustness.honest_quantile(table, "ref", 0.9) == 4.5  # no run directory needed
    with pytest.raises(SystemExit, match="quantile 0.5 needs the reference run's uplink log"):
        robustness.honest_quantile(table, "ref", 0.5)


def test_cells_with_several_seeds_show_the_mean_paired_loss_and_its_spread():
    def seeded(seed, *args):
        return {**_row(*args), "seed": seed}

    rows = [seeded(0, "none", 0.0, "mean", 0.80), seeded(1, "none", 0.0, "mean", 0.70),
            seeded(0, "sign-flip", 0.2, "mean", 0.70), seeded(1, "sign-flip", 0.2, "mean", 0.66),
            seeded(0, "sign-flip", 0.2, "clip", 0.78), seeded(1, "sign-flip", 0.2, "clip", 0.69),
            seeded(2, "sign-flip", 0.2, "clip", 0.10),  # seed 2 has no reference: left out
            seeded(0, "sign-flip", 0.2, "median", 0.80)]  # better, but on one of the mean's two seeds: not judged
    text = "\n".join(robustness.report_lines(rows))
    assert "No attack, no defense: 0.8 (seed 0), 0.7 (seed 1)" in text
    # losses paired by seed: clip 2 and 1 points (mean 1.5), the mean 10 and 4 (mean 7)
    assert "| sign-flip | 20% | 0.6800 (-7.0, ±4.2 over 2 seeds) | 0.7350 (-1.5, ±0.7 over 2 seeds) |" in text
    assert "- sign-flip: the plain mean loses 7.0 points, ±4.2 over 2 seeds (loses at least 5: met); the best " \
           "defense, clip, loses 1.5 points, ±0.7 over 2 seeds (loses at most 2: met); not judged, run on fewer " \
           "of the mean's seeds: median" in text


def test_seed_grinding_is_an_attack_row_and_the_report_says_why_its_uplinks_were_refused(tmp_path, monkeypatch):
    assert "seed-grind" in robustness.ATTACKS
    rows = [_row("none", 0.0, "mean", 0.78), _row("seed-grind", 0.2, "mean", 0.77, refused_for={"seeds": 40}),
            _row("seed-grind", 0.2, "clip", 0.77, refused_for={"seeds": 40, "screened": 2}),
            _row("seed-grind", 0.1, "mean", 0.78)]  # a row from before the reasons were kept: no line
    text = "\n".join(robustness.report_lines(rows))
    assert "| seed-grind | 20% | 0.7700 (-1.0) | 0.7700 (-1.0) |" in text
    assert "- seed-grind at 20% under clip (seed 0): uplinks refused 2 for screened, 40 for seeds" in text
    assert "- seed-grind at 20% under mean (seed 0): uplinks refused 40 for seeds" in text
    assert "seed-grind at 10%" not in text
    results = tmp_path / "results"
    results.mkdir()
    (results / "ranking.json").write_text(__import__("json").dumps({"rows": {"a": _tuned("zofed", 0.001, 0.78)}}))
    monkeypatch.setattr(robustness, "RESULTS", results)
    config = robustness.row_config("agnews", "zofed", "seed-grind", 0.2, "mean", 0, 1.5, tmp_path / "run")
    assert (config.attack.kind, config.attack.fraction) == ("seed-grind", 0.2)
