"""data.encoding and data.on_bad_lines: legacy encodings and files with a few unusable lines."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from zofed.data import DataError, load_file
from zofed.run.config import ConfigError, load_config
from zofed.run.setup import load_splits

REVIEWS = ["a fine film", "a dull film", "great acting", "weak plot", "loved it", "hated it"]


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _good(i: int) -> str:
    return json.dumps({"text": REVIEWS[i % len(REVIEWS)], "label": i % 2})


def _config(train: Path, *overrides: str):
    # The training file doubles as the test file: no held-out split, so `train` is the loaded data set itself.
    return load_config(overrides=[f"data.source={train}", f"data.test_source={train}", *overrides])


# ------------------------------------------------------------------------------------------------ encoding


def test_cp1252_file_loads_with_data_encoding(tmp_path: Path) -> None:
    path = tmp_path / "reviews.csv"
    text = 'text,label\nclichéd plot \u2026 again,0\n"smart, \u201cwitty\u201d dialogue",1\n'
    path.write_bytes(text.encode("cp1252"))  # é is 0xe9, the ellipsis 0x85: neither is valid UTF-8
    with pytest.raises(DataError, match=r"reviews\.csv, line 2: not valid utf-8.*data\.encoding=cp1252"):
        load_splits(_config(path))
    train, test = load_splits(_config(path, "data.encoding=cp1252"))
    assert [f["text"] for f in train.fields] == ["clichéd plot \u2026 again", "smart, \u201cwitty\u201d dialogue"]
    assert train.labels == test.labels == [0, 1]


def test_unknown_encoding_names_the_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [_good(0), _good(1)])
    with pytest.raises(DataError, match=r"unknown encoding 'cp-nope' \(data\.encoding\)"):
        load_splits(_config(path, "data.encoding=cp-nope"))


# ------------------------------------------------------------------------------------------------ bad lines


def test_bad_jsonl_line_stops_by_default_naming_file_line_and_option(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [_good(0), _good(1), '{"text": "unclosed', _good(3)])
    with pytest.raises(DataError, match=r"d\.jsonl, line 3: invalid JSON .*data\.on_bad_lines=skip"):
        load_splits(_config(path))


def test_skip_loads_the_rest_and_reports_where(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [_good(i) for i in range(6)]
    lines[2] = '{"text": "unclosed'
    lines[4] = json.dumps({"text": "", "label": 1})  # empty text
    path = _jsonl(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="zofed.data"):
        train, _ = load_splits(_config(path, "data.on_bad_lines=skip"))
    assert [f["text"] for f in train.fields] == [REVIEWS[i] for i in (0, 1, 3, 5)]
    assert train.labels == [0, 1, 1, 1]
    assert train.skipped == ["line 3", "line 5"]
    warning = [r for r in caplog.records if r.name == "zofed.data" and r.levelno == logging.WARNING]
    assert len(warning) == 2  # the training file and the same file as test file
    assert "d.jsonl: skipped 2 bad line(s)" in warning[0].getMessage()
    assert "line 3, line 5" in warning[0].getMessage() and "invalid JSON" in warning[0].getMessage()


def test_label_text_line_without_text(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("1 good\n0\n0 bad\n1 fine\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.txt, line 2: expected 'LABEL TEXT', found no text after the label"):
        load_file(path)
    ds = load_file(path, on_bad_lines="skip")
    assert ds.fields == [{"text": "good"}, {"text": "bad"}, {"text": "fine"}] and ds.labels == [1, 0, 1]
    assert ds.skipped == ["line 2"]


def test_skip_covers_field_counts_unknown_labels_and_json_items(tmp_path: Path) -> None:
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("text,label\ngood,pos\ntoo,many,fields\nbad,neg\nodd,meh\n", encoding="utf-8")
    ds = load_file(csv_path, label_names=["neg", "pos"], on_bad_lines="skip")
    assert ds.fields == [{"text": "good"}, {"text": "bad"}] and ds.labels == [1, 0]
    assert ds.skipped == ["line 3", "line 5"]
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps([{"text": "a", "label": 0}, "not an object", {"text": "b", "label": 1}]))
    ds = load_file(json_path, on_bad_lines="skip")
    assert ds.fields == [{"text": "a"}, {"text": "b"}] and ds.skipped == ["item 2"]


def test_many_skips_name_the_first_few(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [_good(0)] + ["not json"] * 8 + [_good(1)])
    with caplog.at_level(logging.WARNING, logger="zofed.data"):
        ds = load_file(path, on_bad_lines="skip")
    assert len(ds) == 2 and len(ds.skipped) == 8
    assert "skipped 8 bad line(s)" in caplog.text
    assert "line 2, line 3, line 4, line 5, line 6, ..." in caplog.text and "line 7" not in caplog.text


def test_a_file_of_bad_lines_only_is_still_an_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ["nope", "[1]"])
    with pytest.raises(DataError, match=r"d\.jsonl: no examples found \(all 2 were bad lines, skipped\)"):
        load_file(path, on_bad_lines="skip")


def test_good_files_report_no_skips(tmp_path: Path) -> None:
    assert load_file(_jsonl(tmp_path / "d.jsonl", [_good(0), _good(1)]), on_bad_lines="skip").skipped == []


def test_on_bad_lines_takes_error_or_skip(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.on_bad_lines"):
        load_config(overrides=["data.on_bad_lines=ignore"])
    with pytest.raises(DataError, match=r"on_bad_lines .* must be 'error' or 'skip', got 'ignore'"):
        load_file(_jsonl(tmp_path / "d.jsonl", [_good(0)]), on_bad_lines="ignore")  # type: ignore[arg-type]
