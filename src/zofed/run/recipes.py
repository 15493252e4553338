"""zofed's recommended settings for a federated run, filled in where a config leaves them unset.

The schema's own defaults (run/config.py, run/federated_config.py) serve every task, model and method alike: LoRA,
one query a step, no cached features. On prompt classification with a decoder `zofed run` fills in the **weights
recipe**: the label head together with the model's own weights at the top (the norm gains of the top block and the
final norm, `trainable.top_norms`), trained on a round's cached prefixes. A client runs 8 of its examples through
the frozen bottom once a round and takes all its steps on them, each perturbed pass running only the top block (at
each example's last token) and the head; zofed's block sampling draws among the four tensors, and a step that
perturbs the head or the final norm runs no block at all. The server keeps the head recipe's plain averaging: zofed's
adaptive server, at its default lr, ended behind it here (docs/results/recipe_ablation.md), so of zofed's two
components only block sampling is active.
The **head recipe** (`recipe: head`) is the label head alone on cached features, a linear probe on the frozen body:
there neither component is active (one block, plain averaging: docs/method.md), so the run is zo-seeds with
one-sided queries; docs/results/ranking.md ranks it against the baselines and first-order FedAvg on the same head.

`federation.recipe: auto` (the default) fills in the weights recipe when the config says nothing of what trains
(no `trainable.mode`, `trainable.label_head` or `trainable.top_norms`): a run with no config at all, or one that
names only its model, data and federation, gets it. Whatever the config does set wins over the recipe, key by key
(`trainable.label_head_per_class: true` alone keeps the recipe and splits its head); a config that chooses what
trains, another method or another task keeps the schema's defaults. `recipe: none` never fills one in, and `recipe:
weights` or `recipe: head` fills that one in whatever the config trains.

A validated config records the recipe it resolved to and holds every key explicitly, so a stored run config loads
again to the same run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from zofed.models.catalog import CAUSAL_LM, named_kind
from zofed.run.config import deep_merge

Recipe = Literal["auto", "weights", "head", "none"]

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
# The head recipe's engine on the model's own weights: the label head, the top block's two norm gains and the final
# norm (3,456 values with SmolLM2 on three classes), on a round's cached prefixes at the top block.
WEIGHTS: dict[str, Any] = deep_merge(HEAD, {"trainable": {"top_norms": 1}, "zo": {"cache": "prefix"}})
RECIPES: dict[str, dict[str, Any]] = {"weights": WEIGHTS, "head": HEAD, "none": {}}


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
    """The recipe `auto` resolves to for this (unvalidated) config tree: weights for zofed on prompt classification
    with a decoder (what the model is, not its name: a built-in, a GGUF file, a directory or `model.kind:
    causal-lm`; `named_kind`), and none of `trainable.mode`, `trainable.label_head`, `trainable.top_norms` set;
    else none."""
    name, kind = _get(tree, "model", "name", default="smollm2-135m"), _get(tree, "model", "kind")
    decoder = named_kind(str(name), kind) == CAUSAL_LM
    chosen = any(_get(tree, "trainable", key) is not None for key in ("mode", "label_head", "top_norms"))
    if (decoder and not chosen
            and _get(tree, "task", "type", default="prompt-classification") == "prompt-classification"
            and _get(tree, "federation", "method", default="zofed") == "zofed"
            and _get(tree, "optimizer", "name", default="mezo") == "mezo"):
        return "weights"
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
