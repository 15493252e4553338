"""Model loading: built-in offline models, local directories, hub ids, and tiny test models."""

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
    tiny_causal_lm,
    tiny_encoder,
    tiny_tokenizer,
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
    "tiny_causal_lm",
    "tiny_encoder",
    "tiny_tokenizer",
]
