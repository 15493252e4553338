"""Benchmark rows in fresh processes, a few at a time, reported as they finish.

Every row runs in its own spawned process, so its peak memory is its own and not the heaviest earlier row's;
a row that fails is reported with its exception and the others go on. A row's process ends with the benchmark
that spawned it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


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
