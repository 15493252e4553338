"""A data set in memory: examples as text fields with optional class indices, and the one error type for bad
data (its message names the file and the line, so a user can open the file and fix it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from zofed import streams


class DataError(ValueError):
    """Bad or unreachable data; the message says where (file, line) and what is wrong."""


@dataclass
class TextDataset:
    """Examples as text fields plus optional class indices.

    ``fields[i]`` maps a field name ("text", or "premise"/"hypothesis", or "instruction"/"context"/
    "response") to its text; ``labels[i]`` indexes ``label_names``; ``labels`` is None for unlabelled
    or instruction data.
    """

    fields: list[dict[str, str]]
    labels: list[int] | None
    label_names: list[str] | None
    name: str
    # Where the bad lines (or items) that on_bad_lines="skip" left out were, e.g. ["line 3"]; a loaded file's
    # record, not carried into subsets or splits.
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Catch inconsistent construction here rather than as an IndexError during training.
        if self.labels is not None:
            if len(self.labels) != len(self.fields):
                raise DataError(f"{self.name}: {len(self.labels)} labels for {len(self.fields)} examples")
            if self.label_names is None:
                raise DataError(f"{self.name}: labels given without label_names")
            bad = [y for y in self.labels if not 0 <= y < len(self.label_names)]
            if bad:
                raise DataError(
                    f"{self.name}: label {bad[0]} out of range for {len(self.label_names)} label_names"
                )

    def __len__(self) -> int:
        return len(self.fields)

    def subset(self, indices: Sequence[int]) -> TextDataset:
        idx = [int(i) for i in indices]
        labels = None if self.labels is None else [self.labels[i] for i in idx]
        return TextDataset(
            fields=[dict(self.fields[i]) for i in idx],
            labels=labels,
            label_names=None if self.label_names is None else list(self.label_names),
            name=self.name,
        )

    def train_test_split(self, test_size: int | float, seed: int) -> tuple[TextDataset, TextDataset]:
        """Random (not stratified) split; the same seed always gives the same split.

        ``test_size`` is a count (int) or a fraction in (0, 1) (float). Both parts keep file order.
        """
        n = len(self)
        if isinstance(test_size, float):
            if not 0.0 < test_size < 1.0:
                raise ValueError(f"test_size fraction must be in (0, 1), got {test_size}")
            n_test = round(n * test_size)
        else:
            n_test = int(test_size)
        if not 0 < n_test < n:
            raise ValueError(f"{self.name}: test_size {test_size} leaves no train or no test data (n={n})")
        perm = streams.held_out_split(seed).permutation(n)
        # Sorting keeps the original order inside each part, so printed subsets are easy to compare.
        test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        train, test = self.subset(train_idx.tolist()), self.subset(test_idx.tolist())
        train.name, test.name = f"{self.name}/train", f"{self.name}/test"
        return train, test

    def label_counts(self) -> list[int]:
        if self.labels is None or self.label_names is None:
            raise DataError(f"{self.name}: unlabelled data set has no label counts")
        return np.bincount(self.labels, minlength=len(self.label_names)).tolist()
