"""The fp32 safetensors cache of a model shipped as GGUF: built once, checksummed, swapped in atomically.

Converting a GGUF takes many times longer than loading the cache, so it is done once. A cache is built in a
temporary sibling directory and renamed into place only when complete and checked against the GGUF model,
so a crash never leaves a half-written cache; a cache whose manifest checksums fail is rebuilt.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zofed.atomic_files import publish_directory
from zofed.models.catalog import BuiltinModel, ModelLoadError, cache_dir, is_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

try:  # POSIX only; without it concurrent first builds just duplicate work, the rename stays atomic
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "zofed-manifest.json"
_MANIFEST_FORMAT = 1
_REQUIRED_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_PROBE_TEXT = "The capital of France is"

# Caches whose checksums were verified by this process, keyed by the size and mtime of every file, so a
# file rewritten since (same process or another) is hashed again.
_verified: set[tuple] = set()
_verified_lock = threading.Lock()
_gguf_patch_lock = threading.Lock()


def gguf_cache(name: str, builtin: BuiltinModel, gguf: Path) -> Path:
    """The directory of built-in `name`'s verified fp32 cache, built from `gguf` first if missing or corrupt."""
    return _cache_of(name, gguf, _gguf_source_info(builtin, gguf))


def gguf_file_cache(gguf: Path) -> Path:
    """The verified fp32 cache of a user's GGUF file (`--model path/to/file.gguf`), built once per file: the
    cache is named by the file's path and rebuilt when its size or modification time change."""
    gguf = gguf.resolve()
    if not is_gguf(gguf):
        with gguf.open("rb") as handle:
            start = handle.read(4)
        raise ModelLoadError(f"{gguf} is not a GGUF file (it starts with {start!r}, a GGUF file with b'GGUF'); "
                             f"a model is a built-in name, a directory written by save_pretrained, a GGUF file "
                             f"or a hub id")
    stat = gguf.stat()
    source = {"file": str(gguf), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = hashlib.sha256(str(gguf).encode()).hexdigest()[:12]
    return _cache_of(f"gguf-{gguf.stem}-{key}", gguf, source)


def _cache_of(name: str, gguf: Path, source: dict) -> Path:
    target = cache_dir() / "models" / name
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
        try:
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
        except OSError:
            raise
        except Exception as error:  # a truncated file, an unknown architecture or quantization: each its own type
            raise ModelLoadError(f"transformers cannot read {gguf} as a causal LM to dequantize: "
                                 f"{type(error).__name__}: {error}") from error
        gguf_model.eval()
        probe = tokenizer(_PROBE_TEXT, return_tensors="pt")
        with torch.no_grad():
            expected = gguf_model(**probe).logits[0, -1]

        # A GGUF-loaded model refuses save_pretrained (its quantizer is not serializable), so the weights
        # move into a plain model built from the same config minus the quantization entry.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        with no_init_weights():  # a random init would be overwritten right away
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # assign=True adopts the dequantized tensors instead of copying them; tie_weights afterwards, as
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
        # A corrupt cache waits beside it until the new one is in place; named like a staging directory, so the
        # next build's lock clears it if a crash leaves it there.
        publish_directory(staging, target, aside=target.with_name(f".{target.name}.tmp-old"))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    entries = {rel: (entry["size"], entry["sha256"]) for rel, entry in files.items()}
    with _verified_lock:
        _verified.add(_signature(target, entries))  # just hashed; no need to hash again this process


@contextlib.contextmanager
def _parse_gguf_once() -> Iterator[None]:
    """Memoize gguf's file parser and tensor-name map while transformers loads one GGUF.

    transformers parses the whole file three times (tokenizer, config, weights) and rebuilds gguf's name map for
    every submodule, most of a build's time. Both are pure functions of their arguments over a read-only memmap, so
    sharing results changes nothing. transformers looks both up on the gguf module at call time; should that change,
    this is merely ineffective.
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
    tied = getattr(reloaded.config.get_text_config(), "tie_word_embeddings", False)
    if tied and not torch.equal(head.weight, embed.weight):
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
