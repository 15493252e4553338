"""Files and directories replaced whole, or files appended line by line, so that a crash or a power cut at any
moment leaves the previous or the new version intact, never a half-written one: the project's one way to write
what must survive. A leaf module (it imports nothing of zofed's), so every layer that writes files can use it."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
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


def _fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def publish_directory(staged: Path, target: Path, *, aside: Path | None = None) -> None:
    """Put the complete directory `staged` in place as `target`: the project's one way to replace a directory.

    Everything under `staged` is flushed to disk before the rename that publishes it, and the parent after it,
    so a crash or a power cut leaves the old `target` or the new one, never part of one.
    - `aside` None: `target` must be absent or an empty directory. The rename itself checks this, so a directory
      that filled up since the caller looked is never lost: it raises FileExistsError instead.
    - `aside` given (a path on the same filesystem, normally a sibling): an existing `target` is renamed to
      `aside` first, over any leftover there, and deleted once the new one is in place. A crash between the two
      renames leaves `target` absent and the old version whole at `aside`, for the caller to recover from or
      clear (a later call clears it too, once its new version is in place); an error in the second rename puts
      the old version back."""
    staged, target = Path(staged), Path(target)
    aside = None if aside is None else Path(aside)
    _fsync_tree(staged)
    moved = False
    if aside is not None and target.exists():
        shutil.rmtree(aside, ignore_errors=True)  # `target` is whole, so a leftover here is not needed
        os.replace(target, aside)
        fsync_path(aside.parent)  # the old version is safe at `aside` before `target` names the new one
        moved = True
    try:
        os.replace(staged, target)  # POSIX renames a directory over an empty one only
    except OSError as error:
        if moved:
            with contextlib.suppress(OSError):  # failing that, the old version stays whole at `aside`
                os.replace(aside, target)
        if aside is None and target.is_dir() and any(target.iterdir()):
            raise FileExistsError(f"{target} is not empty; {staged} was not published over it") from error
        raise
    fsync_path(target.parent)
    if aside is not None:  # the new version is on disk: the old one goes, moved now or by a crashed earlier call
        shutil.rmtree(aside, ignore_errors=True)
