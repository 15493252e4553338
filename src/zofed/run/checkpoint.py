"""Atomic checkpoints: a checkpoint directory is written whole beside the old one (`NAME.tmp`) and published with
zofed.atomic_files.publish_directory, the old one waiting at `NAME.old` until the new one is in place, so a crash at
any moment leaves the previous or the new checkpoint intact, never a half-written one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from zofed.atomic_files import publish_directory


def _previous(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


def save_checkpoint(directory: Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
    """`tensors` maps a file stem (e.g. "trainable", "optimizer") to its named tensors."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed writer's; a run directory has one writer
    tmp.mkdir(parents=True)
    for stem, named in tensors.items():
        save_file({k: v.contiguous() for k, v in named.items()}, str(tmp / f"{stem}.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # flushed with the directory when it is published
    publish_directory(tmp, directory, aside=_previous(directory))


def find_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint at `directory`, or the previous one if a swap was interrupted."""
    for candidate in (Path(directory), _previous(Path(directory))):
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
