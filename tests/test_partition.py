"""Client partitioners: determinism, coverage, the skew each scheme promises, errors, summaries, plots."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from zofed.data.dataset import TextDataset
from zofed.data.partition import (
    PartitionConfig,
    PartitionError,
    client_splits,
    format_summary,
    partition,
    plot_partition,
    summarize,
)


def make_data(n: int = 400, num_labels: int = 4, seed: int = 0, users: int = 5) -> TextDataset:
    """Balanced labels in shuffled order, plus a "user" field for natural partitions."""
    labels = np.random.default_rng(seed).permutation(np.arange(n) % num_labels).tolist()
    fields = [{"text": f"example {i}", "user": f"u{(i * 7) % users}"} for i in range(n)]
    return TextDataset(fields, labels, [f"class{c}" for c in range(num_labels)], "synthetic")


def config(scheme: str, **kw) -> PartitionConfig:
    if scheme == "natural":
        kw.setdefault("column", "user")
    return PartitionConfig(scheme=scheme, **kw)


def mean_entropy(data: TextDataset, cfg: PartitionConfig) -> float:
    return summarize(data, partition(data, cfg))["mean_entropy"]


SCHEMES = ["iid", "dirichlet", "dirichlet-mix", "pathological", "quantity", "natural"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_is_deterministic_disjoint_covering(scheme):
    data = make_data()
    parts = partition(data, config(scheme, seed=3))
    again = partition(data, config(scheme, seed=3))
    assert len(parts) == len(again)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(data)))  # disjoint and covering
    assert all(len(p) >= 2 for p in parts)
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    if scheme != "natural":  # natural has no randomness
        assert len(parts) == 10
        other = partition(data, config(scheme, seed=4))
        assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_alpha_controls_label_skew():
    data = make_data(n=4000)
    low, mid, high = (mean_entropy(data, config("dirichlet", num_clients=20, alpha=a)) for a in (0.1, 1.0, 100.0))
    assert low < mid < high
    iid = summarize(data, partition(data, config("iid", num_clients=20)))
    assert iid["global_entropy"] == pytest.approx(2.0)
    assert abs(iid["mean_entropy"] - iid["global_entropy"]) < 0.1


def test_pathological_gives_each_client_exactly_its_classes():
    data = make_data(n=400, num_labels=5)
    parts = partition(data, config("pathological", num_clients=7, classes_per_client=2))
    labels = np.asarray(data.labels)
    assert [len(set(labels[p])) for p in parts] == [2] * 7
    assert set(np.concatenate([labels[p] for p in parts])) == set(range(5))  # every class used


def test_quantity_alpha_controls_size_spread():
    data = make_data(n=2000)

    def cv(alpha: float) -> float:
        sizes = np.array([len(p) for p in partition(data, config("quantity", num_clients=10, alpha=alpha))])
        return sizes.std() / sizes.mean()

    assert cv(0.5) > cv(100.0) + 0.2


def test_natural_groups_by_column_in_sorted_order():
    data = make_data(n=50, users=4)
    parts = partition(data, config("natural", num_clients=99))  # num_clients is ignored
    assert len(parts) == 4
    values = [{data.fields[i]["user"] for i in p} for p in parts]
    assert values == [{"u0"}, {"u1"}, {"u2"}, {"u3"}]


def test_natural_missing_column_names_it_and_the_fields():
    with pytest.raises(PartitionError, match=r"'speaker'.*available fields: \['text', 'user'\]"):
        partition(make_data(), config("natural", column="speaker"))


def test_dirichlet_that_cannot_fill_clients_names_the_client():
    data = make_data(n=200, num_labels=2)
    with pytest.raises(PartitionError, match=r"client \d+ would get .*alpha=0\.01.*50 clients.*200 examples"):
        partition(data, config("dirichlet", num_clients=50, alpha=0.01))


def test_too_few_examples_for_min_size_fails_fast():
    with pytest.raises(PartitionError, match="min_size=2"):
        partition(make_data(n=15), config("iid", num_clients=8))


def test_pathological_errors():
    data = make_data(num_labels=4)
    with pytest.raises(PartitionError, match="classes_per_client=5.*only 4 classes"):
        partition(data, config("pathological", classes_per_client=5))
    with pytest.raises(PartitionError, match="cover only 2 of 4 classes"):
        partition(data, config("pathological", num_clients=2, classes_per_client=1))
    # Consecutive classes: 2 clients of 2 cover classes {a, b} and {b, c}, never d.
    with pytest.raises(PartitionError, match="2 clients holding 2 consecutive classes each cover only 3 of 4"):
        partition(data, config("pathological", num_clients=2, classes_per_client=2))


def test_pathological_class_holders_follow_the_seed():
    """Client i holds consecutive classes of an order the partition stream draws, so the seed moves who holds what."""
    data = make_data(n=400, num_labels=5)
    labels = np.asarray(data.labels)
    holders = {tuple(sorted(set(labels[partition(data, config("pathological", num_clients=5, seed=s))[0]])))
               for s in range(6)}
    assert len(holders) > 1


def test_what_flwr_datasets_refuses_is_a_partition_error_naming_it():
    labels = [0] * 40 + [1]  # class 1 has one example but two clients would hold it
    data = TextDataset([{"text": str(i)} for i in range(41)], labels, ["a", "b"], "lopsided")
    with pytest.raises(PartitionError, match="PathologicalPartitioner refused the partition: Label: 1"):
        partition(data, config("pathological", num_clients=4, classes_per_client=1))


def test_iid_and_dirichlet_are_flwr_datasets_partitions_seeded_by_the_partition_stream():
    """The same partitions as flwr-datasets' own partitioners give for the same labels and seed: a table of index
    and label shuffled by the partition stream (as FederatedDataset shuffles), then for Dirichlet the partitioner
    seeded by the stream's next draw."""
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    from zofed import streams

    data = make_data(n=600, num_labels=3)

    def flwr_parts(make_partitioner, seed: int) -> list[np.ndarray]:
        rng = streams.partition(seed)
        table = datasets.Dataset.from_dict({"index": np.arange(600), "label": data.labels}).shuffle(generator=rng)
        partitioner = make_partitioner(rng)
        partitioner.dataset = table
        return [np.sort(np.asarray(partitioner.load_partition(i)["index"])) for i in range(partitioner.num_partitions)]

    for seed in (0, 5):
        ours = partition(data, config("iid", num_clients=7, seed=seed))
        theirs = flwr_parts(lambda rng: IidPartitioner(7), seed)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        ours = partition(data, config("dirichlet", num_clients=8, alpha=0.5, seed=seed))
        theirs = flwr_parts(lambda rng: DirichletPartitioner(8, "label", 0.5, min_partition_size=2,
                                                             seed=int(rng.integers(2**32))), seed)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert len({len(p) for p in ours}) > 1  # label skew: unequal sizes, unlike iid


@pytest.mark.parametrize("scheme", ["dirichlet", "pathological"])
def test_label_schemes_need_labels(scheme):
    data = TextDataset([{"text": str(i)} for i in range(40)], None, None, "unlabelled")
    with pytest.raises(PartitionError, match="unlabelled"):
        partition(data, config(scheme))
    assert len(partition(data, config("iid"))) == 10  # label-agnostic schemes still work


def test_label_skew_schemes_split_unlabelled_data_by_a_column():
    """Dirichlet over a field's values (Dolly's categories): unlabelled data splits, the skew follows alpha, and
    pathological gives each client exactly its share of values."""
    users = make_data(n=2000, users=5)
    data = TextDataset(users.fields, None, None, "unlabelled")

    def user_entropy(alpha: float) -> float:
        parts = partition(data, config("dirichlet", num_clients=10, alpha=alpha, column="user"))
        shares = [np.unique([data.fields[i]["user"] for i in p], return_counts=True)[1] / len(p) for p in parts]
        return float(np.mean([-(q * np.log2(q)).sum() for q in shares]))

    assert user_entropy(0.1) < user_entropy(1.0) < user_entropy(100.0)
    assert user_entropy(100.0) == pytest.approx(math.log2(5), abs=0.05)
    parts = partition(data, config("pathological", num_clients=5, classes_per_client=2, column="user"))
    assert [len({data.fields[i]["user"] for i in p}) for p in parts] == [2] * 5
    with pytest.raises(PartitionError, match="dirichlet partition by column 'speaker'"):
        partition(data, config("dirichlet", column="speaker"))
    with pytest.raises(ValidationError, match="'iid' ignores column='user'"):
        config("iid", column="user")


@pytest.mark.parametrize(
    "bad",
    [
        {"num_clients": 0},
        {"alpha": 0.0},
        {"alpha": -1.0},
        {"test_fraction": 1.0},
        {"test_fraction": -0.1},
        {"classes_per_client": 0},
        {"scheme": "random"},
        {"num_client": 5},  # typo: extra keys are rejected
        {"scheme": "natural"},  # natural without column
    ],
)
def test_bad_config_values_are_rejected(bad):
    with pytest.raises(ValidationError):
        PartitionConfig(**bad)


def test_client_splits_are_disjoint_inside_part_and_sized():
    data = make_data(n=400)
    cfg = config("dirichlet", num_clients=10, alpha=0.3, test_fraction=0.25, seed=1)
    parts = partition(data, cfg)
    splits = client_splits(data, cfg)
    assert [s.client_id for s in splits] == list(range(10))
    for part, split in zip(parts, splits, strict=True):
        assert np.intersect1d(split.train, split.test).size == 0
        assert np.array_equal(np.sort(np.concatenate([split.train, split.test])), part)
        assert len(split.test) == min(max(round(0.25 * len(part)), 1), len(part) - 1)
    again = client_splits(data, cfg)
    for a, b in zip(splits, again, strict=True):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)


def test_client_splits_small_clients_and_zero_fraction():
    data = make_data(n=20)
    tiny = client_splits(data, config("iid", num_clients=10, test_fraction=0.1))  # round(0.2) = 0, but at least 1
    assert [(len(s.train), len(s.test)) for s in tiny] == [(1, 1)] * 10
    none = client_splits(data, config("iid", num_clients=4, test_fraction=0.0))
    assert [(len(s.train), len(s.test)) for s in none] == [(5, 0)] * 4


def test_summarize_counts_on_a_hand_made_example():
    data = TextDataset([{"text": str(i)} for i in range(6)], [0, 0, 1, 1, 1, 0], ["neg", "pos"], "tiny")
    s = summarize(data, [np.array([0, 1]), np.array([2, 3, 4, 5])])
    assert [c["size"] for c in s["clients"]] == [2, 4]
    assert [c["label_counts"] for c in s["clients"]] == [[2, 0], [1, 3]]
    h = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    assert s["clients"][0]["entropy"] == 0.0
    assert s["clients"][1]["entropy"] == pytest.approx(h)
    assert s["mean_entropy"] == pytest.approx(h / 2)
    assert s["global_entropy"] == pytest.approx(1.0)
    assert (s["size_min"], s["size_median"], s["size_max"]) == (2, 3.0, 4)
    text = format_summary(s, data.label_names)
    assert "neg" in text and "pos" in text
    rows = [line.split() for line in text.splitlines()[1:3]]
    assert rows == [["0", "2", "0.00", "2", "0"], ["1", "4", "0.81", "1", "3"]]


def test_format_summary_truncates_after_20_clients():
    data = make_data(n=250)
    s = summarize(data, partition(data, config("iid", num_clients=25)))
    text = format_summary(s, None)
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[1:21]] == [str(c) for c in range(20)]  # header, then 20 rows
    assert lines[21] == "... 5 more clients"
    assert len(lines) == 23  # and one overall line
    assert lines[22].startswith("25 clients, 250 examples; size min/median/max 10/10/10")


def test_plot_partition_writes_a_png(tmp_path):
    data = make_data(n=200)
    out = plot_partition(data, partition(data, config("dirichlet")), tmp_path / "sub" / "parts.png", title="dirichlet")
    assert out == tmp_path / "sub" / "parts.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 1000


def test_dirichlet_mix_gives_every_client_its_share_with_strong_label_skew():
    """50 clients at alpha 0.1 on two classes: the per-class split leaves clients empty, the per-client label mix
    gives each n/K examples, most of them from one class, and covers every example once."""
    from zofed.data.dataset import TextDataset
    from zofed.data.partition import PartitionConfig, PartitionError, partition

    labels = [i % 2 for i in range(1000)]
    data = TextDataset([{"text": str(i)} for i in range(1000)], labels, ["a", "b"], "toy")
    with pytest.raises(PartitionError, match="no examples"):
        partition(data, PartitionConfig(scheme="dirichlet", num_clients=50, alpha=0.1))
    parts = partition(data, PartitionConfig(scheme="dirichlet-mix", num_clients=50, alpha=0.1))
    assert sorted(len(p) for p in parts) == [20] * 50
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    majority = [max(np.bincount(np.asarray(labels)[p], minlength=2)) / len(p) for p in parts]
    assert np.median(majority) > 0.9  # alpha 0.1: most clients hold (nearly) one class
    mild = partition(data, PartitionConfig(scheme="dirichlet-mix", num_clients=50, alpha=100.0))
    assert np.median([max(np.bincount(np.asarray(labels)[p], minlength=2)) / len(p) for p in mild]) < 0.7
    again = partition(data, PartitionConfig(scheme="dirichlet-mix", num_clients=50, alpha=0.1))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
