"""A live view of a run: every numeric field of each metrics record, written as TensorBoard scalars.

`metrics.jsonl` stays the run's record; these event files are a copy for watching a run as it goes
(`tensorboard --logdir DIR`), as users of HF Trainer and Flower do. A field `eval_accuracy` of an `eval` record
becomes the scalar `eval/eval_accuracy` at the record's round (or step). A resumed run purges the events past its
checkpoint, as the metrics log drops its records past it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# Fields that place a record rather than measure something.
_POSITION = ("step", "round", "event")


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A record's position (its round, else its step) and its finite numeric fields, tagged `event/field`."""
    step = int(record.get("round", record.get("step", 0)))
    event = str(record.get("event", "record"))
    values = {f"{event}/{key}": float(value) for key, value in record.items()
              if key not in _POSITION and isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value)}
    return step, values


class TensorBoardLog:
    """Writes records to TensorBoard event files under `directory`, the writer opened at the first record."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.purge_from: int | None = None
        self._writer = None

    def resume_after(self, step: int) -> None:
        """Events past `step` (written before a crash) are dropped when the writer opens."""
        self.purge_from = step + 1

    def write(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        if not values:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only for runs that ask

            self._writer = SummaryWriter(str(self.directory), purge_step=self.purge_from)
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()  # a round is seconds long or more: show it now
