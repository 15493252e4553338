"""Metrics as JSON lines: one object per event, appended and flushed to disk, so a crash loses nothing written.

A kill in the middle of an append leaves a torn last line (no newline at its end): the reader drops it with a
warning, and a resume cuts it away with the records past the checkpoint. A line that does not read anywhere else
is damage, not a crash, and reading stops with an error naming the file and the line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from zofed.atomic_files import append_line, write_atomic_text
from zofed.run.config import ConfigError
from zofed.run.tensorboard import TensorBoardLog

# A run's headline metric -> its per-client list in results.json (lower is better only for the loss).
CLIENT_LISTS = {"accuracy": "client_accuracies", "rougeL": "client_rougeL", "loss": "client_losses"}

log = logging.getLogger("zofed.run")


def _record(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}, line {number}: not a JSON record ({err}); the file was changed or damaged "
                          "after it was written") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}, line {number}: not a JSON object")
    return record


class MetricsLog:
    """A run's metrics file, and, when `tensorboard` names a directory, a TensorBoard copy of what it writes."""

    def __init__(self, path: Path, tensorboard: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board = TensorBoardLog(tensorboard) if tensorboard is not None else None

    def write(self, record: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(record))
        if self.board is not None:
            self.board.write(record)

    def read(self) -> list[dict[str, Any]]:
        """Every record; a torn last line (a kill in the middle of its append) is dropped with a warning."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            try:
                json.loads(lines[-1])
            except json.JSONDecodeError:
                log.warning("%s: dropping its torn last line %d (a run killed while writing it): %.60r",
                            self.path, len(lines), lines[-1])
                lines.pop()
        return [_record(self.path, number, line) for number, line in enumerate(lines, start=1) if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (when resuming from a checkpoint taken at `step`), and a torn last line."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        write_atomic_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if self.board is not None:
            self.board.resume_after(step)
