"""`data.source: hub:NAME` and named hub splits, without the network: `datasets.load_dataset` is replaced by
a stand-in that serves small in-memory splits and records what it was asked for."""

from __future__ import annotations

import pytest

from zofed.data import DataError, load_dataset_spec
from zofed.data.hub import parse_hub_source
from zofed.run.config import load_config
from zofed.run.setup import load_splits


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, str]]:
    """Each split holds texts naming the split, so a test can tell which one was loaded."""
    import datasets

    calls: list[tuple[str, str | None, str]] = []
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})

    def load_dataset(path: str, name: str | None = None, *, split: str) -> datasets.Dataset:
        calls.append((path, name, split))
        if split not in ("train", "test", "validation"):
            raise ValueError(f'Unknown split "{split}". Should be one of [\'train\', \'test\', \'validation\'].')
        n = 10 if split == "train" else 4
        rows = {"text": [f"{split} review {i}" for i in range(n)], "label": [i % 2 for i in range(n)]}
        return datasets.Dataset.from_dict(rows, features=features)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_source_through_the_config(fake_hub: list) -> None:
    # Before: load_splits passed format= (and now encoding=/on_bad_lines=) to load_hub -> TypeError.
    config = load_config(overrides=["data.source=hub:acme/reviews", "data.test_source=hub:acme/reviews[test]",
                                    "data.format=csv"])
    train, test = load_splits(config)
    assert fake_hub == [("acme/reviews", None, "train"), ("acme/reviews", None, "test")]
    assert len(train) == 10 and len(test) == 4
    assert all(f["text"].startswith("test ") for f in test.fields)
    assert train.label_names == test.label_names == ["neg", "pos"]
    assert test.name == "hub:acme/reviews[test]"


def test_hub_source_without_a_test_split_holds_out_a_fifth(fake_hub: list) -> None:
    train, test = load_splits(load_config(overrides=["data.source=hub:acme/reviews"]))
    assert fake_hub == [("acme/reviews", None, "train")]
    assert (len(train), len(test)) == (8, 2)


def test_hub_config_and_split_reach_load_dataset(fake_hub: list) -> None:
    ds = load_dataset_spec("hub:glue:sst2[validation]", format=None, encoding="utf-8", on_bad_lines="error")
    assert fake_hub == [("glue", "sst2", "validation")]
    assert ds.name == "hub:glue:sst2[validation]" and ds.fields[0] == {"text": "validation review 0"}


def test_unknown_hub_split_is_a_data_error(fake_hub: list) -> None:
    with pytest.raises(DataError, match=r"hub:acme/reviews: cannot load split 'tst'.*hub:acme/reviews\[SPLIT\]"):
        load_dataset_spec("hub:acme/reviews[tst]")


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("hub:imdb", ("imdb", None, None)),
        ("hub:acme/reviews[test]", ("acme/reviews", None, "test")),
        ("hub:glue:sst2", ("glue", "sst2", None)),
        ("hub:glue:sst2[validation]", ("glue", "sst2", "validation")),
        ("hub:imdb[train[:10%]]", ("imdb", None, "train[:10%]")),
    ],
)
def test_parse_hub_source(source: str, parsed: tuple) -> None:
    assert parse_hub_source(source) == parsed


@pytest.mark.parametrize("source", ["hub:imdb[]", "hub:imdb[test", "hub:[test]", "hub:"])
def test_malformed_hub_source(source: str) -> None:
    with pytest.raises(DataError, match="hub:"):
        parse_hub_source(source)


def test_split_named_twice_must_agree(fake_hub: list) -> None:
    with pytest.raises(DataError, match=r"names split 'test' but split='train'"):
        load_dataset_spec("hub:imdb[test]", split="train")
    assert len(load_dataset_spec("hub:imdb[test]", split="test")) == 4
