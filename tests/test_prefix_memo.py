"""Remembered prefixes (data/prefix_memo.py): with zo.cache: prefix the simulator runs each example through the
frozen bottom once, alone, and later steps assemble their batch from the remembered rows."""

import json
import logging
import time

import numpy as np
import pytest
import torch
from toy_federation import WORDS, tiny_federated_config

from zofed.data.dataset import TextDataset
from zofed.data.prefix_memo import PrefixMemo, RowStore, simulation_memo
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm
from zofed.run.metrics import CLIENT_LISTS
from zofed.zo.perturb import Perturbation, add_directions_
from zofed.zo.prefix import PrefixCache, first_trainable_layer, forward_equivalents

TOP_LORA = TrainableConfig(mode="lora", lora_r=2, lora_layers=[2, 3])


def _classification(seed: int = 0):
    tiny = tiny_causal_lm(seed=seed, num_layers=4)
    model, trainable = select_trainable(tiny.model, TOP_LORA)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=24)
    texts = [f"the movie was {WORDS[2 * (1 - y) + int(rng.integers(2))]} " + "w1 " * int(rng.integers(0, 6))
             for y in labels]  # rows of different lengths: batches are padded
    data = TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")
    task = make_task(TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"]), tiny.tokenizer, 2)
    return model, trainable, task, task.encode(data)


def _alone_losses(task, model, encoded, rows) -> float:
    """The batch's mean loss with every example run through the whole model alone, unpadded."""
    return float(np.mean([task.loss(model, task.collate(encoded, [i])) for i in rows]))


def test_remembered_rows_give_the_loss_of_each_example_run_alone():
    model, trainable, task, encoded = _classification()
    start = first_trainable_layer(model, trainable.names)
    assert start == 2
    memo = PrefixMemo()
    remembered = PrefixCache(model, start, memo=memo)
    rows = list(range(16))
    batch = task.collate(encoded, rows)
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1  # padded
    loss = task.cached_loss(model, remembered, batch)
    batched = task.cached_loss(model, PrefixCache(model, start), batch)
    for seed in range(3):  # at perturbed top blocks too: the rows hold only what lies below them
        add_directions_(trainable.tensors(), [(seed, 0.05)], Perturbation())
        assert loss() == pytest.approx(_alone_losses(task, model, encoded, rows), rel=1e-6)
        assert loss() == pytest.approx(batched(), abs=1e-5)
    distinct = {tuple(encoded.input_ids[i]) for i in rows}  # a repeated example is one row
    assert memo.computed == len(memo) == len(distinct)

    # a row is its example's alone: assembled by hand from single-example captures, the batch gives the same bits
    cache = PrefixCache(model, start)
    width = batch.input_ids.shape[1]
    hidden = torch.zeros(len(rows), width, 32)
    for k, i in enumerate(rows):
        ids = torch.tensor([encoded.input_ids[i]])
        hidden[k, : ids.shape[1]] = cache.run_bottom(ids, torch.ones_like(ids)).args[0][0]
    by_hand = cache.with_hidden(hidden, batch.input_ids, batch.attention_mask)
    assert torch.equal(cache.hidden(by_hand), remembered.hidden(remembered.capture(batch.input_ids,
                                                                                   batch.attention_mask)))

    # another batch meeting some of the same examples computes only the new ones, and its rows are the same
    other = task.collate(encoded, [3, 20, 5, 21, 3])
    again = task.cached_loss(model, remembered, other)
    assert memo.computed == len(memo) == len(distinct | {tuple(encoded.input_ids[i]) for i in (3, 20, 5, 21)})
    assert again() == pytest.approx(_alone_losses(task, model, encoded, [3, 20, 5, 21, 3]), rel=1e-6)


def test_the_causal_lm_loss_from_remembered_rows_is_the_batched_one():
    tiny = tiny_causal_lm(seed=0, num_layers=4)
    model, trainable = select_trainable(tiny.model, TOP_LORA)
    task = make_task(TaskConfig(type="causal-lm", prompt_format="template"), tiny.tokenizer, None)
    records = [{"instruction": f"w{i} is", "context": "", "response": "w3 " * (1 + i % 4)} for i in range(6)]
    batch = task.collate(task.encode(TextDataset(records, None, None, "toy")), list(range(6)))
    memo = PrefixMemo()
    remembered = task.cached_loss(model, PrefixCache(model, 2, output_layer=True, memo=memo), batch)
    batched = task.cached_loss(model, PrefixCache(model, 2, output_layer=True), batch)
    for seed in range(2):
        add_directions_(trainable.tensors(), [(seed, 0.05)], Perturbation())
        assert remembered() == pytest.approx(batched(), abs=1e-5)
    assert memo.computed == 6


def test_the_memo_drops_rows_of_changed_frozen_weights_and_refuses_another_model():
    model, trainable, task, encoded = _classification()
    memo = PrefixMemo()
    cache = PrefixCache(model, 2, memo=memo)
    batch = task.collate(encoded, list(range(8)))
    task.cached_loss(model, cache, batch)
    fingerprint = memo.fingerprint
    assert memo.computed == 8 and fingerprint is not None

    bottom = model.get_base_model().model.layers[0].mlp.up_proj.weight
    top = model.get_base_model().model.layers[3].mlp.up_proj.weight  # frozen, but above the split
    with torch.no_grad():
        bottom.copy_(bottom.clone())  # written, the same values: the rows stand
        top.mul_(1.5)
    task.cached_loss(model, cache, batch)
    assert (memo.computed, memo.dropped, memo.fingerprint) == (8, 0, fingerprint)

    with torch.no_grad():
        bottom.mul_(1.5)  # the prefix computes something else now
    loss = task.cached_loss(model, cache, batch)
    assert (memo.computed, memo.dropped) == (16, 1) and memo.fingerprint != fingerprint
    assert loss() == pytest.approx(task.cached_loss(model, PrefixCache(model, 2), batch)(), abs=1e-5)

    twin, _, _, _ = _classification()  # another replica of the same weights (as changed above) shares the rows
    with torch.no_grad():
        twin.get_base_model().model.layers[0].mlp.up_proj.weight.mul_(1.5)
    task.cached_loss(twin, PrefixCache(twin, 2, memo=memo), batch)
    assert memo.computed == 16
    with pytest.raises(ValueError, match="block 2 of a model whose frozen prefix hashes"):
        task.cached_loss(model, PrefixCache(model, 3, memo=memo), batch)
    other, _, _, _ = _classification(seed=1)
    with pytest.raises(ValueError, match="its rows would be another model's"):
        task.cached_loss(other, PrefixCache(other, 2, memo=memo), batch)


def test_a_memo_is_refused_past_its_memory_cap_and_on_left_padding(caplog):
    model, trainable, task, encoded = _classification()
    cache = PrefixCache(model, 2)
    # 32 floats a position: 1000 positions take 128,000 bytes
    assert isinstance(simulation_memo(cache, 1000, cap=128_000), PrefixMemo)
    with caplog.at_level(logging.INFO, logger="zofed.sim"):
        assert simulation_memo(cache, 1001, cap=128_000) is None
    assert "every step runs its batch through the frozen bottom" in caplog.text
    batch = task.collate(encoded, [0, 1, 2])
    left = batch.attention_mask.flip(1)
    if torch.equal(left, batch.attention_mask):
        left[0] = torch.roll(left[0], 1)
    with pytest.raises(ValueError, match="right-padded"):
        PrefixMemo().capture(cache, batch.input_ids, left)


def _deep_workspace(root):
    """An 8-block tiny model and examples of many lengths: the bottom 7 blocks are the prefix."""
    tiny = tiny_causal_lm(seed=1, num_layers=8)
    tiny.model.save_pretrained(root / "model")
    tiny.tokenizer.save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    for name, n in (("train", 120), ("test", 30)):
        with (root / f"{name}.jsonl").open("w") as f:
            for _ in range(n):
                label = int(rng.integers(2))
                filler = " ".join(f"w{int(i)}" for i in rng.integers(0, 20, size=int(rng.integers(1, 12))))
                f.write(json.dumps({"text": f"the movie {filler} was {WORDS[2 * (1 - label)]}", "label": label}) + "\n")
    return root


def _memo_recorder():
    """A stand-in for the simulator's `simulation_prefixes` that keeps every memo it makes, and that list."""
    import zofed.sim.engine as engine

    made, original = [], engine.simulation_prefixes

    def recording(*args):
        made.append(original(*args))
        return made[-1]

    return made, recording


def test_a_federated_run_remembers_prefixes_is_charged_the_same_and_ends_within_rounding(tmp_path, monkeypatch):
    import zofed.sim.engine as engine
    from zofed.run.federated import run_federated

    ws = _deep_workspace(tmp_path / "ws")
    memos, recording = _memo_recorder()
    options = ["trainable.mode=lora", "trainable.lora_r=2", "trainable.lora_layers=[7]", "zo.cache=prefix",
               "federation.rounds=4", "federation.local_steps=3", "federation.partition.num_clients=3",
               "federation.clients_per_round=3", "zo.queries=2", "federation.cached_examples=0"]
    results, seconds = {}, {}
    for attempt, remember in enumerate((False, True) * 2):  # the first pair warms up; the second is timed
        monkeypatch.setattr(engine, "simulation_prefixes", recording if remember else lambda *args: None)
        start = time.perf_counter()
        results[remember] = run_federated(tiny_federated_config(ws, tmp_path / f"run-{attempt}", *options),
                                          show_progress=False)
        seconds[remember] = time.perf_counter() - start
    memo = memos[-1]
    assert memo is not None and memo.computed == len(memo) <= 120  # each example ran through the bottom once
    assert results[True]["forward_passes"] == results[False]["forward_passes"]
    assert (results[True]["forward_passes_per_client_round"] ==
            results[False]["forward_passes_per_client_round"] == 3 * forward_equivalents(1 / 8, 2, "forward"))
    assert results[True]["test"]["loss"] == pytest.approx(results[False]["test"]["loss"], abs=1e-4)
    print(f"\n4 rounds, 3 clients x 3 steps: {seconds[False]:.2f} s capturing each batch, {seconds[True]:.2f} s "
          f"remembering ({memo.computed} rows computed, {memo.bytes} bytes)")


def test_a_resumed_run_with_remembered_prefixes_ends_bit_identical(tmp_path):
    """The resumed sitting starts with an empty memo and recomputes its rows: each is its example's alone, so the
    run ends where the uninterrupted one does, bit for bit."""
    from safetensors.torch import load_file

    from zofed.run.federated import run_federated

    ws = _deep_workspace(tmp_path / "ws")
    options = ["trainable.mode=lora", "trainable.lora_r=2", "trainable.lora_layers=[6, 7]", "zo.cache=prefix",
               "federation.rounds=3", "federation.local_steps=2", "federation.method=zo-seeds"]
    run_federated(tiny_federated_config(ws, tmp_path / "whole", *options), show_progress=False)
    run_federated(tiny_federated_config(ws, tmp_path / "split", *options, "federation.rounds=2"), show_progress=False)
    run_federated(tiny_federated_config(ws, tmp_path / "split", *options), resume=True, show_progress=False)
    whole = load_file(str(tmp_path / "whole" / "final" / "trainable.safetensors"))
    split = load_file(str(tmp_path / "split" / "final" / "trainable.safetensors"))
    assert all(torch.equal(whole[k], split[k]) for k in whole)



def test_a_store_keeps_the_rows_across_runs_and_a_run_reading_it_ends_bit_identical(tmp_path, monkeypatch):
    """A cold store is filled by the first run, the clients' held-out examples' rows too; the second computes no row
    (it writes no file) and ends with the first one's tensors and per-client scores, as does a run with no store
    at all (its scores within rounding: it runs the held-out batches whole)."""
    from safetensors.torch import load_file

    import zofed.sim.engine as engine
    from zofed.run.federated import run_federated

    ws = _deep_workspace(tmp_path / "ws")
    memos, recording = _memo_recorder()
    monkeypatch.setattr(engine, "simulation_prefixes", recording)
    options = ["trainable.mode=lora", "trainable.lora_r=2", "trainable.lora_layers=[6, 7]", "zo.cache=prefix",
               "federation.rounds=2", "federation.local_steps=2", "federation.method=zo-seeds"]
    store = tmp_path / "store"
    monkeypatch.setenv("ZOFED_FEATURE_STORE", str(store))
    results = {}
    for name in ("cold", "warm"):
        results[name] = run_federated(tiny_federated_config(ws, tmp_path / name, *options), show_progress=False)
        if name == "cold":
            files = sorted(store.rglob("*.safetensors"))
            assert files and all(f.parent.name.startswith("prefix.") for f in files)
    cold, warm = memos
    assert cold.computed > 0 and cold.loaded == 0 and warm.computed == 0 and warm.loaded == cold.computed
    assert sorted(store.rglob("*.safetensors")) == files  # the warm run had nothing to add
    monkeypatch.delenv("ZOFED_FEATURE_STORE")
    results["none"] = run_federated(tiny_federated_config(ws, tmp_path / "none", *options), show_progress=False)
    scores = {name: r[CLIENT_LISTS[r["client_metric"]]] for name, r in results.items()}
    assert results["cold"]["client_test_examples"] > 0 and scores["cold"] == scores["warm"]
    assert scores["none"] == pytest.approx(scores["cold"], abs=1e-4)
    final = {name: load_file(str(tmp_path / name / "final" / "trainable.safetensors"))
             for name in ("cold", "warm", "none")}
    assert all(torch.equal(final["cold"][k], final[other][k]) for k in final["cold"] for other in ("warm", "none"))
    (files[0].parent / "broken.safetensors").write_bytes(b"not a safetensors file")  # a damaged file is named
    with pytest.raises(ValueError, match="broken.safetensors cannot be read"):
        RowStore(files[0].parent)


def _charged_whole_runs(tmp_path, monkeypatch, trainable, disable) -> dict:
    """Runs with zo.cache: none, with the simulator's memo (True) and with it switched off by `disable` (False)."""
    from zofed.run.federated import run_federated

    ws = _deep_workspace(tmp_path / "ws")
    options = [*trainable, "zo.cache=none", "federation.rounds=3", "federation.local_steps=3",
               "federation.partition.num_clients=3", "federation.clients_per_round=3", "zo.queries=2"]
    results = {}
    for remember in (False, True):
        with monkeypatch.context() as patch:
            if not remember:
                disable(patch)
            results[remember] = run_federated(tiny_federated_config(ws, tmp_path / f"run-{remember}", *options),
                                              show_progress=False)
    assert (results[True]["forward_passes_per_client_round"] ==
            results[False]["forward_passes_per_client_round"] == 3 * forward_equivalents(1.0, 2, "forward"))
    assert results[True]["test"]["loss"] == pytest.approx(results[False]["test"]["loss"], abs=1e-4)
    from safetensors.torch import load_file
    final = {r: load_file(str(tmp_path / f"run-{r}" / "final" / "trainable.safetensors")) for r in (False, True)}
    assert all(torch.allclose(final[True][k], final[False][k], atol=1e-4) for k in final[False])
    return results


def test_whole_passes_charged_on_top_lora_are_simulated_on_remembered_prefixes(tmp_path, monkeypatch):
    """zo.cache: none charges every pass whole; the simulator still runs only the blocks above the frozen ones, on
    remembered rows, and ends within rounding of running each pass whole."""
    import zofed.sim.engine as engine

    memos = []
    simulation_prefixes = engine.simulation_prefixes
    monkeypatch.setattr(engine, "simulation_prefixes", lambda *args: memos.append(simulation_prefixes(*args))
                        or memos[-1])
    _charged_whole_runs(tmp_path, monkeypatch, ["trainable.mode=lora", "trainable.lora_r=2",
                                                "trainable.lora_layers=[7]"],
                        lambda patch: patch.setattr(engine, "simulation_prefixes", lambda *args: None))
    assert len(memos) == 1 and memos[0] is not None and 0 < memos[0].computed == len(memos[0]) <= 120


def test_whole_passes_charged_on_the_label_head_are_simulated_on_remembered_features(tmp_path, monkeypatch):
    """The same for the label head alone: the simulator's steps read the frozen body's remembered features."""
    import zofed.sim.engine as engine
    from zofed.data.tasks import PromptClassification
    from zofed.run.setup import Setup

    bodies = []
    cached_loss = PromptClassification.cached_loss

    def recording(self, *args, body=None):
        bodies.append(body)
        return cached_loss(self, *args, body=body)

    monkeypatch.setattr(PromptClassification, "cached_loss", recording)
    def disable(patch) -> None:
        patch.setattr(Setup, "simulated_body", property(lambda self: None))
        patch.setattr(engine, "simulation_prefixes", lambda *args: None)

    _charged_whole_runs(tmp_path, monkeypatch, ["trainable.mode=none", "trainable.label_head=true"], disable)
    assert len(bodies) == 3 * 3 * 3 and all(body is not None for body in bodies)  # rounds x clients x steps


def test_the_learning_curve_reads_remembered_prefixes_of_the_watched_examples(tmp_path, monkeypatch):
    """Curve points and the final test run only the blocks above the split, each test example's prefix computed
    once in the run, and read within rounding what running each batch whole reads."""
    import zofed.run.federated as federated

    ws = _deep_workspace(tmp_path / "ws")
    options = ["trainable.mode=lora", "trainable.lora_r=2", "trainable.lora_layers=[6, 7]", "zo.cache=prefix",
               "federation.rounds=3", "federation.eval_every=1", "federation.local_steps=2", "data.eval_examples=12"]
    splits, curves, tests = [], {}, {}
    watched_prefixes = federated.watched_prefixes
    def recording(*args):
        splits.append(watched_prefixes(*args))
        return splits[-1]

    for remember in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(federated, "watched_prefixes", recording if remember else lambda *args: None)
            tests[remember] = federated.run_federated(tiny_federated_config(ws, tmp_path / f"run-{remember}",
                                                                            *options), show_progress=False)
        records = [json.loads(line) for line in (tmp_path / f"run-{remember}" / "metrics.jsonl").open()]
        curves[remember] = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(curves[True]) == 4 and curves[True] == pytest.approx(curves[False], abs=1e-5)
    assert len(set(curves[True])) > 1  # the model moved between the points
    assert tests[True]["test"]["loss"] == pytest.approx(tests[False]["test"]["loss"], abs=1e-5)
    memo = splits[0].memo
    # each test example ran through the bottom once: the 12 watched (data.eval_examples) for the curve, the rest
    # for the final test, which reads the watched ones' rows again
    assert memo.computed == len(memo) == tests[True]["test_examples"] > 12
