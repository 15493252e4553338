"""Metrics as JSON lines: one object per event, appended and flushed so a crash loses nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A run's headline metric -> its per-client list in results.json (lower is better only for the loss).
CLIENT_LISTS = {"accuracy": "client_accuracies", "rougeL": "client_rougeL", "loss": "client_losses"}


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (when resuming from a checkpoint taken at `step`)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
