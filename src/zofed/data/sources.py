"""Text classification / instruction data sets from local files (the in-memory type is dataset.py; the hub's
loaders are in hub.py; spec.py reads a config's source and hands it to one or the other).

Every problem with the data itself raises :class:`DataError` whose message names the file and the
1-based line (or item/row) so a user can open the file and fix it, instead of a traceback from deep
inside a tokenizer.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from zofed.data.dataset import DataError, TextDataset

FORMATS = ("csv", "tsv", "jsonl", "json", "label-text")
_EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".txt": "label-text"}
_INT_RE = re.compile(r"[+-]?\d+")
OnBadLines = Literal["error", "skip"]
_SHOWN_SKIPS = 5  # skipped locations named in the warning; TextDataset.skipped holds them all

logger = logging.getLogger("zofed.data")


# --------------------------------------------------------------------------------------------------
# Reading files into records: (location, raw dict) pairs, the location being "line 7" or "item 3".

Record = tuple[str, Mapping[str, Any]]


class _BadLines:
    """What to do with a line (or item) that cannot be used: raise at once, or note it and leave it out."""

    def __init__(self, source: str, policy: str, *, hint: bool = True) -> None:
        if policy not in ("error", "skip"):
            raise DataError(f"{source}: on_bad_lines (data.on_bad_lines) must be 'error' or 'skip', got {policy!r}")
        self.source, self.policy = source, policy
        # Hub rows have no skip option, so only file loads point at it.
        self.hint = " (data.on_bad_lines=skip leaves such lines out)" if hint else ""
        self.skipped: list[tuple[str, str]] = []

    def __call__(self, where: str, problem: str) -> None:
        if self.policy == "error":
            raise DataError(f"{self.source}, {where}: {problem}{self.hint}")
        self.skipped.append((where, problem))

    def all_skipped(self) -> str:
        """For a "no examples" message: that every line was bad, when so."""
        return f" (all {len(self.skipped)} were bad lines, skipped)" if self.skipped else ""

    def report(self, dataset: TextDataset) -> TextDataset:
        if self.skipped:
            dataset.skipped = [where for where, _ in self.skipped]
            shown = ", ".join(dataset.skipped[:_SHOWN_SKIPS]) + (", ..." if len(self.skipped) > _SHOWN_SKIPS else "")
            first_where, first_problem = self.skipped[0]
            logger.warning("%s: skipped %d bad line(s) (on_bad_lines=skip): %s; the first: %s: %s", self.source,
                           len(self.skipped), shown, first_where, first_problem)
        return dataset


def _read_text(path: Path, encoding: str) -> str:
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    raw = path.read_bytes()
    # utf-8-sig: spreadsheet exports often start with a byte-order mark
    codec = "utf-8-sig" if encoding.lower().replace("_", "-") in ("utf-8", "utf8") else encoding
    try:
        return raw.decode(codec)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}, line {line}: not valid {encoding} (byte offset {e.start}: {e.reason}); "
            "re-save it as UTF-8 or set data.encoding to the file's encoding, e.g. data.encoding=cp1252 "
            "(encoding='cp1252' in Python)"
        ) from None
    except LookupError:
        raise DataError(f"{path}: unknown encoding {encoding!r} (data.encoding); use a Python codec name "
                        "such as utf-8, cp1252 or latin-1") from None


def _read_delimited(path: Path, text: str, delimiter: str, bad: _BadLines) -> tuple[list[str], list[Record]]:
    # TSV is read without quote handling: TSV fields cannot hold tabs anyway, and GLUE-style TSVs
    # contain unbalanced quote characters that a quote-aware parser would merge across lines.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting)
    header: list[str] | None = None
    records: list[Record] = []
    start = 1
    try:
        for row in reader:
            where, start = f"line {start}", reader.line_num + 1  # a quoted field may span lines
            if not row or all(not cell.strip() for cell in row):
                continue  # blank line
            if header is None:
                header = [h.strip() for h in row]
                continue
            if len(row) != len(header):
                bad(where, f"expected {len(header)} fields (as in the header), found {len(row)}"
                    + (" (unquoted comma in a field?)" if delimiter == "," and len(row) > len(header) else ""))
                continue
            records.append((where, dict(zip(header, row, strict=True))))
    except csv.Error as e:
        raise DataError(f"{path}, line {reader.line_num}: malformed {_kind(delimiter)} ({e})") from None
    if header is None:
        raise DataError(f"{path}: empty file, no header row")
    return header, records


def _kind(delimiter: str) -> str:
    return "TSV" if delimiter == "\t" else "CSV"


def _read_jsonl(text: str, bad: _BadLines) -> list[Record]:
    records: list[Record] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad(f"line {lineno}", f"invalid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict):
            bad(f"line {lineno}", f"expected a JSON object, found {type(obj).__name__}")
            continue
        records.append((f"line {lineno}", obj))
    return records


def _read_json(path: Path, text: str, bad: _BadLines) -> list[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        hint = (" (one object a line? --set data.format=jsonl; format='jsonl' in load_file)"
                if isinstance(data, dict) else "")
        raise DataError(f"{path}: expected a JSON array of objects, found {type(data).__name__}{hint}")
    records: list[Record] = []
    for i, obj in enumerate(data, start=1):
        if not isinstance(obj, dict):
            bad(f"item {i}", f"expected a JSON object, found {type(obj).__name__}")
            continue
        records.append((f"item {i}", obj))
    return records


def _read_label_text(text: str, text_column: str, bad: _BadLines) -> list[Record]:
    records: list[Record] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2:
            bad(f"line {lineno}", "expected 'LABEL TEXT', found no text after the label")
            continue
        if not _INT_RE.fullmatch(parts[0]):
            bad(f"line {lineno}", f"label {parts[0]!r} is not an integer")
            continue
        records.append((f"line {lineno}", {"label": parts[0], text_column: parts[1]}))
    return records


# --------------------------------------------------------------------------------------------------
# Records -> TextDataset


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None  # JSON true/false are not class indices
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        return int(value)
    return None


def _map_labels(
    source: str, raw: list[tuple[str, Any]], label_names: Sequence[str] | None, bad: _BadLines
) -> tuple[list[int | None], list[str]]:
    """Turn raw label values (with their locations) into class indices and label names.

    An unknown string label is a bad line: None in its place when it is skipped.
    """
    ints = [_as_int(v) for _, v in raw]
    if None not in ints:
        labels, names = _map_int_labels(source, [i for i in ints if i is not None], label_names)
        return list[int | None](labels), names
    strs = [str(v).strip() for _, v in raw]
    if label_names is None:
        names = sorted(set(strs))
    else:
        names = list(label_names)
        for (where, _), s in zip(raw, strs, strict=True):
            if s not in names:
                bad(where, f"unknown label {s!r}; expected one of {names}")
    index = {n: k for k, n in enumerate(names)}
    return [index.get(s) for s in strs], names


def _map_int_labels(
    source: str, ints: list[int], label_names: Sequence[str] | None
) -> tuple[list[int], list[str]]:
    distinct = sorted(set(ints))
    names = [str(d) for d in distinct] if label_names is None else list(label_names)
    if len(names) == len(distinct):
        # Sorted values -> 0..k-1: AG News classes 1..4 become 0..3; identity for files already 0..k-1.
        index = {d: k for k, d in enumerate(distinct)}
        return [index[i] for i in ints], names
    if all(0 <= i < len(names) for i in ints):
        return ints, names  # already class indices, some classes just absent from this file
    raise DataError(
        f"{source}: integer labels {distinct} do not fit {len(names)} label_names {names}: "
        f"expected values 0..{len(names) - 1} or exactly {len(names)} distinct values"
    )


def records_to_dataset(
    source: str,
    records: list[Record],
    text_columns: Sequence[str],
    label_column: str | None,
    label_names: Sequence[str] | None,
    optional_columns: Sequence[str],
    name: str,
    bad: _BadLines | None = None,
) -> TextDataset:
    bad = bad if bad is not None else _BadLines(source, "error", hint=False)
    if not records:
        raise DataError(f"{source}: no examples found{bad.all_skipped()}")
    if label_names is not None and len(set(label_names)) != len(label_names):
        raise DataError(f"{source}: label_names has duplicates: {list(label_names)}")
    optional = set(optional_columns)
    fields: list[dict[str, str]] = []
    raw_labels: list[tuple[str, Any]] = []
    for where, rec in records:
        example = _example(rec, where, text_columns, optional, label_column, bad)
        if example is None:
            continue
        fields.append(example)
        if label_column is not None:
            raw_labels.append((where, rec[label_column]))
    if label_column is None:
        dataset = TextDataset(fields=fields, labels=None, label_names=None, name=name)
    else:
        labels, names = _map_labels(source, raw_labels, label_names, bad)
        kept = [k for k, y in enumerate(labels) if y is not None]  # unknown labels of skipped lines are None
        dataset = TextDataset(fields=[fields[k] for k in kept], labels=[labels[k] for k in kept],
                              label_names=names, name=name)
    if not dataset.fields:
        raise DataError(f"{source}: no examples found{bad.all_skipped()}")
    return bad.report(dataset)


def _example(
    rec: Mapping[str, Any],
    where: str,
    text_columns: Sequence[str],
    optional: set[str],
    label_column: str | None,
    bad: _BadLines,
) -> dict[str, str] | None:
    """One record's text fields, or None when it is bad and skipped."""
    example: dict[str, str] = {}
    for col in text_columns:
        value = rec.get(col)
        if value is None and col not in optional:
            bad(where, f"missing column {col!r}")
            return None
        text = "" if value is None else str(value).strip()
        if not text and col not in optional:
            multi = len(text_columns) > 1
            bad(where, f"empty text in column {col!r}"
                + (f" (data.optional_columns=[{col}] lets it be empty)" if multi else ""))
            return None
        example[col] = text
    if label_column is not None:
        value = rec.get(label_column)
        if value is None or (isinstance(value, str) and not value.strip()):
            bad(where, f"missing label in column {label_column!r}")
            return None
    return example


def resolve_columns(
    source: str,
    where: str,
    available: Sequence[str],
    text_columns: Sequence[str] | None,
    label_column: str | None,
    optional_columns: Sequence[str],
) -> list[str]:
    """Default to a "text" column and check the requested columns exist, naming what is there."""
    if text_columns is None:
        if "text" not in available:
            raise DataError(
                f"{source}: no 'text' column; available columns: {list(available)}; "
                "choose with text_columns=[...]"
            )
        text_columns = ["text"]
    wanted = [c for c in text_columns if c not in optional_columns]
    if label_column is not None:
        wanted.append(label_column)
    missing = [c for c in wanted if c not in available]
    if missing:
        hint = " (label_column=None loads unlabelled data)" if label_column in missing else ""
        raise DataError(
            f"{source}, {where}: missing column(s) {missing}; available columns: {list(available)}{hint}"
        )
    return list(text_columns)


def load_file(
    path: str | Path,
    format: str | None = None,
    *,
    text_columns: Sequence[str] | None = None,
    label_column: str | None = "label",
    label_names: Sequence[str] | None = None,
    name: str | None = None,
    optional_columns: Sequence[str] = (),
    encoding: str = "utf-8",
    on_bad_lines: OnBadLines = "error",
) -> TextDataset:
    """Load a local csv / tsv / jsonl / json (array of objects) / label-text file.

    The format is inferred from the extension when not given (.txt means label-text: ``LABEL TEXT``
    a line). ``text_columns`` picks the text fields (default: the "text" column); ``label_column=None``
    loads unlabelled data; ``optional_columns`` lists text columns that may be missing or empty
    (e.g. Dolly's "context"); ``encoding`` is for legacy files (MR is cp1252).
    Integer labels become 0..k-1 in sorted order; string labels are indexed by ``label_names`` when
    given, else by their sorted distinct values.

    ``on_bad_lines="skip"`` leaves out lines (JSON items) that cannot be used (not JSON, a wrong field count,
    no text, no or an unknown label) instead of stopping at the first; it logs how many and where, and the
    result's ``skipped`` lists their locations. Problems of the whole file (encoding, header, columns) still stop.
    """
    path = Path(path)
    if format is None:
        format = _EXTENSIONS.get(path.suffix.lower())
        if format is None:
            raise DataError(
                f"{path}: cannot tell the format from the extension {path.suffix!r} (known: "
                f"{', '.join(_EXTENSIONS)}); name it: --set data.format=FORMAT (data.format in a config, format= in "
                f"load_file), FORMAT one of {', '.join(FORMATS)}"
            )
    if format not in FORMATS:
        raise DataError(f"{path}: unknown format {format!r}; accepted formats: {list(FORMATS)}")
    bad = _BadLines(str(path), on_bad_lines)
    text = _read_text(path, encoding)
    name = name or path.stem

    if format == "label-text":
        columns = list(text_columns) if text_columns is not None else ["text"]
        if len(columns) != 1:
            raise DataError(f"{path}: label-text files have one text field, got text_columns={columns}")
        records = _read_label_text(text, columns[0], bad)
        label_col = None if label_column is None else "label"
        return records_to_dataset(str(path), records, columns, label_col, label_names, (), name, bad)

    if format in ("csv", "tsv"):
        header, records = _read_delimited(path, text, "," if format == "csv" else "\t", bad)
        available, where = header, "line 1 (header)"
    else:
        records = _read_jsonl(text, bad) if format == "jsonl" else _read_json(path, text, bad)
        if not records:
            raise DataError(f"{path}: no examples found{bad.all_skipped()}")
        available, where = list(records[0][1]), records[0][0]
    columns = resolve_columns(str(path), where, available, text_columns, label_column, optional_columns)
    return records_to_dataset(
        str(path), records, columns, label_column, label_names, optional_columns, name, bad
    )
