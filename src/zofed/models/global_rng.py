"""torch's global generator, seeded for a block of code and restored after, one block at a time in a process.

peft and transformers draw new weights (LoRA's A, an encoder's new head) from the global generator; a run seeds it
from its own stream (zofed.streams) so every party starts from the same weights. Two runs side by side in one
process would otherwise seed and draw from the one generator in turn, each getting the other's draws.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_GLOBAL_RNG = threading.Lock()


@contextlib.contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """torch's global generator seeded with `seed` for the block, and restored after."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
