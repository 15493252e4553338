"""The task a config names: one of the prompt and encoder classifications (tasks.py) or the causal-lm task
(causal_lm.py, which builds on tasks.py's `Task`), so the factory sits above both.
"""

from __future__ import annotations

from collections.abc import Sequence

from zofed.data.causal_lm import CausalLM
from zofed.data.dataset import DataError
from zofed.data.tasks import EncoderClassification, PromptClassification, Task, TaskConfig


def make_task(config: TaskConfig, tokenizer, num_classes: int | None,
              label_names: Sequence[str] | None = None) -> Task:
    """The task of `config`; a prompt classification with no task.verbalizer answers with `label_names`, the
    data's, where they are words (`label_verbalizer`)."""
    if config.type == "prompt-classification":
        if not num_classes:
            raise DataError("task.type prompt-classification needs labelled data (data.label_column names the "
                            "label column); instruction data takes task.type causal-lm")
        return PromptClassification(tokenizer, config, num_classes, label_names)
    if config.type == "encoder-classification":
        task = EncoderClassification(tokenizer, config)
        task.num_classes = num_classes
        return task
    if config.type == "causal-lm":
        return CausalLM(tokenizer, config)
    raise ValueError(f"unknown task type {config.type!r}; choose prompt-classification, "
                     "encoder-classification or causal-lm")
