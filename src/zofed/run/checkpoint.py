"""Atomic checkpoints: a checkpoint directory is written beside the old one and swapped in with renames, each flushed
to disk before the rename that publishes it, so a crash at any moment leaves the previous or the new checkpoint
intact, never a half-written one. Single files are replaced whole and logs appended through zofed.atomic_files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from zofed.atomic_files import fsync_path, write_atomic_text


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
