"""A data source as a config names it: a local file or ``hub:NAME[:CONFIG][[SPLIT]]``, handed to the loader
that reads it (sources.py for files, hub.py for the hub; neither knows the other's sources).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .catalog import BUILTIN_DATASETS
from .dataset import DataError, TextDataset
from .hub import FILE_ONLY_OPTIONS, load_hub, parse_hub_source
from .sources import FORMATS, load_file


def load_dataset_spec(source: str, **kwargs: Any) -> TextDataset:
    """Load from a file path or ``hub:NAME[:CONFIG][[SPLIT]]`` (the split defaults to "train").

    ``kwargs`` go to :func:`load_file` or :func:`load_hub`; the file-only ones (format, encoding,
    on_bad_lines) are dropped for hub sources, so one set of options serves a file and a hub split alike.
    """
    if source.startswith("hub:"):
        name, config, split = parse_hub_source(source)
        for key in FILE_ONLY_OPTIONS:
            kwargs.pop(key, None)
        if config:
            kwargs.setdefault("config", config)
        if split is not None:
            if kwargs.get("split", split) != split:
                raise DataError(f"{source}: names split {split!r} but split={kwargs['split']!r} was passed too")
            kwargs["split"] = split
        kwargs.setdefault("split", "train")
        return load_hub(name, **kwargs)
    if Path(source).exists():
        return load_file(source, **kwargs)
    if source in BUILTIN_DATASETS:
        raise DataError(f"{source!r} is a built-in data set: load it with load_builtin({source!r})")
    raise DataError(
        f"{source!r}: no such file. Give a path to a {'/'.join(FORMATS)} file, 'hub:NAME' for a "
        f"Hugging Face hub data set, or one of the built-in data sets: {sorted(BUILTIN_DATASETS)}"
    )
