"""Split one data set among federated clients: IID, label skew, pathological, quantity skew, natural groups.

"iid", "dirichlet", "pathological" and "natural" are flwr-datasets' partitioners, run on a table of each example's
index and label (or column value) that the random schemes shuffle first, as Flower's FederatedDataset does.
"dirichlet-mix" (a Dirichlet label mix per client) and "quantity" (Dirichlet client sizes) have no flwr-datasets
counterpart and are written here, as are the redraw until every client has ``min_size`` examples, each client's
local test split, the summary table and the plot.

Deterministic: the only randomness is the partition's streams (``zofed.streams``, seeded from ``partition.seed``;
the flwr-datasets partitioners take their seeds from them). A partition is a list of sorted index arrays into the
data set, one per client, disjoint and covering every example; a config that cannot give each client ``min_size``
examples raises :class:`PartitionError` saying what to change.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zofed import streams
from zofed.atomic_files import write_atomic_text

from .dataset import TextDataset

if TYPE_CHECKING:
    import datasets

Scheme = Literal["iid", "dirichlet", "dirichlet-mix", "pathological", "quantity", "natural"]
MAX_DRAWS = 100  # Dirichlet redraws before giving up on min_size
MAX_TABLE_ROWS = 20
_MAX_LABEL_COLUMNS = 8  # wider label sets get a "classes" column instead of one column per label


class PartitionError(ValueError):
    """A partition that cannot be made as configured; the message says which client and what to change."""


class PartitionConfig(BaseModel):
    """How to split a data set among clients (validated: unknown keys and out-of-range values are rejected).

    ``alpha`` is the Dirichlet concentration: over clients per class for "dirichlet" (label skew, Hsu et al.), over
    each client's label mix for "dirichlet-mix" (label skew with equal client sizes: every client gets examples
    however many clients and however small alpha, where "dirichlet" leaves clients empty), over client sizes for
    "quantity"; small alpha means strong skew. "natural" makes one client per distinct
    value of ``fields[i][column]`` and ignores ``num_clients``: read the client count from the result. The label-skew
    schemes ("dirichlet", "dirichlet-mix", "pathological") skew the labels, or with ``column`` that field's values
    (Dolly's categories: "dirichlet" with ``column=category`` mixes each client's categories by Dir(alpha)).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Scheme = "dirichlet"
    num_clients: int = Field(10, ge=1)
    alpha: float = Field(0.5, gt=0)
    classes_per_client: int = Field(2, ge=1)
    column: str | None = None
    min_size: int = Field(2, ge=1)
    test_fraction: float = Field(0.2, ge=0, lt=1)
    seed: int = Field(0, ge=0)  # numpy seeds must be non-negative

    @model_validator(mode="after")
    def _natural_needs_column(self) -> PartitionConfig:
        if self.scheme == "natural" and not self.column:
            raise ValueError("scheme 'natural' needs column= (the field whose value defines the client)")
        if self.scheme in ("iid", "quantity") and self.column:
            raise ValueError(f"scheme {self.scheme!r} ignores column={self.column!r}; column names the field that "
                             "'natural' and the label-skew schemes (dirichlet, dirichlet-mix, pathological) split by")
        return self


@dataclass
class ClientSplit:
    """One client's local train/test indices into the original data set (both sorted)."""

    client_id: int
    train: np.ndarray
    test: np.ndarray


# --------------------------------------------------------------------------------------------------
# Partitioning


def partition(data: TextDataset, config: PartitionConfig) -> list[np.ndarray]:
    """Index arrays into ``data``, one per client: sorted, disjoint, together covering every example."""
    # flwr-datasets and datasets are slow to import (seaborn, pandas) and needed only here.
    from flwr_datasets import partitioner as flwr

    n, k = len(data), config.num_clients
    if n == 0:
        raise PartitionError(f"{data.name}: no examples to partition")
    if config.scheme == "natural":
        codes = _column_codes(data, config.column or "", "natural")  # client i holds the i-th distinct value
        with contextlib.redirect_stderr(io.StringIO()):  # NaturalIdPartitioner draws a tqdm bar over the examples
            parts = list(_read(flwr.NaturalIdPartitioner(partition_by="label"), _table(codes)))
    else:
        if n < k * config.min_size:
            # No redraw can help, so say so at once instead of after MAX_DRAWS attempts.
            raise PartitionError(
                f"{data.name}: {n} examples cannot give {k} clients at least "
                f"min_size={config.min_size} each; lower num_clients or min_size"
            )
        rng = streams.partition(config.seed)
        if config.scheme == "iid":
            parts = list(_read(flwr.IidPartitioner(k), _table(np.zeros(n, np.int64)).shuffle(generator=rng)))
        elif config.scheme == "dirichlet":
            table = _table(_labels(data, "dirichlet", config.column)).shuffle(generator=rng)
            draw = partial(flwr.DirichletPartitioner, k, "label", config.alpha, min_partition_size=0, shuffle=False)
            parts = _redraw(lambda: _read(draw(seed=int(rng.integers(2**32))), table), data, config)
        elif config.scheme == "pathological":
            table = _table(_pathological_labels(_labels(data, "pathological", config.column), config, rng))
            # The deterministic assignment draws nothing, so the partitioner needs no seed.
            parts = list(_read(flwr.PathologicalPartitioner(
                k, "label", config.classes_per_client, class_assignment_mode="deterministic", shuffle=False
            ), table.shuffle(generator=rng)))
        elif config.scheme == "dirichlet-mix":
            parts = _dirichlet_mix(_labels(data, "dirichlet-mix", config.column), k, config.alpha, rng)
        else:  # quantity
            parts = _redraw(lambda: _quantity_once(n, k, config.alpha, rng), data, config)
    parts = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    _check(parts, n, data, config)
    return parts


def _table(labels: np.ndarray) -> datasets.Dataset:
    """The table a flwr-datasets partitioner splits: each example's index and the label it partitions by. In arrow
    format, since the partitioners' numpy conversion of a column goes row by row in any other (seconds per draw)."""
    import datasets

    return datasets.Dataset.from_dict({"index": np.arange(len(labels)), "label": labels}).with_format("arrow")


def _read(partitioner: Any, table: datasets.Dataset) -> Iterator[np.ndarray]:
    """Each partition's example indices, client by client. flwr-datasets says what it refused in a ValueError."""
    partitioner.dataset = table
    try:
        for client in range(partitioner.num_partitions):
            yield np.asarray(partitioner.load_partition(client)["index"])
    except ValueError as error:
        raise PartitionError(f"flwr-datasets' {type(partitioner).__name__} refused the partition: {error}") from error


def _labels(data: TextDataset, scheme: str, column: str | None = None) -> np.ndarray:
    """The class of each example: its label, or with `column` the index of its value of that field."""
    if column:
        return _column_codes(data, column, scheme)
    if data.labels is None:
        raise PartitionError(
            f"{data.name}: scheme {scheme!r} splits by label but the data set is unlabelled; "
            "use scheme 'iid' or 'quantity' (or 'natural' with a column)"
        )
    return np.asarray(data.labels, dtype=np.int64)


def _pathological_labels(labels: np.ndarray, config: PartitionConfig, rng: np.random.Generator) -> np.ndarray:
    """The classes renumbered in a random order: the deterministic assignment gives client i the classes i, i + 1,
    ..., i + classes_per_client - 1 (mod the class count), so the renumbering decides who holds what. Only classes
    present in the data count: a client holding just absent classes would be empty."""
    classes, codes = np.unique(labels, return_inverse=True)
    k, cpc = config.num_clients, config.classes_per_client
    if cpc > len(classes):
        raise PartitionError(
            f"pathological: classes_per_client={cpc} but the data has only {len(classes)} classes; "
            f"use classes_per_client <= {len(classes)}"
        )
    if k + cpc - 1 < len(classes):
        raise PartitionError(
            f"pathological: {k} clients holding {cpc} consecutive classes each cover only {k + cpc - 1} of "
            f"{len(classes)} classes, leaving examples unassigned; raise num_clients or classes_per_client"
        )
    return rng.permutation(len(classes))[codes]


def _dirichlet_mix(labels: np.ndarray, k: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client draws its label mix q ~ Dir(alpha * 1_C) and takes n/K examples by it from the shuffled class
    pools; what an emptied pool cannot give is taken from the others in proportion to q (then to what is left)."""
    classes = np.unique(labels)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    sizes = [len(p) for p in np.array_split(np.arange(len(labels)), k)]
    parts = []
    for size in sizes:
        q = rng.dirichlet(np.full(len(classes), alpha))
        want = rng.multinomial(size, q)
        left = np.array([len(p) for p in pools])
        take = np.minimum(want, left)
        while take.sum() < size:  # an exhausted class: give its share to classes that still have examples
            room = left - take
            weights = np.where(room > 0, q + 1e-12, 0.0)
            extra = rng.multinomial(size - take.sum(), weights / weights.sum())
            take = np.minimum(take + extra, left)
        part = []
        for c, count in enumerate(take):
            part += pools[c][:count]
            pools[c] = pools[c][count:]
        parts.append(np.asarray(part, dtype=np.int64))
    return parts


def _quantity_once(n: int, k: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    cuts = (np.cumsum(rng.dirichlet(np.full(k, alpha))) * n).astype(np.int64)[:-1]
    return np.split(rng.permutation(n), cuts)


def _redraw(draw: Callable[[], Iterable[np.ndarray]], data: TextDataset, config: PartitionConfig) -> list[np.ndarray]:
    """Draw until every client has min_size examples, dropping a draw at its first short client (reading a
    flwr-datasets partition costs milliseconds). DirichletPartitioner's own min_partition_size gives up after 11
    draws, warning at each, and does not name the short client, hence this loop."""
    for _ in range(MAX_DRAWS):
        parts = []
        for part in draw():
            parts.append(part)
            if len(part) < config.min_size:
                break
        else:
            return parts
    client, size = len(parts) - 1, len(parts[-1])
    got = "no examples" if size == 0 else f"only {size} examples (min_size={config.min_size})"
    raise PartitionError(
        f"each of {MAX_DRAWS} draws left a client short; in the last, client {client} would get {got} "
        f"({config.scheme} alpha={config.alpha}, {config.num_clients} clients, {len(data)} examples); lower "
        "num_clients or min_size, or raise alpha"
    )


def _column_codes(data: TextDataset, column: str, scheme: str) -> np.ndarray:
    """Each example's value of `column` as the index of that value in sorted order (stable across runs and file
    orders)."""
    values = []
    for i, example in enumerate(data.fields):
        if column not in example:
            raise PartitionError(
                f"{data.name}: {scheme} partition by column {column!r}, but example {i} has no such field; "
                f"available fields: {sorted(example)}"
            )
        values.append(example[column])
    groups = {v: g for g, v in enumerate(sorted(set(values)))}
    return np.array([groups[v] for v in values], dtype=np.int64)


def _check(parts: list[np.ndarray], n: int, data: TextDataset, config: PartitionConfig) -> None:
    for client, p in enumerate(parts):
        if len(p) < config.min_size:
            got = "no examples" if len(p) == 0 else f"only {len(p)} examples (min_size={config.min_size})"
            raise PartitionError(
                f"client {client} would get {got} ({config.scheme}, {len(parts)} clients, {n} examples "
                f"in {data.name}); lower num_clients or min_size"
            )
    # Overlap or loss of examples is a bug in this module, not a user mistake, hence not PartitionError.
    if not np.array_equal(np.sort(np.concatenate(parts)), np.arange(n)):
        raise RuntimeError(f"{config.scheme} partition is not disjoint and covering; this is a bug")


def client_splits(data: TextDataset, config: PartitionConfig) -> list[ClientSplit]:
    """Partition, then split each client's examples into local train/test for personalized evaluation.

    A client of n examples gets ``round(test_fraction * n)`` test examples, at least 1 when
    ``test_fraction > 0`` and n >= 2, always leaving at least 1 for training.
    """
    splits = []
    for client, part in enumerate(partition(data, config)):
        n = len(part)
        n_test = round(config.test_fraction * n)
        if config.test_fraction > 0 and n >= 2:
            n_test = max(n_test, 1)
        n_test = min(n_test, n - 1)
        # A stream per client: a client's split does not change when other clients' sizes do.
        perm = streams.client_test_split(config.seed, client).permutation(part)
        splits.append(ClientSplit(client, train=np.sort(perm[n_test:]), test=np.sort(perm[:n_test])))
    return splits


# --------------------------------------------------------------------------------------------------
# Reporting


def _entropy_bits(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


def summarize(data: TextDataset, parts: Sequence[np.ndarray]) -> dict[str, Any]:
    """Per-client size, label counts and label entropy (bits), plus overall statistics.

    Keys: ``clients`` (list of {client, size, label_counts, entropy}), ``num_clients``, ``num_examples``,
    ``num_labels``, ``size_min``/``size_median``/``size_max``, ``mean_entropy``, ``global_entropy``.
    Label fields are None for unlabelled data.
    """
    labels = None if data.labels is None else np.asarray(data.labels, dtype=np.int64)
    num_labels = None if data.label_names is None else len(data.label_names)
    clients = []
    for client, part in enumerate(parts):
        row: dict[str, Any] = {"client": client, "size": len(part), "label_counts": None, "entropy": None}
        if labels is not None:
            counts = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_labels)
            row["label_counts"], row["entropy"] = counts.tolist(), _entropy_bits(counts)
        clients.append(row)
    sizes = [row["size"] for row in clients]
    labelled = labels is not None and bool(clients)
    return {
        "clients": clients,
        "num_clients": len(clients),
        "num_examples": int(sum(sizes)),
        "num_labels": num_labels,
        "size_min": min(sizes, default=0),
        "size_median": float(np.median(sizes)) if sizes else 0.0,
        "size_max": max(sizes, default=0),
        "mean_entropy": float(np.mean([row["entropy"] for row in clients])) if labelled else None,
        "global_entropy": _entropy_bits(np.bincount(labels, minlength=num_labels)) if labels is not None else None,
    }


def format_summary(summary: dict[str, Any], label_names: list[str] | None = None) -> str:
    """A compact plain-text table (clients as rows, the first 20 shown) with an overall line at the end."""
    num_labels = summary["num_labels"]
    labelled = summary["mean_entropy"] is not None
    names = [str(c) for c in range(num_labels or 0)]
    if label_names is not None and len(label_names) == len(names):
        names = list(label_names)
    per_label = labelled and num_labels <= _MAX_LABEL_COLUMNS
    header = ["client", "size"]
    if labelled:
        header += ["H bits"] + ([n[:10] for n in names] if per_label else ["classes"])
    rows = []
    for row in summary["clients"][:MAX_TABLE_ROWS]:
        cells = [str(row["client"]), str(row["size"])]
        if labelled:
            counts = row["label_counts"]
            cells.append(f"{row['entropy']:.2f}")
            cells += [str(c) for c in counts] if per_label else [str(sum(c > 0 for c in counts))]
        rows.append(cells)
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(header)]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(cells, widths, strict=True)) for cells in [header, *rows]]
    hidden = summary["num_clients"] - MAX_TABLE_ROWS
    if hidden > 0:
        lines.append(f"... {hidden} more clients")
    overall = (
        f"{summary['num_clients']} clients, {summary['num_examples']} examples; size min/median/max "
        f"{summary['size_min']}/{summary['size_median']:g}/{summary['size_max']}"
    )
    if labelled:
        overall += (
            f"; label entropy mean {summary['mean_entropy']:.2f} bits "
            f"(global {summary['global_entropy']:.2f}, max {math.log2(num_labels):.2f})"
        )
    lines.append(overall)
    return "\n".join(lines)


def plot_partition(
    data: TextDataset, parts: Sequence[np.ndarray], path: str | Path, *, title: str | None = None
) -> Path:
    """Save a stacked horizontal bar chart of label counts per client (one bar per client) as PNG."""
    # matplotlib is slow to import and only needed here. Figure without pyplot renders through Agg
    # and leaves the process-wide backend alone.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    summary = summarize(data, parts)
    k = summary["num_clients"]
    fig = Figure(figsize=(8, min(2 + 0.25 * k, 40)))
    ax = fig.subplots()
    y = np.arange(k)
    if data.labels is None:
        ax.barh(y, [row["size"] for row in summary["clients"]], color="tab:blue")
    else:
        counts = np.array([row["label_counts"] for row in summary["clients"]]).reshape(k, -1)
        names = data.label_names or []
        # tab20 pairs light and dark shades of one hue, which makes neighbouring classes look alike.
        cmap = colormaps["tab10" if counts.shape[1] <= 10 else "tab20"]
        left = np.zeros(k)
        for c in range(counts.shape[1]):
            ax.barh(y, counts[:, c], left=left, label=names[c], color=cmap(c % cmap.N))
            left += counts[:, c]
        if counts.shape[1] <= 20:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    ax.set_yticks(y if k <= 50 else y[:: math.ceil(k / 50)])
    ax.invert_yaxis()  # client 0 on top, as in the text table
    ax.set_xlabel("examples")
    ax.set_ylabel("client")
    ax.set_title(title or f"{data.name}: {k} clients")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    write_atomic_text(path, png.getvalue())  # a run's output: whole or the previous one, even if killed
    return path
