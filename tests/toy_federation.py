"""A toy federation for unit tests: a tiny random-init causal LM, a two-class word task, even client splits."""

import numpy as np

from zofed.data.dataset import TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.fl.client import ClientContext
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm

WORDS = ["good", "great", "bad", "awful"]


def toy_context(vocab_size: int = 64, seed: int = 0, mode: str = "all", num_layers: int = 2,
                patterns: list[str] | None = None) -> ClientContext:
    tiny = tiny_causal_lm(vocab_size=vocab_size, seed=seed, num_layers=num_layers)
    config = TrainableConfig(mode="patterns", patterns=patterns) if patterns else TrainableConfig(mode=mode, lora_r=2)
    model, trainable = select_trainable(tiny.model, config)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=120)
    texts = [f"the movie was {WORDS[2 * (1 - lab) + int(rng.integers(2))]} w{int(rng.integers(20))}" for lab in labels]
    data = TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")
    task = make_task(TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"]), tiny.tokenizer, 2)
    return ClientContext(model, trainable, task, task.encode(data))


def toy_clients(n: int = 6, size: int = 120) -> list[np.ndarray]:
    return [np.arange(size)[k::n] for k in range(n)]


def tiny_federated_config(ws, out, *extra: str):
    """A 3-round federated run on the `tiny_workspace` fixture's model and data; `extra` overrides win."""
    from zofed.run.config import load_config
    from zofed.run.federated_config import FederatedConfig

    overrides = [f"model.name={ws / 'model'}", f"data.source={ws / 'train.jsonl'}",
                 f"data.test_source={ws / 'test.jsonl'}", "data.eval_examples=30",
                 "task.template='review : {text} . sentiment :'", "task.verbalizer=[negative, positive]",
                 "trainable.mode=lora", "trainable.lora_r=2", "optimizer.lr=0.02", "zo.eps=0.01",
                 "train.batch_size=8", "federation.rounds=3", "federation.clients_per_round=2",
                 "federation.local_steps=2", "federation.partition.num_clients=4",
                 "federation.partition.alpha=1.0", f"out_dir={out}", *extra]
    return load_config(None, overrides, schema=FederatedConfig)


def recompute_features(monkeypatch) -> None:
    """Make every simulated run in the test recompute its clients' round features instead of remembering them
    (its clients get no memo); evaluations keep their memory."""
    from dataclasses import replace

    from zofed.run.federated import FederatedRun

    context = FederatedRun.client_context
    monkeypatch.setattr(FederatedRun, "client_context", lambda self: replace(context(self), body=None))
