"""Files replaced whole or appended line by line so that a crash or a power cut at any moment leaves the previous
or the new version intact, never a half-written one: the project's one way to write a file that must survive.
A leaf module (it imports nothing of zofed's), so every layer that writes files can use it."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's bytes, or a directory's entries, to disk: a rename is durable only once its directory is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


_TEMPORARY = re.compile(r"^\..+\.(\d+)-[0-9a-f]{8}\.tmp$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(directory: Path) -> None:
    """Delete the temporary files that `write_atomic_text` writers killed before their rename left in
    `directory`: those whose process is gone (a running writer's file is its own)."""
    for candidate in Path(directory).glob(".*.tmp"):
        match = _TEMPORARY.match(candidate.name)
        if match and not _running(int(match.group(1))):
            candidate.unlink(missing_ok=True)


def write_atomic_text(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8): the project's one way to replace a file.

    The data goes to a temporary file of this writer's own in the same directory (two writers never share one;
    the last rename wins), is flushed to disk, then renamed over `path`, and the directory is flushed: readers
    and a crash see the old file or the new one, never part of one."""
    path = Path(path)
    tmp = _temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for a plain write
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line to `path` and flush it to disk before returning: a record written is a record kept. A
    kill in the middle leaves at most a torn last line, which its reader drops."""
    path = Path(path)
    created = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_path(path.parent)
