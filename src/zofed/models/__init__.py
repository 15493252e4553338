"""Model loading: built-in offline models, local directories and hub ids (tiny test models: `zofed.models.tiny`)."""

from zofed.models.registry import (
    BUILTIN_MODELS,
    CAUSAL_LM,
    ENCODER,
    KINDS,
    BuiltinModel,
    LoadedModel,
    ModelLoadError,
    builtin_model_names,
    cache_dir,
    load_model,
    resolve_model_dir,
)

__all__ = [
    "BUILTIN_MODELS",
    "CAUSAL_LM",
    "ENCODER",
    "KINDS",
    "BuiltinModel",
    "LoadedModel",
    "ModelLoadError",
    "builtin_model_names",
    "cache_dir",
    "load_model",
    "resolve_model_dir",
]
