"""A toy federation for unit tests: a tiny random-init causal LM, a two-class word task, even client splits."""

import numpy as np

from zofed.data.sources import TextDataset
from zofed.data.tasks import TaskConfig, make_task
from zofed.fl.client import ClientContext
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm

WORDS = ["good", "great", "bad", "awful"]


def toy_context(vocab_size: int = 64, seed: int = 0, mode: str = "all", num_layers: int = 2) -> ClientContext:
    tiny = tiny_causal_lm(vocab_size=vocab_size, seed=seed, num_layers=num_layers)
    model, trainable = select_trainable(tiny.model, TrainableConfig(mode=mode, lora_r=2))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=120)
    texts = [f"the movie was {WORDS[2 * (1 - lab) + int(rng.integers(2))]} w{int(rng.integers(20))}" for lab in labels]
    data = TextDataset([{"text": t} for t in texts], labels.tolist(), ["negative", "positive"], "toy")
    task = make_task(TaskConfig(template="{text} sentiment :", verbalizer=["negative", "positive"]), tiny.tokenizer, 2)
    return ClientContext(model, trainable, task, task.encode(data))


def toy_clients(n: int = 6, size: int = 120) -> list[np.ndarray]:
    return [np.arange(size)[k::n] for k in range(n)]
