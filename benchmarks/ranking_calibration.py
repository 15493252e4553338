"""A table's budget, calibrated: the smallest multiple of the federation's budget (up to the protocol's
max_multiple) at which the best of the table's `calibrate` rows (its ZO baselines) gains at least `gain` over the
starting model on the validation split, on every dataset. Each calibration run goes the whole max_multiple x budget
once; its curve's last point within a budget stands for a run stopped there (no schedule or averaging of the
calibrated rows depends on the number of rounds)."""

from __future__ import annotations

import numpy as np
from ranking_protocol import Protocol, grid  # benchmarks/ is the script's own directory


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


def _smallest_passing(p: Protocol, per_dataset: list[list[dict]]) -> float | None:
    """The first budget at which every dataset's best gain reaches the target (None: none does, or a dataset's
    calibration runs are not all in)."""
    assert p.calibration is not None
    if not all(points[0]["complete"] for points in per_dataset):
        return None
    for i, budget in enumerate(points["budget"] for points in per_dataset[0]):
        if all(points[i]["best"]["gain"] >= p.calibration.gain for points in per_dataset):
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
             f"once to {budgets[-1]:,.0f} passes; the gain in validation accuracy over the starting model (curve "
             f"subset) of the best row and lr at each budget. Target: at least {cal.gain:.2f} on every dataset.", "",
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
