"""zofed's recommended settings for a federated run, filled in where a config leaves them unset.

The schema's own defaults (run/config.py, run/federated_config.py) serve every task, model and method alike: LoRA,
one query a step, no cached features. On prompt classification with a decoder the cheapest thing to train is the
label head on cached features: a client runs the model once a round and takes all its steps on the cached rows.
There neither of zofed's two components is active (one block, plain averaging: docs/method.md), so the run is
zo-seeds with one-sided queries; docs/results/ranking.md ranks it against the baselines and first-order FedAvg on
the same head. `federation.recipe: auto` (the default) fills that recipe in when the config says nothing of what
trains (no `trainable.mode`, no `trainable.label_head`): a run with no config at all, or one that names only its
model, data and federation, gets it. Whatever the config does set wins over the recipe, key by key
(`trainable.label_head_per_class: true` alone keeps the recipe and splits its head); a config that chooses what
trains, another method or another task keeps the schema's defaults. `recipe: none` never fills it in, and `recipe:
head` fills it whatever the config trains.

A validated config records the recipe it resolved to (head or none) and holds every key explicitly, so a stored run
config loads again to the same run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from zofed.models.catalog import CAUSAL_LM, named_kind
from zofed.run.config import deep_merge

Recipe = Literal["auto", "head", "none"]

# The label head on cached features, with plain averaging and tail averaging on the server (docs/method.md). A
# client runs 8 of its examples through the frozen model once a round, then takes 48 steps of 8 one-sided queries
# on their last hidden states; its 384 scalars travel as float16 so the uplink stays under zofed's 1 KB (as float32
# they alone would take 1.5 KB).
HEAD: dict[str, Any] = {
    "trainable": {"mode": "none", "label_head": True},
    "zo": {"queries": 8, "cache": "features"},
    "optimizer": {"lr": 1e-3},
    "train": {"batch_size": 8},
    "federation": {"rounds": 90, "local_steps": 48, "scalar_bits": 16, "cached_examples": 8,
                   "logit_adjust": 1.0, "average_from": 0.5, "server_optimizer": {"name": "sgd", "lr": 1.0}},
}
RECIPES: dict[str, dict[str, Any]] = {"head": HEAD, "none": {}}


def _get(tree: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """A nested value of the tree, whose sections may be dicts or already-built section objects."""
    node: Any = tree
    for key in keys:
        if isinstance(node, dict):
            if key not in node:
                return default
            node = node[key]
        elif isinstance(node, BaseModel) and key in type(node).model_fields:
            node = getattr(node, key)
        else:
            return default
    return node


def auto_recipe(tree: dict[str, Any]) -> str:
    """The recipe `auto` resolves to for this (unvalidated) config tree: head for zofed on prompt classification
    with a decoder (what the model is, not its name: a built-in, a GGUF file, a directory or `model.kind:
    causal-lm`; `named_kind`), and neither `trainable.mode` nor `trainable.label_head` set; else none."""
    name, kind = _get(tree, "model", "name", default="smollm2-135m"), _get(tree, "model", "kind")
    decoder = named_kind(str(name), kind) == CAUSAL_LM
    chosen = _get(tree, "trainable", "mode") is not None or _get(tree, "trainable", "label_head") is not None
    if (decoder and not chosen
            and _get(tree, "task", "type", default="prompt-classification") == "prompt-classification"
            and _get(tree, "federation", "method", default="zofed") == "zofed"
            and _get(tree, "optimizer", "name", default="mezo") == "mezo"):
        return "head"
    return "none"


def apply_recipe(tree: dict[str, Any]) -> dict[str, Any]:
    """The config tree with `federation.recipe` resolved (auto to head or none) and that recipe's settings filled
    in where the tree leaves them unset."""
    chosen = _get(tree, "federation", "recipe", default="auto")
    if chosen not in ("auto", *RECIPES):
        return tree  # validation names the bad value
    name = auto_recipe(tree) if chosen == "auto" else chosen
    recipe = RECIPES[name]
    if _get(tree, "federation", "server_optimizer") is not None and "federation" in recipe:
        # filled only as a whole: the recipe's plain-averaging lr under another server optimizer would mix two designs
        recipe = {**recipe, "federation": {k: v for k, v in recipe["federation"].items() if k != "server_optimizer"}}
    filled = deep_merge(recipe, tree)
    federation = filled.get("federation", {})
    if isinstance(federation, dict):
        filled["federation"] = {**federation, "recipe": name}
    return filled
