"""Remembered body features: with every block of a decoder frozen, an example's input to the final norm at its last
position never changes during a run, so the model's body runs once per example and every later loss or evaluation
reads the label head off the remembered row.

Rows are keyed by the example's token ids (so a template, truncation or dataset change is a new key) and belong
to one model: the fingerprint hashes the frozen weights. A store directory (ZOFED_FEATURE_STORE) keeps them across
runs of the same model, one file per fingerprint, merged under a lock so that runs side by side add to it.

This saves the simulator's time, not a client's: the compute a run reports is still what each client would run
(`forward_equivalents`), whatever the simulator remembered.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from zofed.atomic_files import write_atomic_text
from zofed.zo.prefix import PrefixCache

STORE_VARIABLE = "ZOFED_FEATURE_STORE"  # the directory that keeps remembered rows across runs (unset: none does)
KEY_BYTES = 16
# In a store file's name: rows computed each alone (see lookup). Stores of rows computed in padded batches, whose
# last bits depended on the batch, carry no such mark and are left unread.
ROWS_ALONE = "alone"


def example_key(ids: Sequence[int] | np.ndarray) -> bytes:
    """An example's key: a hash of its token ids."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=KEY_BYTES).digest()


def fingerprint(model: torch.nn.Module, trainable_names: Sequence[str]) -> str:
    """A hash of the model's frozen tensors (names, shapes, dtypes, values): two models share remembered features
    only when their bodies compute the same thing."""
    trainable = set(trainable_names)  # what trains does not shape the features
    return tensor_digest((name, t) for name, t in sorted(model.state_dict().items()) if name not in trainable)


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash of named tensors: their names, shapes, dtypes and values, in the order given."""
    digest = hashlib.blake2b(digest_size=12)
    for name, tensor in named:
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class BodyFeatures:
    """The frozen body's last-position features of every example seen, computed once each."""

    def __init__(self, cache: PrefixCache, store: Path | None = None, model_fingerprint: str | None = None) -> None:
        if cache.start != len(cache.layers):
            raise ValueError(f"remembered features need every block frozen; the trainable tensors start at block "
                             f"{cache.start} of {len(cache.layers)}")
        if store is not None and model_fingerprint is None:
            raise ValueError("a features store needs the model's fingerprint")
        self.cache = cache
        self.device = next(cache.backbone.parameters()).device
        self.rows: dict[bytes, int] = {}
        self.features: list[torch.Tensor] = []  # one row each, in the order of `rows`
        self.store = None if store is None else Path(store) / f"{model_fingerprint}.{ROWS_ALONE}.safetensors"
        self.computed = 0  # examples this memo ran through the body (the rest were remembered or loaded)
        self._saved = 0  # rows already in the store file when last loaded or saved
        if self.store is not None and self.store.exists():
            self._add(*_read(self.store))
            self._saved = len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def _add(self, keys: Sequence[bytes], features: torch.Tensor) -> None:
        for key, row in zip(keys, features, strict=True):
            if key not in self.rows:
                self.rows[key] = len(self.features)
                self.features.append(row.to(self.device))

    def lookup(self, ids: Sequence[Sequence[int]], compute: Callable[[Sequence[int]], torch.Tensor]) -> torch.Tensor:
        """The features of the examples `ids` (token ids each); `compute(example_ids)` gives one unseen example's
        row (hidden), computed from that example alone.

        Alone, at its own length: a row computed inside a padded batch differs in its last bits from the same row
        computed alone (the reductions run over other shapes, and BLAS does not promise equal-length batches keep
        a row's bits either), so a row remembered from whichever batch first met it would make a resumed run, or
        one reading a warm store, differ from an uninterrupted one."""
        keys = [example_key(row) for row in ids]
        for key, row in zip(keys, ids, strict=True):
            if key not in self.rows:  # a batch may repeat an example: the first computes it
                self._add([key], compute(row).detach()[None])
                self.computed += 1
        return torch.stack([self.features[self.rows[k]] for k in keys])

    def save(self) -> None:
        """Merge the rows computed since the store was read into its file (atomically, under a lock)."""
        if self.store is None or len(self.rows) == self._saved:
            return
        self.store.parent.mkdir(parents=True, exist_ok=True)
        with open(self.store.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.store.exists():  # another run may have added rows since
                self._add(*_read(self.store))
            keys = torch.frombuffer(bytearray(b"".join(self.rows)), dtype=torch.uint8).view(-1, KEY_BYTES)
            features = torch.stack(self.features).cpu().contiguous()
            write_atomic_text(self.store, save({"keys": keys, "features": features}))
            self._saved = len(self.rows)


def _read(path: Path) -> tuple[list[bytes], torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            keys, features = f.get_tensor("keys"), f.get_tensor("features")
    except Exception as err:  # a truncated or foreign file: say which, rather than train on garbage
        raise ValueError(f"the features store {path} cannot be read ({err}); delete it to start afresh") from None
    if keys.ndim != 2 or keys.shape[1] != KEY_BYTES or len(keys) != len(features):
        raise ValueError(f"the features store {path} is not a zofed features file (keys {tuple(keys.shape)}, "
                         f"features {tuple(features.shape)}); delete it to start afresh")
    return [bytes(k.tolist()) for k in keys], features
