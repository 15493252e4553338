"""Test-wide settings.

Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP workers that spin
while another process holds the cores make each forward pass ~100x slower; one thread keeps the unit
tests fast and steady. Integration tests with real models raise it again through `all_threads`.
"""

import json
import os
import time
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch

from zofed.models.registry import resolve_model_dir
from zofed.models.tiny import tiny_causal_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_DEFAULT_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture
def all_threads():
    torch.set_num_threads(_DEFAULT_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A $ZOFED_CACHE holding the SmolLM2 cache, built once per session with the hub offline."""
    root = tmp_path_factory.mktemp("zofed-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOFED_CACHE", str(root))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        start = time.perf_counter()
        directory = resolve_model_dir("smollm2-135m")
        print(f"\nSmolLM2 fp32 cache built in {time.perf_counter() - start:.1f} s")
    assert directory == root / "models" / "smollm2-135m"
    return root


POSITIVE = ["good", "great"]
NEGATIVE = ["bad", "awful"]


def _write_dataset(path, n, seed):
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            label = int(rng.integers(2))
            word = rng.choice(POSITIVE if label else NEGATIVE)
            filler = " ".join(f"w{int(i)}" for i in rng.integers(0, 20, size=3))
            f.write(json.dumps({"text": f"the movie {filler} was {word}", "label": label}) + "\n")


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory):
    """A tiny random-init causal LM saved as a local model directory, and a toy sentiment data set."""
    root = tmp_path_factory.mktemp("finetune")
    tiny = tiny_causal_lm(seed=1)
    tiny.model.save_pretrained(root / "model")
    tiny.tokenizer.save_pretrained(root / "model")
    _write_dataset(root / "train.jsonl", 200, 0)
    _write_dataset(root / "test.jsonl", 60, 1)
    return root
