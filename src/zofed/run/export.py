"""`zofed export`: a run's tuned model as a standard `save_pretrained` directory that transformers (and peft, for a
LoRA adapter) load without zofed.

A run stores only its trainable tensors (`final/trainable.safetensors`); export rebuilds the run's model with them
and writes:
- LoRA: the PEFT adapter directory (`PeftModel.from_pretrained(base, DIR)`), or with `merge` the full model with
  the adapter folded into its weights;
- anything else: the full model (`AutoModelFor...from_pretrained(DIR)`). A trained label head (the verbalizer's
  own output rows) is written into the output embedding's label rows, untied from the input embedding, so the
  plain model scores the label words exactly as the run did;
and the tokenizer beside it. The directory appears whole or not at all.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zofed.atomic_files import publish_directory
from zofed.data.tasks import PromptClassification
from zofed.models.selection import LABEL_HEAD, label_head_rows, unwrap
from zofed.run.config import ConfigError
from zofed.run.setup import Setup, load_run


@dataclass(frozen=True)
class Exported:
    out: Path
    kind: str  # "peft adapter", "full model" or "full model (LoRA merged)"
    files: list[str]


def export_run(run_dir: str | Path, out: str | Path, *, merge: bool = False) -> Exported:
    """Write the tuned model of `run_dir` to `out` (which must not exist, or be empty)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory; choose a new --out")
    setup = load_run(run_dir)
    lora = hasattr(setup.model, "peft_config")
    if merge and not lora:
        raise ConfigError(f"--merge folds a LoRA adapter into the model, but {run_dir} trained "
                          f"trainable.mode={setup.config.trainable.mode}, not lora")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model = setup.model
    if lora and merge:
        model, kind = model.merge_and_unload(), "full model (LoRA merged)"
    else:
        kind = "peft adapter" if lora else "full model"
    if not lora:
        _fold_label_head(setup)
    try:
        model.save_pretrained(tmp)
        setup.task.tokenizer.save_pretrained(tmp)
        publish_directory(tmp, out)  # over an empty `out` only: one that filled up meanwhile is kept
    except FileExistsError as error:
        raise ConfigError(f"{out} is no longer empty; nothing was written over it, choose a new --out") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once published; a failed export leaves no partial copy
    return Exported(out, kind, sorted(p.name for p in out.iterdir()))


@torch.no_grad()
def _fold_label_head(setup: Setup) -> None:
    """Move a trained label head into the output embedding's label rows, on an untied copy of that embedding."""
    lm = unwrap(setup.model)
    rows = label_head_rows(lm)
    if rows is None:
        return
    if not isinstance(setup.task, PromptClassification):  # build() only attaches it to such a task
        raise ConfigError("a label head needs a prompt-classification task")
    head = lm.get_output_embeddings()
    weight = head.weight.detach().clone()  # untied: the input embedding keeps its rows
    weight[setup.task.label_token_ids.to(weight.device)] = rows.to(weight.dtype)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    lm.config.tie_word_embeddings = False
    if hasattr(lm.config, "get_text_config"):  # nested configs keep their own copy of the flag
        lm.config.get_text_config().tie_word_embeddings = False
    if LABEL_HEAD in lm._modules:  # one tensor per class
        del lm._modules[LABEL_HEAD]
    else:
        del lm._parameters[LABEL_HEAD]
