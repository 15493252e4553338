"""Data sets from the Hugging Face hub (`data.source: hub:NAME[:CONFIG][[SPLIT]]`): download and conversion.

Kept apart from the local-file readers (sources.py) because it is the only data path that needs a network;
`datasets` is slow to import, so `load_hub` imports it only when a source names the hub (spec.py decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .dataset import DataError, TextDataset
from .sources import Record, records_to_dataset, resolve_columns


def load_hub(
    name: str,
    split: str,
    *,
    config: str | None = None,
    text_columns: Sequence[str] | None = None,
    label_column: str | None = "label",
    label_names: Sequence[str] | None = None,
    optional_columns: Sequence[str] = (),
) -> TextDataset:
    """Load a split of a Hugging Face hub data set (needs network or a warm local cache).

    ``split`` is any split expression ``datasets`` accepts ("test", "train[:10%]"). Label names come from
    the data set's ClassLabel feature when it has one.
    """
    import datasets  # imported lazily: it is slow to import and only needed here
    from huggingface_hub.errors import HfHubHTTPError

    spec = f"hub:{name}" + (f":{config}" if config else "")
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except (ConnectionError, TimeoutError, FileNotFoundError, HfHubHTTPError) as e:
        # FileNotFoundError covers DatasetNotFoundError and LocalEntryNotFoundError (offline, no cache).
        raise DataError(
            f"hub:{name}: the Hugging Face hub is unreachable or has no such data set "
            f"({type(e).__name__}: {e}). Local files work offline: pass a .csv/.tsv/.jsonl/.json/.txt path "
            "(set HF_HUB_OFFLINE=1 to fail fast without retries)."
        ) from e
    except ValueError as e:
        if "split" not in str(e).lower():
            raise
        # datasets says 'Unknown split "tst". Should be one of [...]' (or rejects a bad split expression).
        raise DataError(f"{spec}: cannot load split {split!r} ({e}); name the split as {spec}[SPLIT]") from e
    return hf_to_text_dataset(
        ds,
        source=f"{spec}[{split}]",
        text_columns=text_columns,
        label_column=label_column,
        label_names=label_names,
        optional_columns=optional_columns,
    )


def hf_to_text_dataset(
    ds: Any,
    *,
    source: str,
    text_columns: Sequence[str] | None = None,
    label_column: str | None = "label",
    label_names: Sequence[str] | None = None,
    optional_columns: Sequence[str] = (),
) -> TextDataset:
    """Convert a loaded ``datasets.Dataset`` (kept separate from the download so it is testable offline)."""
    columns = resolve_columns(
        source, "features", ds.column_names, text_columns, label_column, optional_columns
    )
    records: list[Record] = [(f"row {i}", row) for i, row in enumerate(ds, start=1)]
    feature = ds.features.get(label_column) if label_column is not None else None
    class_names = getattr(feature, "names", None)
    if class_names is None:
        return records_to_dataset(
            source, records, columns, label_column, label_names, optional_columns, source
        )
    # ClassLabel: values already are indices into its names; -1 marks an unlabelled (e.g. GLUE test) row.
    unlabelled = [where for where, row in records if row[label_column] == -1]
    if unlabelled:
        raise DataError(
            f"{source}, {unlabelled[0]}: label -1 (this split is unlabelled); "
            "use a labelled split or label_column=None"
        )
    texts = records_to_dataset(source, records, columns, None, None, optional_columns, source)
    return TextDataset(
        fields=texts.fields,
        labels=[int(row[label_column]) for _, row in records],
        label_names=list(label_names) if label_names is not None else list(class_names),
        name=source,
    )


# Options that only mean something for a local file; a hub data set has no file format, encoding or lines.
FILE_ONLY_OPTIONS = ("format", "encoding", "on_bad_lines")


def parse_hub_source(source: str) -> tuple[str, str | None, str | None]:
    """Split ``hub:NAME[:CONFIG][[SPLIT]]`` into (name, config, split); None for the parts not given.

    e.g. ``hub:imdb[test]``, ``hub:glue:sst2[validation]``, ``hub:imdb[train[:10%]]`` (a datasets slice).
    """
    rest = source.removeprefix("hub:")
    split = None
    if rest.endswith("]") and "[" in rest:
        # The first "[" opens the split: hub names and config names never hold one, slices like train[:10%] do.
        rest, _, split = rest[:-1].partition("[")
        if not split.strip():
            raise DataError(f"{source}: empty split in brackets; write e.g. hub:NAME[test]")
    elif "[" in rest or "]" in rest:
        raise DataError(f"{source}: a split goes in brackets at the end, e.g. hub:NAME[test] or hub:NAME:CONFIG[test]")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"{source}: no data set name after 'hub:'")
    return name, config or None, split
