"""Benchmark sittings that run side by side share one results table without losing each other's rows."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from row_pool import _store_row  # noqa: E402


def _sitting(path: str, name: str, count: int) -> None:
    table = {"meta": {"sitting": name}, "rows": {}}  # what this sitting read when it started: nothing yet
    for i in range(count):
        _store_row(table, Path(path), f"{name}-{i}", {"value": i})


def test_two_sittings_writing_at_once_keep_every_row(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"meta": {}, "rows": {"old": {"value": -1}}}))
    context = multiprocessing.get_context("fork")
    sittings = [context.Process(target=_sitting, args=(str(path), name, 25)) for name in ("a", "b")]
    for p in sittings:
        p.start()
    for p in sittings:
        p.join(60)
        assert p.exitcode == 0
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"old", *(f"a-{i}" for i in range(25)), *(f"b-{i}" for i in range(25))}
    assert rows["b-24"] == {"value": 24}


def test_a_row_rewritten_on_disk_by_another_sitting_is_not_undone(tmp_path):
    path = tmp_path / "table.json"
    stale = {"meta": {}, "rows": {"shared": {"value": 1}}}  # read before another sitting rewrote "shared"
    path.write_text(json.dumps({"meta": {}, "rows": {"shared": {"value": 2}}}))
    _store_row(stale, path, "mine", {"value": 3})
    assert json.loads(path.read_text())["rows"] == {"shared": {"value": 2}, "mine": {"value": 3}}


def test_a_row_renamed_on_disk_while_a_sitting_runs_does_not_come_back(tmp_path):
    path = tmp_path / "table.json"
    stale = {"meta": {}, "rows": {"old-name": {"value": 1}}}  # read before the row was renamed on disk
    path.write_text(json.dumps({"meta": {}, "rows": {"new-name": {"value": 1}}}))
    _store_row(stale, path, "mine", {"value": 3})
    assert json.loads(path.read_text())["rows"] == {"new-name": {"value": 1}, "mine": {"value": 3}}
