"""Which parameters a ZO run perturbs: a config object, separate from the code that applies it.

Modes: every parameter, LoRA adapters (via peft), parameters whose names match regular expressions, or
a magnitude mask (a fixed fraction of each selected tensor's coordinates), or none. Any mode may add the label head
(`label_head`): a copy of the verbalizer's output rows, attached here as the model's own parameter, which a
prompt-classification task's logits then read (data/tasks.py); the smallest set that moves a classifier's
decision. This module is the only one that adds tensors to a model. The ZO path never needs autograd, so every
parameter is set to `requires_grad=False` and the selection is kept as our own list.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zofed import streams
from zofed.models.catalog import ModelLoadError
from zofed.models.global_rng import seeded_global_rng
from zofed.zo.optim import magnitude_masks

SelectionMode = Literal["all", "lora", "patterns", "magnitude", "none"]
LABEL_HEAD = "label_head"  # the parameter `attach_label_head` adds to the model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (LoRA layers are injected in place, so it runs them)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def label_head_owner(name: str) -> str | None:
    """The path of the module holding the label head, when `name` is the head (`label_head`) or one of its
    per-class rows (`label_head.0`, ...); None for any other parameter."""
    parts = name.split(".")
    return ".".join(parts[:parts.index(LABEL_HEAD)]) if LABEL_HEAD in parts else None


def label_head_rows(model: torch.nn.Module) -> torch.Tensor | None:
    """The label head as one (classes, hidden) tensor, whether it is one parameter or one per class; None without one
    (`model` is the unwrapped language model `attach_label_head` gave it to)."""
    head = getattr(model, LABEL_HEAD, None)
    if isinstance(head, torch.nn.ParameterList):
        return torch.stack(list(head))
    return head


def attach_label_head(model: torch.nn.Module, label_token_ids: Sequence[int] | torch.Tensor,
                      per_class: bool = False) -> None:
    """Give the model its own copy of the label words' output rows (classes x hidden), which a prompt classifier's
    logits then read instead of the output embedding: a trainable head that starts as the zero-shot classifier.
    The copy leaves a tied input embedding alone, and it is tiny (classes x 576 values on SmolLM2), so ZO moves it
    fast. `per_class` makes each class's row a tensor of its own (`label_head.0`, ...)."""
    lm = unwrap(model)
    if hasattr(lm, LABEL_HEAD):
        raise ValueError("the model already has a label head")
    weight = lm.get_output_embeddings().weight
    rows = weight[torch.as_tensor(label_token_ids).to(weight.device)].detach().clone().float()
    if per_class:
        lm.register_module(LABEL_HEAD, torch.nn.ParameterList(
            [torch.nn.Parameter(row.contiguous(), requires_grad=False) for row in rows]))
    else:
        lm.register_parameter(LABEL_HEAD, torch.nn.Parameter(rows.contiguous(), requires_grad=False))


class TrainableConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: SelectionMode = "lora"
    patterns: list[str] = Field(default_factory=list)  # regexes on parameter names ("patterns", "magnitude")
    also_train: list[str] = Field(default_factory=list)  # regexes added to any mode, e.g. a classifier head
    # prompt-classification: train a copy of the label words' output rows (classes x hidden values), started at
    # the model's own rows, in place of the tied output embedding (attach_label_head)
    label_head: bool = False
    # one tensor per class's row instead of one for the head: zofed's block sampling then chooses among the classes,
    # where the one-tensor head is a single block (off by default: docs/method.md, variants tried)
    label_head_per_class: bool = False
    # also train the norm gains of the top k blocks and the final norm (a decoder whose blocks sit in `layers`)
    top_norms: int = Field(0, ge=0)
    lora_r: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_targets: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    # the blocks LoRA adapts (negative: from the top, [-2, -1] the top two); None: every block. Adapters in the
    # top blocks only let zo.cache: prefix run the frozen bottom once per batch
    lora_layers: list[int] | None = None
    # seeds LoRA's and a new classifier head's random init (each its own stream): every party and rerun starts alike
    init_seed: int = Field(0, ge=0, lt=2**64)
    magnitude_fraction: float = Field(0.1, gt=0.0, le=1.0)
    magnitude_keep: Literal["largest", "smallest"] = "largest"

    @model_validator(mode="after")
    def _options_fit_the_mode(self) -> TrainableConfig:
        if self.label_head_per_class and not self.label_head:
            raise ValueError("trainable.label_head_per_class splits the label head: set trainable.label_head=true")
        if self.lora_layers is not None and self.mode != "lora":
            raise ValueError(f"trainable.lora_layers chooses LoRA's blocks, but trainable.mode is {self.mode}")
        return self


@dataclass
class TrainableParams:
    """The selected parameters, in a fixed order that names each tensor's index in the noise streams."""

    names: list[str]
    params: list[torch.nn.Parameter]
    # Per-coordinate noise weights per tensor: a bool mask selects coordinates (trainable.mode magnitude); floats
    # also shape the noise (zo.precondition features); None: every coordinate, flat noise.
    masks: list[torch.Tensor | None] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Flat views sharing storage with the parameters: what the ZO engine updates in place."""
        return [p.data.view(-1) for p in self.params]

    def numel(self) -> int:
        if self.masks is None:
            return sum(p.numel() for p in self.params)
        return sum(int(m.count_nonzero()) if m is not None else p.numel()
                   for p, m in zip(self.params, self.masks, strict=True))

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) pairs, in the selection's order."""
        return list(zip(self.names, self.params, strict=True))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in zip(self.names, self.params, strict=True)}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, p in zip(self.names, self.params, strict=True):
                if tensors[name].shape != p.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensors[name].shape)} != {tuple(p.shape)}")
                p.copy_(tensors[name])


def _matching(model: torch.nn.Module, patterns: list[str], key: str) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters whose names match any of `patterns` (regexes, from the config key `key`)."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ModelLoadError(f"{key}: {pattern!r} is not a regular expression ({err})") from None
    return [(n, p) for n, p in model.named_parameters() if any(c.search(n) for c in compiled)]


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The last name part of each linear layer (what LoRA targets are matched against), for error messages."""
    # GPT-2's projections are transformers' Conv1D, not nn.Linear; matched by name to spare the import.
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"})


def _lora_blocks(model: torch.nn.Module, layers: list[int] | None) -> list[int] | None:
    """trainable.lora_layers as the block indices peft expects (negative ones counted from the top)."""
    if layers is None:
        return None
    count = getattr(model.config, "num_hidden_layers", None)
    if count is None:
        raise ModelLoadError("trainable.lora_layers needs a model whose config names its num_hidden_layers")
    wrong = [i for i in layers if not -count <= i < count]
    if wrong or not layers:
        raise ModelLoadError(f"trainable.lora_layers {layers}: this model has {count} blocks, so each index must "
                             f"lie in [{-count}, {count - 1}] and at least one is needed")
    return sorted({i % count for i in layers})


def _top_norms(model: torch.nn.Module, blocks: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The norm gains of the top `blocks` blocks and the final norm (trainable.top_norms)."""
    count = getattr(model.config, "num_hidden_layers", None)
    if count is None or not 0 < blocks <= count:
        raise ModelLoadError(f"trainable.top_norms {blocks}: this model has "
                             f"{'no num_hidden_layers in its config' if count is None else f'{count} blocks'}")
    top = "|".join(str(i) for i in range(count - blocks, count))
    found = _matching(model, [rf"(^|\.)layers\.({top})\..*norm\.weight$", r"(^|\.)norm\.weight$"],
                      "trainable.top_norms")
    found = [(n, p) for n, p in found if ".layers." not in f".{n}" or re.search(rf"\.layers\.({top})\.", f".{n}")]
    if not any(".layers." not in f".{n}" for n, _ in found):
        raise ModelLoadError("trainable.top_norms: this model has no final norm named `norm` after its blocks")
    return found


def select_trainable(model: torch.nn.Module, config: TrainableConfig,
                     label_token_ids: Sequence[int] | torch.Tensor | None = None) -> tuple[torch.nn.Module,
                                                                                          TrainableParams]:
    """Apply `config` to `model`; returns the (possibly peft-wrapped) model and its trainable parameters.
    `label_token_ids` (a prompt classifier's verbalizer, one token per class) are the rows trainable.label_head
    copies; without a head they are not read."""
    if config.label_head:
        if label_token_ids is None:
            raise ModelLoadError("trainable.label_head needs a task.type prompt-classification task (it trains the "
                                 "verbalizer's output rows); an encoder's classifier is trained with "
                                 "trainable.also_train")
        attach_label_head(model, label_token_ids, config.label_head_per_class)  # before peft wraps the model
    if config.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                          target_modules=config.lora_targets, bias="none",
                          layers_to_transform=_lora_blocks(model, config.lora_layers))
        linear = _linear_names(model)  # before peft wraps the model
        try:
            with seeded_global_rng(streams.lora_init(config.init_seed)):
                model = get_peft_model(model, lora)
        except ValueError as err:  # peft: "Target modules {...} not found in the base model", or unsupported
            raise ModelLoadError(
                f"trainable.lora_targets {config.lora_targets} do not fit this model ({err}); its linear layers "
                f"are named {linear}"
            ) from None
        selected = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    elif config.mode == "all":
        selected = list(model.named_parameters())
    elif config.mode in ("patterns", "magnitude"):
        selected = _matching(model, config.patterns or [".*"], "trainable.patterns")
    elif config.mode == "none":  # only what also_train or label_head add
        selected = []
    else:
        raise ValueError(f"unknown trainable mode {config.mode!r}; choose all, lora, patterns, magnitude or none")
    names = {n for n, _ in selected}
    selected += [(n, p) for n, p in _matching(model, config.also_train, "trainable.also_train") if n not in names]
    if config.top_norms:
        names = {n for n, _ in selected}
        selected += [(n, p) for n, p in _top_norms(model, config.top_norms) if n not in names]
    if config.label_head:
        heads = [(n, p) for n, p in model.named_parameters() if label_head_owner(n) is not None]
        selected += [(n, p) for n, p in heads if n not in {m for m, _ in selected}]
    if not selected and config.mode == "none":
        raise ModelLoadError("trainable.mode none selects nothing by itself: add trainable.label_head=true or "
                             "trainable.also_train patterns")
    if not selected:
        examples = [n for n, _ in model.named_parameters()][:4]
        raise ModelLoadError(f"trainable.patterns {config.patterns} (trainable.mode {config.mode}) match no "
                             f"parameter of this model; its parameters are named like {examples}")
    for p in model.parameters():
        p.requires_grad_(False)
    for n, p in selected:
        if not p.is_contiguous():
            raise ValueError(f"parameter {n} is not contiguous; the ZO engine perturbs flat views in place")
    params = TrainableParams([n for n, _ in selected], [p for _, p in selected])
    if config.mode == "magnitude":
        params.masks = list(magnitude_masks(params.tensors(), config.magnitude_fraction, config.magnitude_keep))
    return model, params
