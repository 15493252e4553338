"""Benchmark rows in fresh processes, a few at a time, recorded as they finish.

Every row runs in its own spawned process, so its peak memory is its own and not the heaviest earlier row's;
a row that fails is reported with its exception and the others go on. A row's process ends with the benchmark
that spawned it. `record_rows` stores each finished row in the benchmark's JSON table and rewrites its report,
so a matrix fills over sittings and an interrupted sitting keeps every row that finished; sittings that run side
by side merge their rows into the same table.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from zofed.atomic_files import write_atomic_text


def _exit_with_parent(parent: int) -> None:
    """Ends this row's process once the benchmark that spawned it is gone: an orphaned row would go on writing
    into a run directory that a rerun of the benchmark writes too."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_rows(work: Callable[..., dict], pending: Sequence[tuple], key: Callable[..., str], jobs: int,
             *extra: Any) -> Iterator[tuple[str, dict | BaseException]]:
    """Yield (key(*args), work(*args, *extra)) as rows finish, or (key, the exception) for a failed row; `work`
    must be a module-level function (spawned processes import it)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1, initializer=_exit_with_parent,
                             initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(work, *args, *extra): key(*args) for args in pending}
        for future in as_completed(futures):
            error = future.exception()
            yield futures[future], error if error is not None else future.result()


def _store_row(table: dict, path: Path, key: str, row: dict) -> None:
    """Add `row` to the table on disk, under a lock, keeping rows that another sitting of the same benchmark wrote
    since this one read the file (two sittings may run side by side, each with its own rows). The disk's rows are
    the base: every row this sitting stored is there already, and a row renamed or dropped on disk since this
    sitting started stays so."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            table["rows"] = dict(json.loads(path.read_text()).get("rows", {}))  # the disk is newer
        table["rows"][key] = row
        write_atomic_text(path, json.dumps(table, indent=2))


def record_rows(rows: Iterator[tuple[str, dict | BaseException]], table: dict, path: Path,
                report: Callable[[], None], hidden: str) -> None:
    """Store each finished row in `table["rows"]`, write the table to `path` and call `report`, printing the row
    without its `hidden` field (a curve); a failed row is reported and the others go on. Exits with an error
    naming the failed rows once all are done."""
    failed = []
    for key, row in rows:
        if isinstance(row, BaseException):
            failed.append(key)
            print(f"row {key} failed, the others go on: {type(row).__name__}: {row}", file=sys.stderr, flush=True)
            continue
        _store_row(table, path, key, row)
        report()
        print(json.dumps({k: v for k, v in row.items() if k != hidden}), flush=True)
    if failed:
        sys.exit(f"{len(failed)} rows failed: {', '.join(failed)}")
