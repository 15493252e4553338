"""The run's uplink log (`uplinks.jsonl`): what a federated run's server accepted, round by round, chained by hashes.

A federated model is a function of its starting weights, the server's settings and the uplinks it accepted: the
server's sampling, each client's state and the aggregation are all derived from seeds. So the log holds exactly
those, append-only, one JSON line each:

- line 1, the header: the run's config (as its `config.yaml` holds it), the numbers of clients and classes (all
  the server needs of the data), the SHA-256 of the starting trainable tensors and whether the server added
  differential-privacy noise (`server_noised`);
- then one line per round: the round, the SHA-256 of the line before it, each accepted uplink's bytes (base64)
  with its client, and the rejected uplinks' reasons. Under central DP an uplink's bytes are its numbers after
  the server's clipping and noise, as the aggregation read them (fl/privacy.py): never the client's own.

`zofed replay RUN_DIR` (run/replay.py) rebuilds the final model from the log alone: a third party can verify
what a federation trained without any client's data. Changing any byte of a line breaks the next line's hash.
Each line is flushed to disk before the round's metrics record and its checkpoint are written, so a resumed run
cuts the log back to the rounds its checkpoint holds and appends from there; a log that holds fewer rounds than
the checkpoint stops the resume. The chain has no anchor inside the run directory (whoever can edit the log can
rewrite every line after the one changed): `zofed run` prints the hash of the last line, the head, to be kept
elsewhere, and `zofed replay RUN_DIR --expect HEAD` checks the log against it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zofed.atomic_files import append_line, write_atomic_text

LOG_NAME = "uplinks.jsonl"
FORMAT = "zofed-uplinks/1"


class LogError(ValueError):
    """An uplink log that cannot be trusted or read; the message names the line."""


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(np.ascontiguousarray(t.detach().cpu().to(torch.float32).numpy()).tobytes())
    return digest.hexdigest()


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _sha(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


@dataclass
class UplinkLog:
    """An open log: where it is and the hash the next round's line carries."""

    path: Path
    prev: str

    @classmethod
    def start(cls, path: Path, *, config_text: str, num_clients: int, num_classes: int | None,
              start_tensors: Sequence[torch.Tensor], server_noised: bool = False) -> UplinkLog:
        header = _line({"format": FORMAT, "config": config_text, "num_clients": num_clients,
                        "num_classes": num_classes, "start_sha256": tensors_sha256(start_tensors),
                        "server_noised": server_noised})
        write_atomic_text(path, header + "\n")
        return cls(path, _sha(header))

    @classmethod
    def resume(cls, path: Path, rounds_done: int) -> UplinkLog:
        """The log cut back to the rounds a checkpoint holds (a crash may have logged a round, or torn its line,
        after the checkpoint before). A log that does not hold every round the checkpoint does, or whose kept
        lines do not check, is refused (LogError): going on would leave a log that replays no model."""
        lines = path.read_text().splitlines() if path.is_file() else []
        if len(lines) < rounds_done + 1:
            held = f"holds {max(len(lines) - 1, 0)}" if lines else "is missing or empty and holds none"
            raise LogError(f"{path} {held} of the {rounds_done} rounds the checkpoint holds: it was cut or deleted "
                           "after they were written, or the run went on without it "
                           "(federation.log_uplinks=false) for a while. Resume with --set "
                           "federation.log_uplinks=false to go on without an audit log (zofed replay then "
                           "refuses the run), or start a new run")
        kept = lines[: rounds_done + 1]
        _, _, head = _check(path, kept)
        write_atomic_text(path, "".join(line + "\n" for line in kept))
        return cls(path, head)

    def append(self, round_done: int, uplinks: Sequence[tuple[int, bytes]],
               rejected: Sequence[tuple[int | None, str]]) -> None:
        line = _line({"round": round_done, "prev": self.prev,
                      "uplinks": [[int(c), base64.b64encode(data).decode("ascii")] for c, data in uplinks],
                      "rejected": [[c, reason] for c, reason in rejected]})
        append_line(self.path, line)
        self.prev = _sha(line)


@dataclass(frozen=True)
class LoggedRound:
    round: int
    uplinks: list[tuple[int, bytes]]
    rejected: list[tuple[int | None, str]]


def read_log(path: Path) -> tuple[dict[str, Any], list[LoggedRound], str]:
    """The header, the rounds and the hash of the last line, after checking every line's hash link and round
    number."""
    if not path.is_file():
        raise LogError(f"{path.parent} has no uplink log ({path.name}): the run was made without one, or by a "
                       "zofed that did not write it")
    return _check(path, path.read_text().splitlines())


def _check(path: Path, lines: list[str]) -> tuple[dict[str, Any], list[LoggedRound], str]:
    if not lines:
        raise LogError(f"{path} is empty")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as err:
        raise LogError(f"{path}, line 1: not JSON ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LogError(f"{path}, line 1: not a {FORMAT} header")
    rounds, prev = [], _sha(lines[0])
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
            uplinks = [(int(c), base64.b64decode(data, validate=True)) for c, data in record["uplinks"]]
            rejected = [(c, str(reason)) for c, reason in record["rejected"]]
            round_done = int(record["round"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise LogError(f"{path}, line {number}: not a round record ({err})") from None
        if record.get("prev") != prev:
            raise LogError(f"{path}, line {number} (round {round_done}): its hash link does not match line "
                           f"{number - 1}: the log was changed after it was written")
        if round_done != number - 1:
            raise LogError(f"{path}, line {number}: round {round_done}, expected {number - 1}")
        rounds.append(LoggedRound(round_done, uplinks, rejected))
        prev = _sha(line)
    return header, rounds, prev
