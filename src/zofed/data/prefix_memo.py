"""Remembered prefixes: with zo.cache: prefix, what the first trainable block receives for an example never changes
during a run, so the in-process simulator runs each example through the frozen bottom once and later steps on it run
only the top blocks.

A row is the hidden states at every position of one example, run alone at its own length: it never depends on the
batch that first met it, so a resumed run, or one whose clients draw other batches, reads the same bits. A step
assembles its batch from the rows, zero-padded on the right as the batch's collate pads (a padded position is a key
no real position attends to), and takes the rest of block `start`'s call (attention mask, positions, rotary
embeddings) from a pass over the embeddings alone (`PrefixCache.with_hidden`). A row differs from the same example
inside a padded batch in its last bits (the reductions run over other shapes), so a run with the memo ends within
rounding of one without it, not bit for bit.

Rows belong to one model's prefix: the fingerprint hashes the tensors below the split. It is taken when the first
row is computed and again whenever one of those tensors was written since (a tensor's version counter moved); rows
of other weights are dropped. A memo is never handed the split of a model whose prefix computes something else.

A store directory (ZOFED_FEATURE_STORE, as for body features) keeps the rows across runs of the same prefix: each
memo adds what it computed as a file of its own under `prefix.<fingerprint>.<start>.alone/` (never rewriting
another's, so runs side by side need no lock) and reads any row it lacks from the files there before computing it.
A stored row is the row a memo computes, bit for bit, at the same torch thread count.

This saves the simulator's time, not a client's: the compute a run reports is still what each client would run,
its capture pass included (`forward_equivalents`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Sequence
from itertools import chain
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from zofed.atomic_files import write_atomic_text
from zofed.data.body_features import KEY_BYTES, ROWS_ALONE, STORE_VARIABLE, example_key, tensor_digest
from zofed.zo.prefix import Prefix, PrefixCache

# the most memory the simulator spends on remembered rows: beyond it, steps run the frozen bottom as without a memo
MEMO_CAP_BYTES = 4 << 30
SAVE_EVERY_BYTES = 256 << 20  # computed rows a memo with a store writes out at once (and what is left at the end)
_BLOCK = re.compile(r"^layers\.(\d+)\.")

logger = logging.getLogger("zofed.sim")


def prefix_tensors(cache: PrefixCache) -> list[tuple[str, torch.Tensor]]:
    """The backbone's tensors that shape what block `start` receives, by name: all but those of the blocks from
    `start` up and of the final norm."""
    named = chain(cache.backbone.named_parameters(), cache.backbone.named_buffers())
    kept = []
    for name, tensor in named:
        block = _BLOCK.match(name)
        if name.startswith("norm.") or (block is not None and int(block.group(1)) >= cache.start):
            continue
        kept.append((name, tensor))
    return sorted(kept, key=lambda item: item[0])


def row_bytes(cache: PrefixCache, tokens: int) -> int:
    """The memory `tokens` positions of remembered rows take: one hidden state each."""
    embeddings = cache.backbone.get_input_embeddings()
    return tokens * embeddings.embedding_dim * embeddings.weight.element_size()


def right_padded_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's real length, for a mask whose rows are ones then zeros (right padding); a ValueError otherwise,
    as the rows would not sit where a remembered row is put."""
    lengths = attention_mask.sum(1)
    expected = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None] < lengths[:, None]
    if not torch.equal(attention_mask.bool(), expected):
        raise ValueError("remembered prefixes need right-padded batches (each mask row ones, then zeros)")
    return lengths.tolist()


class RowStore:
    """The rows of one prefix (fingerprint and split) kept on disk: files of keys, offsets and rows, each written
    whole by one memo, read a row at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index: dict[bytes, tuple[int, int, int]] = {}  # key -> (file, first position, end position)
        self.files: list = []  # open safetensors handles, in the index's numbering
        if directory.is_dir():
            for path in sorted(directory.glob("*.safetensors")):
                self._open(path)

    def _open(self, path: Path) -> None:
        try:
            handle = safe_open(str(path), framework="pt")
            keys, offsets = handle.get_tensor("keys"), handle.get_tensor("offsets")
        except Exception as err:  # a foreign or damaged file: say which, rather than train on garbage
            raise ValueError(f"the prefix store file {path} cannot be read ({err}); delete it to start afresh") \
                from None
        if keys.ndim != 2 or keys.shape[1] != KEY_BYTES or offsets.shape != (len(keys) + 1,):
            raise ValueError(f"the prefix store file {path} is not a zofed prefix file (keys "
                             f"{tuple(keys.shape)}, offsets {tuple(offsets.shape)}); delete it to start afresh")
        number = len(self.files)
        self.files.append(handle)
        bounds = offsets.tolist()
        blob = keys.numpy().tobytes()
        for k in range(len(keys)):
            self.index.setdefault(blob[k * KEY_BYTES:(k + 1) * KEY_BYTES], (number, bounds[k], bounds[k + 1]))

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self.index.get(key)
        if found is None:
            return None
        number, first, end = found
        return self.files[number].get_slice("rows")[first:end]

    def add(self, rows: dict[bytes, torch.Tensor]) -> None:
        """Write `rows` as a new file of the store."""
        if not rows:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        keys = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).view(-1, KEY_BYTES)
        lengths = torch.tensor([0] + [len(r) for r in rows.values()], dtype=torch.int64)
        values = torch.cat([r.cpu() for r in rows.values()]).contiguous()
        write_atomic_text(self.directory / f"{os.getpid()}-{secrets.token_hex(8)}.safetensors",
                          save({"keys": keys, "offsets": lengths.cumsum(0), "rows": values}))


class PrefixMemo:
    """What block `start` of one model receives for every example seen (all its positions, computed from the
    example alone), kept in memory, and across runs in `store` (a directory) when one is given.
    `PrefixCache(memo=...)` reads it in its capture pass."""

    def __init__(self, store: Path | None = None) -> None:
        self.rows: dict[bytes, torch.Tensor] = {}
        self.bytes = 0  # the memory the rows take
        self.computed = 0  # rows run through the frozen bottom (the rest of a batch's rows were remembered)
        self.loaded = 0  # rows read from the store
        self.dropped = 0  # times the rows were dropped because the frozen weights below the split changed
        self.fingerprint: str | None = None  # of the tensors below the split (None: no row yet)
        self.store = store
        self._stored: RowStore | None = None  # the store's rows of this prefix (bound with the fingerprint)
        self._unsaved: dict[bytes, torch.Tensor] = {}  # rows computed since the store was last written
        self._unsaved_bytes = 0
        self._cache: PrefixCache | None = None
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._versions: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def capture(self, cache: PrefixCache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefix:
        """The batch's prefix at `cache`'s split, assembled from the rows of its examples (computing those not seen
        yet, each alone)."""
        self._check(cache)
        lengths = right_padded_lengths(attention_mask)
        ids = input_ids.tolist()
        rows = [self._row(cache, row[:n], input_ids.device) for row, n in zip(ids, lengths, strict=True)]
        hidden = rows[0].new_zeros((len(rows), input_ids.shape[1], rows[0].shape[-1]))
        for k, row in enumerate(rows):
            hidden[k, : len(row)] = row
        return cache.with_hidden(hidden, input_ids, attention_mask)

    def _row(self, cache: PrefixCache, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        key = example_key(ids)
        row = self.rows.get(key)
        if row is None:
            row = None if self._stored is None else self._stored.get(key)
            if row is not None:
                row = row.to(device)
                self.loaded += 1
            else:
                alone = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
                prefix = cache.run_bottom(alone, torch.ones_like(alone))
                row = (prefix.args[0] if prefix.args else prefix.kwargs["hidden_states"])[0]
                self.computed += 1
                if self._stored is not None:
                    self._unsaved[key] = row
                    self._unsaved_bytes += row.numel() * row.element_size()
                    if self._unsaved_bytes >= SAVE_EVERY_BYTES:
                        self.save()
            self.rows[key] = row
            self.bytes += row.numel() * row.element_size()
        return row

    def save(self) -> None:
        """Write the rows computed since the last save to the store (nothing without one)."""
        if self._stored is not None:
            self._stored.add(self._unsaved)
        self._unsaved, self._unsaved_bytes = {}, 0

    def _bind_store(self, start: int) -> None:
        """Read the store's rows of this prefix (the fingerprint's and split's), when the memo keeps one."""
        self._unsaved, self._unsaved_bytes = {}, 0
        if self.store is not None:
            self._stored = RowStore(Path(self.store) / f"prefix.{self.fingerprint}.{start}.{ROWS_ALONE}")

    def _check(self, cache: PrefixCache) -> None:
        """Bind the memo to `cache`'s split on first use; afterwards refuse a split whose prefix computes something
        else, and drop the rows when the tensors below the split were changed."""
        if self._cache is None or cache.backbone is not self._cache.backbone:
            tensors = prefix_tensors(cache)
            digest = tensor_digest(tensors)
            if self._cache is not None and (cache.start != self._cache.start or digest != self.fingerprint):
                raise ValueError(f"this memo holds the inputs of block {self._cache.start} of a model whose frozen "
                                 f"prefix hashes to {self.fingerprint}; the cache splits at block {cache.start} of "
                                 f"one hashing to {digest}: its rows would be another model's")
            first = self._cache is None
            self._cache, self._tensors, self.fingerprint = cache, tensors, digest
            self._versions = _versions(tensors)
            if first:
                self._bind_store(cache.start)
        elif cache.start != self._cache.start:
            raise ValueError(f"this memo holds the inputs of block {self._cache.start}, not of block {cache.start}")
        elif _versions(self._tensors) != self._versions:  # a tensor below the split was written: hash it again
            digest = tensor_digest(self._tensors)
            if digest != self.fingerprint:
                logger.info("the frozen weights below block %d changed: %d remembered prefixes dropped",
                            cache.start, len(self.rows))
                self.save()  # the rows computed so far are the old prefix's: keep them under its fingerprint
                self.rows.clear()
                self.bytes = 0
                self.dropped += 1
                self.fingerprint = digest
                self._bind_store(cache.start)
            self._versions = _versions(self._tensors)


def _versions(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]]:
    """Where each tensor's values live and how often they were written in place: a cheap test of "unchanged"."""
    return [(t.data_ptr(), t._version) for _, t in tensors]


def simulation_memo(cache: PrefixCache, tokens: int, cap: int = MEMO_CAP_BYTES) -> PrefixMemo | None:
    """A memo for a simulation whose clients hold `tokens` tokens in all, keeping its rows in the store directory
    ZOFED_FEATURE_STORE names when it is set; None, said once in the log, when their rows could take more than
    `cap` bytes, or when the model's blocks are not all called alike (the batch's call of block `start` could not
    be rebuilt)."""
    need = row_bytes(cache, tokens)
    if need > cap:
        logger.info("the frozen prefix of the clients' %d tokens would take %.2f GiB to remember, more than the "
                    "%.2f GiB the simulator spends: every step runs its batch through the frozen bottom",
                    tokens, need / 2**30, cap / 2**30)
        return None
    if not cache.shares_block_arguments():
        logger.info("this model calls its blocks with different masks (config.layer_types): every step runs its "
                    "batch through the frozen bottom, none is remembered")
        return None
    store = os.environ.get(STORE_VARIABLE) or None
    return PrefixMemo(None if store is None else Path(store))
