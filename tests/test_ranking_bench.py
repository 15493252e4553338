"""benchmarks/ranking.py without running a model: each row's client compute follows its own estimator and cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ranking  # noqa: E402


def test_rows_are_charged_their_own_passes_and_spend_at_most_the_budget():
    f = 4 / 30  # the top-4 set's share of SmolLM2's blocks, run by each perturbed pass when the prefix is cached
    step = {"zofed": (1 - f) + 2 * 4 * f, "zofed-forward": (1 - f) + (4 + 1) * f, "decomfl": 2.0}
    for row, cost in step.items():
        assert ranking.per_client_round_cost(row, "top4") == pytest.approx(ranking.LOCAL_STEPS * cost)
    assert ranking.rounds_for("zofed-forward", "top4", 1000) > ranking.rounds_for("zofed", "top4", 1000)
    for row in ranking.ROWS:
        round_cost = ranking.PER_ROUND * ranking.per_client_round_cost(row, "top4")
        spent = ranking.rounds_for(row, "top4", 1000) * round_cost
        assert 1000 - round_cost < spent <= 1000, row
