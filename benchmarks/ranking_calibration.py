"""A table's budget, calibrated: the smallest multiple of the federation's budget (up to the protocol's
max_multiple) at which the best of the table's `calibrate` rows (its ZO baselines) gains at least `gain` over the
starting model on the validation split, on every dataset. A calibration run's curve's last point within a budget
stands for a run stopped there (no schedule or averaging of the calibrated rows depends on the number of rounds).
So with one calibration seed a run stops at the end of the first multiple at which it has gained `gain`, or of the
smallest multiple at which a stored run of its dataset did (`CalibrationStop`): past either point nothing it could
show changes the budget chosen, and at larger budgets its last point stands for it. With several seeds a (row,
lr) is judged by its mean over them, and every run goes the whole max_multiple x budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ranking_protocol import Protocol, curve_every, grid, multiple_rounds  # benchmarks/ is the script's directory


def passes(gain: float, target: float) -> bool:
    """Whether a gain reaches the target: accuracies are k/n fractions a few ulps off in float (0.69 - 0.66 is
    0.02999...), so the comparison allows 1e-9."""
    return gain >= target - 1e-9


def accuracy_within(curve: list[list[float]], budget: float) -> float:
    """The accuracy of a curve's last point whose forward passes fit in `budget` (its start when none does)."""
    fitting = [point for point in curve if point[0] <= budget * (1 + 1e-9)]
    return fitting[-1][3]


def budget_gains(p: Protocol, table: str, dataset: str, rows: list[dict]) -> list[dict]:
    """For each multiple of the budget: the best (row, lr) by its mean gain over the seeds' starting accuracy, and
    whether every calibration run of the dataset is in."""
    assert p.calibration is not None
    runs = [r for r in rows if (r["phase"], r["table"], r["dataset"]) == ("calibrate", table, dataset)]
    cal = p.calibration
    expected = sum(len(grid(p, table, row, "calibrate")) for row in p.tables[table].calibrate) * len(cal.seeds)
    by_point: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        by_point.setdefault((r["row"], r["lr"]), []).append(r)
    out = []
    for multiple in range(1, cal.max_multiple + 1):
        budget = multiple * p.federation.budget
        best = None
        for (row, lr), rs in by_point.items():
            gain = float(np.mean([accuracy_within(r["curve"], budget) - r["curve"][0][3] for r in rs]))
            if best is None or gain > best["gain"]:
                best = {"row": row, "lr": lr, "gain": gain, "seeds": len(rs)}
        out.append({"budget": budget, "best": best, "complete": len(runs) >= expected})
    return out


def passing_multiple(p: Protocol, table: str, dataset: str, rows: list[dict]) -> int | None:
    """The first multiple of the budget at which the dataset's stored calibration runs' best gain reaches the
    target (None: none yet)."""
    assert p.calibration is not None
    for multiple, point in enumerate(budget_gains(p, table, dataset, rows), 1):
        if point["best"] is not None and passes(point["best"]["gain"], p.calibration.gain):
            return multiple
    return None


@dataclass
class CalibrationStop:
    """Asked after each round of a calibration run (`run_federated`'s `stop`): True at the run's last curve point
    within a multiple of the budget when the run has gained `gain` over its starting accuracy there, or when that
    multiple is `cap` (the dataset's smallest passing multiple so far)."""

    last_rounds: list[int]  # the rounds each multiple buys the row (`multiple_rounds`)
    every: int  # rounds between curve points
    gain: float
    cap: int | None
    start: Callable[[], float]  # the run's starting accuracy (its round-0 curve point)

    def __call__(self, record: dict) -> bool:
        if "eval_accuracy" not in record:
            return False
        done = record["round"]
        # the multiples this point closes: no later curve point fits their budget
        closes = [m for m, last in enumerate(self.last_rounds, 1) if done <= last < done + self.every]
        if not closes:
            return False
        return (self.cap is not None and max(closes) >= self.cap) or \
            passes(record["eval_accuracy"] - self.start(), self.gain)


def calibration_stop(p: Protocol, table: str, row: str, dataset: str, rows: list[dict],
                     start: Callable[[], float]) -> CalibrationStop | None:
    """The stop of a calibration run of `row` on `dataset`, given the stored rows; None with several calibration
    seeds (a run alone does not decide its (row, lr))."""
    assert p.calibration is not None
    if len(p.calibration.seeds) != 1:
        return None
    return CalibrationStop(multiple_rounds(p, table, row, dataset), curve_every(p, "calibrate", table, row, dataset),
                           p.calibration.gain, passing_multiple(p, table, dataset, rows), start)


def _smallest_passing(p: Protocol, per_dataset: list[list[dict]]) -> float | None:
    """The first budget at which every dataset's best gain reaches the target (None: none does, or a dataset's
    calibration runs are not all in)."""
    assert p.calibration is not None
    if not all(points[0]["complete"] for points in per_dataset):
        return None
    for i, budget in enumerate(points["budget"] for points in per_dataset[0]):
        if all(passes(points[i]["best"]["gain"], p.calibration.gain) for points in per_dataset):
            return budget
    return None


def calibrated_budget(p: Protocol, table: str, rows: list[dict]) -> float | None:
    """The smallest budget at which the best calibration row gains `gain` on every dataset; None until every
    dataset's calibration runs are in, or when no budget up to max_multiple passes."""
    if p.calibration is None or not p.tables[table].calibrate:
        return None
    return _smallest_passing(p, [budget_gains(p, table, d, rows) for d in p.datasets])


def calibration_lines(p: Protocol, table: str, rows: list[dict]) -> list[str]:
    """The report's calibration section of a table: each dataset's best gain at each budget, and the budget chosen."""
    if p.calibration is None or not p.tables[table].calibrate:
        return []
    if not any(r["phase"] == "calibrate" and r["table"] == table for r in rows):
        return ["", "### Budget calibration", "", "Not run yet (`benchmarks/ranking.py --phase calibrate "
                f"--table {table}`)."]
    cal = p.calibration
    budgets = [m * p.federation.budget for m in range(1, cal.max_multiple + 1)]
    lines = ["", "### Budget calibration", "",
             f"Rows {', '.join(p.tables[table].calibrate)} on the calibration grid, seeds {cal.seeds}, each run "
             f"once up to {budgets[-1]:,.0f} passes (with one seed it stops at the first multiple where it, or "
             "a run of its dataset before it, passed: its last point stands for it at larger budgets); the gain in "
             "validation accuracy over the starting model (curve subset) of the best row and lr at each budget. "
             f"Target: at least {cal.gain:.2f} on every dataset.", "",
             "| dataset | " + " | ".join(f"{b:,.0f}" for b in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    per_dataset = [budget_gains(p, table, d, rows) for d in p.datasets]
    for dataset, points in zip(p.datasets, per_dataset, strict=True):
        if points[0]["best"] is None:
            lines.append(f"| {dataset} | " + " | ".join("-" for _ in budgets) + " |")
            continue
        mark = "" if points[0]["complete"] else " (partial)"
        cells = [f"{pt['best']['gain']:+.3f} {pt['best']['row']} {pt['best']['lr']:g}" for pt in points]
        lines.append(f"| {dataset}{mark} | " + " | ".join(cells) + " |")
    chosen = _smallest_passing(p, per_dataset)
    if chosen is not None:
        lines += ["", f"Calibrated budget: {chosen:,.0f} passes."]
    elif all(points[0]["complete"] for points in per_dataset):
        lines += ["", f"No budget up to {budgets[-1]:,.0f} passes gives a ZO baseline {cal.gain:.2f} on every "
                  "dataset."]
    return lines
