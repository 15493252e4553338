"""The ranking benchmark's protocol (benchmarks/ranking.yaml) and report, without running a model: zofed's row is
`zofed run` as it ships, every row spends at most the budget, and every sentence of the report follows the rows."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ranking_calibration as calibration  # noqa: E402
import ranking_protocol as protocol  # noqa: E402
import ranking_report as report  # noqa: E402

from zofed.run.stored_config import flatten  # noqa: E402

P = protocol.protocol()
# what the runner sets on every row, zofed's included: the lr, the rounds the budget buys, the curve's cadence,
# the evaluated split, the seed, the output and the body-feature store the simulator reads
RUNNER_KEYS = {"optimizer.lr", "federation.rounds", "federation.eval_every", "data.evaluate_on", "train.seed",
               "federation.partition.seed", "federation.partition.alpha", "out_dir"}


def _run_config(table: str, row: str, tmp_path: Path, phase: str = "tune"):
    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig

    overrides = protocol.run_overrides(P, phase, table, row, "agnews", 0.1, 0, 3e-3, tmp_path)
    return load_config(None, overrides, schema=FederatedConfig)


def test_the_protocol_file_holds_at_most_ten_rows_a_table_on_the_named_datasets():
    assert set(P.tables) == {"head", "top4", "top4-lora"}
    assert all(len(t.rows) <= 10 for t in P.tables.values())
    assert list(P.tables["head"].rows) == ["zero-shot", "zofed", "hiso", "decomfl", "fedkseed", "zo-seeds-plain",
                                           "fedavg-head", "fedavg-lora"]
    assert len(P.seeds.tune) >= 3 and P.datasets == ["sst2", "agnews", "sst5"]


def test_zofed_row_is_zofed_run_with_nothing_but_the_shape_and_the_runner_keys(tmp_path):
    from calibrate import TASKS

    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig

    for table in P.tables:
        row = flatten(_run_config(table, "zofed", tmp_path).model_dump())
        trainable = P.tables[table].trainable if P.tables[table].rows["zofed"].trainable == "table" else []
        named = ["federation.recipe=head"] if table == "head" else []  # the head table: the recipe by its name
        plain = load_config(None, [*protocol.shape_overrides(P), *TASKS["agnews"], "data.source=shared:agnews",
                                   *trainable, *named], schema=FederatedConfig)
        differ = {k for k, v in flatten(plain.model_dump()).items() if row[k] != v}
        tuned = protocol.lr_key(P, table, "zofed")  # its clients' lr, or the server lr that sets its step
        assert differ <= RUNNER_KEYS | {tuned}, (table, differ - RUNNER_KEYS)
        assert tuned in differ and "federation.rounds" in differ  # the runner does set them
        # on the model's weights zofed's adaptive server normalizes the update: its step is tuned there
        assert tuned == ("optimizer.lr" if table == "head" else "federation.server_optimizer.lr"), table
    assert _run_config("head", "zofed", tmp_path).federation.recipe == "head"  # `zofed run`'s head recipe
    assert _run_config("top4", "zofed", tmp_path).federation.recipe == "none"  # trainable.mode set: schema defaults


def test_the_head_baselines_differ_from_zofed_only_in_the_method(tmp_path):
    zofed = flatten(_run_config("head", "zofed", tmp_path).model_dump())
    for row in ("hiso", "decomfl", "fedkseed"):
        other = flatten(_run_config("head", row, tmp_path).model_dump())
        # pool 64 is the default; the rounds follow from each method's own cost (HiSo's central queries cost more)
        assert {k for k in zofed if zofed[k] != other[k]} <= {"federation.method", "federation.rounds",
                                                               "federation.eval_every"}, row
        assert zofed["federation.method"] != other["federation.method"]
    # and every recipe row trains the table's set
    for row, spec in P.tables["head"].rows.items():
        if spec.trainable == "recipe" and spec.method != "fedavg":
            trainable = _run_config("head", row, tmp_path).trainable
            assert (trainable.mode, trainable.label_head) == ("none", True), row


def test_an_ablation_is_zofed_with_one_component_off_and_is_never_the_judged_row(tmp_path):
    for table in ("top4", "top4-lora"):
        zofed = flatten(_run_config(table, "zofed", tmp_path).model_dump())
        for row, keys in {"zofed-no-sampling": {"federation.sampling.personalize"},
                          # plain averaging steps by its clients' lr: that is what it is tuned on
                          "zofed-plain-server": {"federation.server_optimizer.name",
                                                 "federation.server_optimizer.lr", "optimizer.lr"}}.items():
            other = flatten(_run_config(table, row, tmp_path).model_dump())
            assert {k for k in zofed if zofed[k] != other[k]} - {"federation.rounds", "federation.eval_every"} \
                == keys, (table, row)
            assert report.kind_of(P, table, row) == "ablation"
        assert report.kind_of(P, table, "zofed") == "zofed"


def test_fedavg_on_the_head_runs_the_same_engine_first_order(tmp_path):
    try:
        config = _run_config("head", "fedavg-head", tmp_path)
        cost = protocol.per_client_round_cost("head", "fedavg-head", "agnews")
    except ValueError as err:  # ConfigError and pydantic's ValidationError among them
        pytest.skip(f"first-order FedAvg on the cached head features does not validate yet: {err}")
    fed = config.federation
    assert (fed.method, fed.first_order_optimizer, config.feature_cache(), config.trainable.label_head) == \
           ("fedavg", "sgd", 8, True)
    assert fed.first_order_lr == 3e-3 and cost > 0  # the grid's lr goes to the first-order key


def test_every_row_spends_at_most_the_budget_and_a_round_less_than_it():
    varying = []
    for table, t in P.tables.items():
        for row, spec in t.rows.items():
            cost = protocol.per_client_round_cost(table, row, "agnews")
            least = protocol.least_client_round_cost(table, row, "agnews")
            rounds = protocol.rounds_for(table, row, "agnews")
            if spec.kind == "zero-shot":
                assert (cost, least, rounds) == (0.0, 0.0, 0)
                continue
            budget, round_cost = P.federation.budget, P.federation.per_round * cost
            stop = protocol.budget_stop(table, row, "agnews", "tune")
            # a run stops after the round past which the next could overspend: a round's most before the budget
            assert not stop({"forward_passes": budget - round_cost - 1e-6})
            assert stop({"forward_passes": budget - round_cost + 1e-6})
            if least < cost:  # charged by its draws: its rounds are a cap the budget stop comes before
                varying.append((table, row))
                assert rounds * P.federation.per_round * least <= budget
                continue
            spent = rounds * round_cost
            assert budget - round_cost < spent <= budget, (table, row)
            assert stop({"forward_passes": spent}) and not stop({"forward_passes": spent - round_cost})
    # zofed's rows on the model's weights charge each step from the tensor it drew; every other row is dense, and
    # the head is one tensor
    assert {row for _, row in varying} == {"zofed", "zofed-plain-server"}
    assert {table for table, _ in varying} == {t for t in P.tables if t != "head"}
    # the published zo-seeds runs every perturbed pass through the whole model: it buys fewer rounds
    assert protocol.rounds_for("head", "zo-seeds-plain", "agnews") < protocol.rounds_for("head", "zofed", "agnews")


def test_the_cached_feature_rows_share_the_feature_store_and_the_others_do_not(tmp_path, monkeypatch):
    from calibrate import FEATURE_STORE, use_feature_store

    def remembers(table: str, row: str) -> bool:
        return _run_config(table, row, tmp_path).zo.cache == "features"

    assert remembers("head", "zofed") and remembers("head", "hiso") and remembers("head", "fedavg-head")
    # zo-seeds as published runs every step's batch through the whole model, and LoRA trains the blocks
    assert not remembers("head", "zo-seeds-plain") and not remembers("head", "fedavg-lora")
    assert not remembers("top4", "zofed")
    monkeypatch.setenv("ZOFED_FEATURE_STORE", "")  # recorded, so the store it sets goes when the test ends
    monkeypatch.delenv("ZOFED_FEATURE_STORE")
    use_feature_store()
    assert Path(os.environ["ZOFED_FEATURE_STORE"]) == FEATURE_STORE


def test_a_bad_protocol_file_is_refused_naming_the_problem(tmp_path):
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    cases = [("datasets", ["sst2", "imdb"], "no template"), ("seeds", {"tune": [0], "final": [0]}, "seeds.tune"),
             ("grids", {"zo": [1e-3]}, "grid 'sgd' is not one of")]
    for key, value, message in cases:
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**data, key: value}))
        with pytest.raises(SystemExit, match=message):
            protocol.load_protocol(path)
    data["tables"]["head"]["rows"]["zofed"]["set"] = ["optimizer.lr=1e-3"]
    (tmp_path / "lr.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit, match="the runner sets that key"):
        protocol.load_protocol(tmp_path / "lr.yaml")
    with pytest.raises(SystemExit, match="choose among"):
        protocol.check_names(P, "head", ["zofed", "zofed-q48"])
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    data["tables"]["top4"]["calibrate"] = ["hiso", "fedavg-top4"]
    (tmp_path / "calibrate.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit, match="calibrate names 'fedavg-top4', which is not one of its ZO rows"):
        protocol.load_protocol(tmp_path / "calibrate.yaml")


def test_calibration_runs_the_zo_baselines_to_the_largest_budget_and_evaluates_at_each_multiple(tmp_path):
    cal = P.calibration
    runs, notes = protocol.pending_runs(P, "top4", "calibrate", list(P.tables["top4"].rows), ["agnews"], set(), {})
    assert not notes and {r[2] for r in runs} == set(P.tables["top4"].calibrate)
    calibrate, (low, middle, high) = P.tables["top4"].calibrate, P.calibration.grid  # the middle point first
    assert [(r[2], r[6]) for r in runs] == [(row, lr) for lr in (middle, low, high) for row in calibrate]
    assert {r[5] for r in runs} == set(cal.seeds) and len(runs) == 4 * len(cal.grid) * len(cal.seeds)
    assert {r[6] for r in runs} == set(cal.grid) < set(P.grids["zo"])  # a coarser grid; tuning takes the full one
    overrides = dict(o.split("=", 1) for o in protocol.run_overrides(P, *runs[0], tmp_path))
    rounds, base = protocol.rounds_for("top4", runs[0][2], "agnews", "calibrate"), protocol.rounds_for(
        "top4", runs[0][2], "agnews")
    cost = protocol.per_client_round_cost("top4", runs[0][2], "agnews")
    assert int(overrides["federation.rounds"]) == rounds and overrides["data.evaluate_on"] == "validation"
    assert cal.max_multiple * P.federation.budget - P.federation.per_round * cost < rounds * P.federation.per_round \
        * cost <= cal.max_multiple * P.federation.budget
    assert int(overrides["federation.eval_every"]) == base // 2  # two curve points per budget's worth of rounds


def _calibration_run(row: str, lr: float, dataset: str, gains: list[float], start: float = 0.5) -> dict:
    # a curve point every half budget, the accuracy reached by each multiple of the budget at its second point
    curve = [[0.0, 0.0, 0, start]]
    for m, gain in enumerate(gains, start=1):
        curve += [[(m - 0.5) * P.federation.budget, 0.0, 0, start], [m * P.federation.budget - 1.0, 0.0, 0,
                                                                      start + gain]]
    return {"phase": "calibrate", "table": "top4", "row": row, "dataset": dataset, "alpha": 0.1, "seed": 0,
            "lr": lr, "curve": curve, "final_accuracy": start + gains[-1],
            "protocol": protocol.row_digest(P, "top4", row, "calibrate")}


def test_the_calibrated_budget_is_the_smallest_multiple_at_which_the_best_baseline_gains_enough_everywhere():
    lrs = P.calibration.grid
    gains = {"sst2": [0.01, 0.02, 0.04, 0.05], "agnews": [0.02, 0.035, 0.05, 0.06], "sst5": [0.002, 0.01, 0.031, 0.04]}
    rows = []
    for dataset, best in gains.items():
        for row in P.tables["top4"].calibrate:
            for lr in lrs:  # one row and lr reaches the best gains, every other stays behind
                hit = row == "hiso" and lr == lrs[2]
                rows.append(_calibration_run(row, lr, dataset, best if hit else [g / 2 for g in best]))
    assert protocol.current_rows(P, {"rows": dict(enumerate(rows))})[1] == 0
    assert calibration.calibrated_budget(P, "top4", rows) == 3 * P.federation.budget
    lines = "\n".join(calibration.calibration_lines(P, "top4", rows))
    assert f"| sst5 | +0.002 hiso {lrs[2]:g} | +0.010 hiso {lrs[2]:g} | +0.031 hiso" in lines
    assert f"Calibrated budget: {3 * P.federation.budget:,.0f} passes." in lines
    # a dataset still missing runs leaves the budget open; a dataset that never gains enough says so
    assert calibration.calibrated_budget(P, "top4", rows[1:]) is None
    low = [r if r["dataset"] != "sst5" else {**r, "curve": [[*pt[:3], 0.5] for pt in r["curve"]]} for r in rows]
    assert calibration.calibrated_budget(P, "top4", low) is None
    assert "No budget up to" in "\n".join(calibration.calibration_lines(P, "top4", low))


def test_a_calibration_run_stops_at_the_first_multiple_where_it_or_a_run_of_its_dataset_before_it_passed():
    last = protocol.multiple_rounds(P, "top4", "hiso", "agnews")
    every = protocol.curve_every(P, "calibrate", "top4", "hiso", "agnews")
    assert len(last) == P.calibration.max_multiple and last[-1] == protocol.rounds_for("top4", "hiso", "agnews",
                                                                                         "calibrate")
    points = range(every, last[-1] + 1, every)  # the curve's rounds (a run evaluates every `every`)
    closing = [max(r for r in points if r <= rounds) for rounds in last]  # each multiple's last point
    assert closing[0] < last[0] + 1 and closing[0] + every > last[0]
    gain = P.calibration.gain
    fresh = calibration.calibration_stop(P, "top4", "hiso", "agnews", [], lambda: 0.6)
    assert fresh is not None and fresh.cap is None
    point = {"round": closing[1], "eval_accuracy": 0.6 + gain}
    assert fresh(point) and not fresh({**point, "eval_accuracy": 0.6 + gain - 0.01})
    assert not fresh({"round": closing[1]})  # a round without a curve point
    exact = calibration.calibration_stop(P, "top4", "hiso", "agnews", [], lambda: 0.66)
    assert exact({"round": closing[1], "eval_accuracy": 0.69})  # 207/300 - 198/300 is the target, whatever the ulps
    assert not fresh({"round": closing[1] - every, "eval_accuracy": 0.9})  # a point inside a multiple
    # a stored run of the dataset passed at the second multiple: later runs stop there whatever they gained
    stored = [_calibration_run("decomfl", P.calibration.grid[0], "agnews", [0.0, gain, gain, gain])]
    stored[0]["seed"] = P.calibration.seeds[0]
    capped = calibration.calibration_stop(P, "top4", "hiso", "agnews", stored, lambda: 0.6)
    assert capped.cap == 2 and capped({"round": closing[1], "eval_accuracy": 0.5})
    assert not capped({"round": closing[0], "eval_accuracy": 0.61})
    # another dataset's run sets no cap; with several seeds a run alone decides nothing and never stops
    assert calibration.calibration_stop(P, "top4", "hiso", "sst2", stored, lambda: 0.6).cap is None
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    data["calibration"]["seeds"] = [0, 1]
    assert calibration.calibration_stop(protocol.Protocol.model_validate(data), "top4", "hiso", "agnews", [],
                                        lambda: 0.6) is None


def test_a_calibration_row_stays_current_when_its_table_takes_the_budget_it_chose():
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    data["tables"]["top4"]["budget"] = 3 * P.federation.budget
    data["tables"]["top4"]["rows"]["fedavg-lora"] = data["tables"]["head"]["rows"]["fedavg-lora"]  # its own budget
    calibrated = protocol.Protocol.model_validate(data)
    run = _calibration_run("hiso", P.calibration.grid[0], "agnews", [0.1] * P.calibration.max_multiple)
    run["seed"] = P.calibration.seeds[0]
    assert protocol.is_current(P, run) and protocol.is_current(calibrated, run)
    assert protocol.row_digest(calibrated, "top4", "hiso") != protocol.row_digest(P, "top4", "hiso")  # tune rows move


def test_a_row_of_its_own_set_runs_once_and_shows_in_every_table_of_the_same_budget():
    for table in ("top4", "top4-lora"):
        shown = P.tables[table].rows["fedavg-lora"]
        assert shown.from_table == "head" and shown.method == "fedavg" and shown.trainable == "own"
        runs, notes = protocol.pending_runs(P, table, "tune", ["fedavg-lora", "hiso"], ["sst2"], set(), {})
        assert {r[2] for r in runs} == {"hiso"} and notes == ["fedavg-lora runs in table head, which this table shows",
                                                              "hiso on sst2: seeds [1, 2] wait for seed 0's whole grid "
                                                              "(successive halving)"]
    run = {"phase": "final", "table": "head", "row": "fedavg-lora", "dataset": "sst2", "alpha": 0.1,
           "seed": P.seeds.final[0], "lr": P.grids["adamw"][0], "final_accuracy": 0.9, "curve": [],
           "protocol": protocol.row_digest(P, "head", "fedavg-lora")}
    rows, old = protocol.current_rows(P, {"rows": {"a": run, "b": {**run, "table": "top4"}}})
    assert old == 1  # a run stored under a table that shows the row from another is not current
    assert sorted(r["table"] for r in rows) == ["head", "top4", "top4-lora"]
    assert all(r["from_table"] == "head" for r in rows if r["table"] != "head")
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    data["tables"]["top4"]["budget"] = 2 * P.federation.budget
    with pytest.raises(ValueError, match="run the row in this table instead"):
        protocol.Protocol.model_validate(data)
    data = yaml.safe_load(protocol.PROTOCOL.read_text())
    data["tables"]["top4"]["rows"]["zofed"] = {"from_table": "head"}  # zofed trains the table's set
    with pytest.raises(ValueError, match="trains its own set"):
        protocol.Protocol.model_validate(data)
    data["tables"]["top4"]["rows"]["zofed"] = {"from_table": "head", "method": "zofed"}
    with pytest.raises(ValueError, match="nothing but from_table"):
        protocol.Protocol.model_validate(data)


def test_pending_runs_go_by_seed_then_dataset_then_row_then_lr():
    runs, notes = protocol.pending_runs(P, "head", "tune", ["zofed", "zero-shot", "fedavg-head"], ["sst2", "agnews"],
                                        set(), {})
    assert not notes and all(r[2] != "zero-shot" for r in runs)  # zero-shot runs once, with the finals
    assert [r[5] for r in runs] == sorted(r[5] for r in runs)
    first = runs[:10]
    assert [(r[3], r[2]) for r in first[:6]] == [("sst2", "zofed")] * 5 + [("sst2", "fedavg-head")]
    assert len(runs) == 3 * 2 * (5 + 5)
    done = {protocol.row_key(*runs[0])}
    assert protocol.pending_runs(P, "head", "tune", ["zofed"], ["sst2"], done, {})[0][0] == runs[1]
    chosen = {protocol.setting_key("head", "sst2", 0.1, "zofed"): {"lr": 3e-3}}
    finals, notes = protocol.pending_runs(P, "head", "final", ["zero-shot", "zofed", "hiso"], ["sst2"], set(), chosen)
    assert notes == ["no tuning rows for hiso on sst2: run --phase tune first; left out"]
    assert [(r[2], r[5], r[6]) for r in finals] == [("zero-shot", 0, 0.0)] + [("zofed", s, 3e-3) for s in range(5)]


def test_successive_halving_tunes_later_seeds_on_the_first_seeds_best_points():
    """top4 tunes by successive halving: seed 0 runs the whole grid, seeds 1 and 2 only its 2 best points (ties to
    the smaller lr), listed once seed 0's grid is stored; the head table tunes every point on every seed."""
    assert P.tables["top4"].survivors == 2 and P.tables["head"].survivors is None
    runs, notes = protocol.pending_runs(P, "top4", "tune", ["hiso"], ["agnews"], set(), {})
    assert [(r[5], r[6]) for r in runs] == [(0, lr) for lr in P.grids["zo"]]
    assert notes == ["hiso on agnews: seeds [1, 2] wait for seed 0's whole grid (successive halving)"]
    scores = dict(zip(P.grids["zo"], [0.70, 0.74, 0.72, 0.74, 0.60], strict=True))
    stored = [_stored("hiso", 0, acc, phase="tune", lr=lr, table="top4") for lr, acc in scores.items()]
    assert protocol.survivors(P, "top4", "hiso", "agnews", stored[:4]) is None
    done = {protocol.row_key("tune", "top4", "hiso", "agnews", 0.1, 0, lr) for lr in scores}
    runs, notes = protocol.pending_runs(P, "top4", "tune", ["hiso"], ["agnews"], done, {}, stored)
    assert not notes and [(r[5], r[6]) for r in runs] == [(s, lr) for s in (1, 2) for lr in (3e-4, 3e-3)]
    assert report.tuning_runs(P, "top4") == sum(len(protocol.grid(P, "top4", r)) + 2 * min(2, len(protocol.grid(
        P, "top4", r))) for r in P.tables["top4"].rows)
    head = protocol.pending_runs(P, "head", "tune", ["hiso"], ["agnews"], set(), {})[0]
    assert len(head) == 3 * len(P.grids["zo"]) and report.tuning_runs(P, "head") == 3 * sum(
        len(protocol.grid(P, "head", r)) for r in P.tables["head"].rows)


def _stored(row: str, seed: int, final: float, phase: str = "final", lr: float = 1e-3, curve=None,
            table: str = "head", dataset: str = "agnews") -> dict:
    curve = curve if curve is not None else [(0, 0.6), (500, final - 0.02), (1000, final)]
    return {"phase": phase, "table": table, "row": row, "dataset": dataset, "alpha": 0.1, "seed": seed, "lr": lr,
            "budget": 1000.0, "protocol": protocol.row_digest(P, table, row), "final_accuracy": final,
            "bytes_up_per_client_round": 900.0, "trainable_tensors": 1, "rounds": 200,
            "forward_passes_per_client_round": 1.0, "curve": [[p, 0.0, i, a] for i, (p, a) in enumerate(curve)]}


def test_only_rows_of_the_current_protocol_are_kept():
    good = _stored("zofed", 0, 0.8, phase="tune")
    old = {**good, "protocol": "0123456789ab"}  # run when the row meant something else
    off_grid = {**good, "lr": 5e-4}
    renamed = {**good, "row": "zofed-features-cached"}
    legacy = {"phase": "tune", "row": "zofed", "trainable": "head", "dataset": "agnews", "seed": 0}
    kept, dropped = protocol.current_rows(P, {"rows": dict(enumerate([good, old, off_grid, renamed, legacy]))})
    assert kept == [good] and dropped == 4


def test_tuning_chooses_by_the_mean_and_prefers_points_tuned_on_more_seeds():
    rows = [_stored("hiso", 0, 0.40, "tune", 1e-4), _stored("hiso", 1, 0.30, "tune", 1e-4),
            _stored("hiso", 0, 0.36, "tune", 1e-3), _stored("hiso", 1, 0.36, "tune", 1e-3),
            _stored("hiso", 0, 0.50, "tune", 3e-3)]  # one seed only: not preferred over points tuned on two
    chosen = protocol.choices(rows)["head|agnews|0.1|hiso"]
    assert (chosen["lr"], chosen["seeds"], chosen["validation_accuracy"]) == (1e-3, 2, 0.36)
    assert chosen["tried"] == [1e-4, 1e-3, 3e-3]


def test_the_head_report_says_neither_component_is_active_and_top4_says_both_are():
    head = "\n".join(report.settings_lines(P, "head", [_stored("zofed", 0, 0.8)]))
    assert ("forward estimator, 8 queries a step, 48 local steps of batch 8, zo.cache features (8 cached examples a "
            "client round)") in head
    assert "Neither of zofed's two components is active here" in head
    assert "zofed's row is zo-seeds with one-sided (forward) queries (8 a step)" in head
    top4 = "\n".join(report.settings_lines(P, "top4", [{**_stored("zofed", 0, 0.8, table="top4"),
                                                        "trainable_tensors": 9}]))
    assert "Active: personalized block sampling" in top4 and "; active: global adaptive server momentum." in top4
    unknown = "\n".join(report.settings_lines(P, "top4", []))
    assert "known once a row of this table has run" in unknown
    assert "Active: global adaptive server momentum." in unknown and "inactive" not in unknown


def test_a_dataset_table_pairs_zofed_by_seed_and_lists_what_is_missing():
    rows = [_stored(n, 0, 0.7, "tune", 1e-3) for n in ("zofed", "hiso")]
    rows += [_stored("zofed", s, f) for s, f in enumerate([0.80, 0.81, 0.79])]
    rows += [_stored("hiso", s, f, curve=[(0, 0.6), (1000, 0.75)]) for s, f in enumerate([0.76, 0.76, 0.77])]
    rows += [{**_stored("zero-shot", 0, 0.60, lr=0.0), "curve": []}]
    text = "\n".join(report.dataset_lines(P, "head", "agnews", 0.1, rows))
    assert "| zofed | 0.001 | 0.7000 (1) | 0.8000 ± 0.0100 | 3 | 900 |" in text
    assert "| fedavg-head | n/a | n/a | missing | 0 | n/a |" in text
    assert "zofed (tuned on 1 of 3 seeds, final on 3 of 5)" in text and "hiso (tuned on 1 of 3 seeds, final" in text
    assert "fedavg-lora (tuned on 0 of 3 seeds, final on 0 of 5)" in text and "zero-shot (" not in text
    assert "Not run yet" in "\n".join(report.dataset_lines(P, "head", "sst2", 0.1, rows))
    assert "- hiso: +3.67 (standard error 0.88) over seeds [0, 1, 2]" in text
    assert "- zero-shot: +20.00 (standard error 0.58) over seeds [0, 1, 2]" in text
    assert "best ZO baseline by final subset accuracy is hiso (0.7500" in text
    assert "- zofed: 500 forward passes (3 of 3 seeds)" in text  # its curve passes 0.75 at its 500-pass point
    no_zofed = "\n".join(report.dataset_lines(P, "head", "agnews", 0.1, rows[5:]))
    assert "zofed has no final rows here yet" in no_zofed


def test_the_readme_section_follows_the_rows_and_is_written_between_the_markers(tmp_path):
    rows = [_stored(n, 0, 0.7, "tune") for n in ("zofed", "hiso", "fedkseed")]
    rows += [_stored("zofed", s, 0.80 + 0.01 * s) for s in range(2)]
    rows += [_stored("hiso", s, 0.78) for s in range(2)] + [_stored("fedkseed", s, 0.70) for s in range(2)]
    rows += [{**_stored("zero-shot", 0, 0.6, lr=0.0), "curve": []}]
    section = report.benchmarks_section({"rows": dict(enumerate(rows))})
    lines = section.splitlines()
    assert len(lines) <= 10
    assert ("- agnews: zofed 0.8050 ± 0.0071 (2); best ZO baseline hiso 0.7800 ± 0.0000 (2); zero-shot 0.6000. "
            "zofed ahead of hiso (+2.50 points, standard error 0.50, 2 seeds)") in lines
    assert report.verdict("x", [0, 1, 2], np.array([1.0, -1.0, 0.5])).startswith("level with x (+0.17 points")
    assert report.verdict("x", [0, 1], np.array([-3.0, -3.2])).startswith("behind x")
    assert report.verdict("x", [0], np.array([5.0])) == "against x: 1 paired seed, no verdict yet"
    assert "- sst2: not run yet" in lines
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{report.BEGIN}\nold\n{report.END}\ntail\n")
    assert report.update_readme(section, readme)
    assert readme.read_text() == f"# x\n{report.BEGIN}\n{section}\n{report.END}\ntail\n"
    readme.write_text("no markers\n")
    assert not report.update_readme(section, readme) and readme.read_text() == "no markers\n"


def test_the_report_is_written_from_the_rows_with_a_figure_per_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "COST_MODEL", tmp_path / "cost_model.json")
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text(f"{report.BEGIN}\n{report.END}\n")
    lrs = {"zofed": 1e-3, "fedavg-head": 1.0}  # each on its own grid
    rows = [_stored(n, s, 0.7, "tune", lr) for n, lr in lrs.items() for s in range(3)]
    rows += [_stored(n, s, 0.8 - 0.01 * s, lr=lr) for n, lr in lrs.items() for s in range(2)]
    rows += [{**_stored("zero-shot", 0, 0.6, lr=0.0), "curve": []}, {**rows[0], "protocol": "stale"}]
    report.write_report({"rows": dict(enumerate(rows))})
    assert "1 stored rows belong to another protocol" in capsys.readouterr().out
    text = (tmp_path / "ranking.md").read_text()
    assert "![head agnews](ranking_head_agnews_a0.1.png)" in text and "## Table top4" in text
    assert (tmp_path / "ranking_head_agnews_a0.1.png").is_file()
    assert not list(tmp_path.glob("ranking_head_sst2*"))  # no rows there: no figure
    assert "- fedavg-head: +0.00 (standard error 0.00) over seeds [0, 1]" in text
    assert "- agnews: zofed 0.7950 ± 0.0071 (2); fedavg-head 0.7950 ± 0.0071 (2); zero-shot 0.6000" in \
           (tmp_path / "README.md").read_text()


def test_the_cost_model_file_is_read_defensively(tmp_path, monkeypatch):
    path = tmp_path / "cost_model.json"
    monkeypatch.setattr(report, "COST_MODEL", path)
    assert report.cost_model_lines() == []
    path.write_text('{"steps": {"lora_backward": {"measured": 2.3, "rule": 2.0}}, "other": 1, '
                    '"rows": [{"row": "fo_head_step", "what": "a step", "measured": 5.98627e-05, "rule": 8e-05}]}')
    lines = report.cost_model_lines()
    assert "| steps.lora_backward |  | 2.3 | 2 |" in lines and "| fo_head_step | a step | 5.99e-05 | 8e-05 |" in lines
    path.write_text("{not json")
    assert "could not be read" in report.cost_model_lines()[2]


def test_curves_past_the_tenth_colour_are_dashed():
    from curve_plot import draw_seed_band
    from matplotlib.figure import Figure

    axes = Figure().subplots(1, 3)
    curves = np.array([[[p, 10.0 * p, i, 0.5] for i, p in enumerate([0.0, 500.0, 1000.0])]] * 2)
    for n in range(11):
        draw_seed_band(axes, f"row{n}", curves, curves[:, :, 3])
    styles = [line.get_linestyle() for line in axes[0].get_lines()]
    assert styles[:10] == ["-"] * 10 and styles[10] == "--"
    assert axes[0].get_lines()[10].get_color() == axes[0].get_lines()[0].get_color()  # why it must be dashed


def test_a_run_directory_is_never_continued_under_another_protocol(tmp_path):
    import ranking

    identity = ranking._identity("tune", "top4", "zofed", "agnews", 0.1, 0, 1e-2)
    out = tmp_path / "run"
    ranking.claim_run_dir(out, identity)
    ranking.claim_run_dir(out, identity)  # the same row resumes
    moved = {**identity, "protocol": "0123456789ab", "budget": 2000.0}
    with pytest.raises(SystemExit, match="holds a run of protocol .* delete that directory"):
        ranking.claim_run_dir(out, moved)
    legacy = tmp_path / "legacy"
    (legacy / "checkpoint").mkdir(parents=True)  # a run started before the marks: taken as it stands, then marked
    ranking.claim_run_dir(legacy, moved)
    assert (legacy / ranking.IDENTITY).is_file()
