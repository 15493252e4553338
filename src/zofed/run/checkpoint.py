"""Atomic writes. A file is replaced whole (`write_atomic_text`) and a checkpoint directory is written beside the
old one and swapped in with renames, each flushed to disk before the rename that publishes it: a crash or a power
cut at any moment leaves the previous or the new version intact, never a half-written one. An append-only log
(`append_line`) flushes each line before it returns."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


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


def save_checkpoint(directory: Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
    """`tensors` maps a file stem (e.g. "trainable", "optimizer") to its named tensors."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for stem, named in tensors.items():
        save_file({k: v.contiguous() for k, v in named.items()}, str(tmp / f"{stem}.safetensors"))
        fsync_path(tmp / f"{stem}.safetensors")
    write_atomic_text(tmp / "meta.json", json.dumps(meta, indent=2))  # flushes tmp/ with it
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_path(directory.parent)  # the new checkpoint is in place before the old one goes
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint at `directory`, or the previous one if a swap was interrupted."""
    for candidate in (Path(directory), Path(directory).with_name(Path(directory).name + ".old")):
        if (candidate / "meta.json").is_file():
            return candidate
    return None


def load_checkpoint(directory: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    found = find_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {directory}")
    meta = json.loads((found / "meta.json").read_text())
    tensors = {f.stem: load_file(str(f)) for f in sorted(found.glob("*.safetensors"))}
    return tensors, meta
