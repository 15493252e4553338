"""Test-wide settings.

Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP workers that spin
while another process holds the cores make each forward pass ~100x slower; one thread keeps the unit
tests fast and steady. Integration tests with real models raise it again through `all_threads`.
"""

import os

import pytest
import torch

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
