"""Tasks: how examples become token batches, and how a model's loss and predictions are computed.

- `prompt-classification`: a causal LM reads a prompt template and the class is the label word with the
  highest next-token logit (a verbalizer). Only the last real position's hidden state is projected, and
  only onto the label words' rows of the output embedding: the loss costs one backbone pass.
- `encoder-classification`: an encoder with a classification head (e.g. MiniLM).
- `causal-lm`: instruction data (zofed.data.causal_lm).

`make_task` (task_factory.py) builds the one a config names. A task reads models and never changes them: the
label head it may read is attached by the trainable selection (models/selection.py). Where a frozen body's
remembered features stand in for running it (data/body_features.py), the caller passes the memo (`body=`).
"""

from __future__ import annotations

import json
import logging
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zofed.data.dataset import DataError, TextDataset
from zofed.models.selection import label_head_rows, unwrap

if TYPE_CHECKING:
    from zofed.data.body_features import BodyFeatures
    from zofed.zo.prefix import PrefixCache

TaskType = Literal["prompt-classification", "encoder-classification", "causal-lm"]
# causal-lm prompts: auto takes task.template when one is set, else the tokenizer's chat template when it has
# one, else the instruction template (data/causal_lm.py); chat and template force one of the two.
PromptFormat = Literal["auto", "chat", "template"]
DEFAULT_TEMPLATE = "{text}"
# A label name the model can answer with as it is: one word or code (positive, ABBR, sci-fi), not a phrase or number
LABEL_WORD = re.compile(r"[^\W\d_][\w-]*")

logger = logging.getLogger("zofed.data")


class TaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: TaskType = "prompt-classification"
    template: str = DEFAULT_TEMPLATE
    verbalizer: list[str] = Field(default_factory=list)  # one word per class, for prompt-classification
    max_length: int = Field(128, ge=8)
    # causal-lm only:
    prompt_format: PromptFormat = "auto"
    generate_eval: int = Field(0, ge=0)  # generate for the first N evaluated examples and report rougeL; 0: none
    max_new_tokens: int = Field(128, ge=1)  # the longest generated response
    # the longest response in the evaluations during training (the learning curves); unset: max_new_tokens.
    # Shorter curve answers make each curve point cheap while the final test still answers at full length.
    curve_max_new_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _causal_lm_settings(self) -> TaskConfig:
        # Set for a classification task they would be silently ignored: say so instead.
        if self.type != "causal-lm":
            changed = [name for name in ("prompt_format", "generate_eval", "max_new_tokens", "curve_max_new_tokens")
                       if getattr(self, name) != type(self).model_fields[name].default]
            if changed:
                raise ValueError(f"{', '.join('task.' + name for name in changed)}: settings of task.type causal-lm, "
                                 f"which task.type {self.type} does not use")
        return self


@dataclass
class Encoded:
    """A dataset tokenized once; batches are padded on the fly to their own longest example."""

    input_ids: list[list[int]]
    labels: np.ndarray | None  # class per example, or None
    prompt_lengths: list[int] | None = None  # causal-lm: tokens before the response
    prompt_ids: list[list[int]] | None = None  # causal-lm: the prompt alone, what generation starts from
    references: list[str] | None = None  # causal-lm: the reference response, what a generation is scored against

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor  # class indices, or token targets with -100 for causal-lm

    def to(self, device: torch.device) -> Batch:
        if self.input_ids.device == device:
            return self
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


def template_fields(template: str) -> set[str]:
    """The example fields a prompt template reads ({text} -> "text"); a DataError naming task.template if it is
    not a format string whose fields all have names."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:  # e.g. a lone "{" or "}"
        raise DataError(f"task.template {template!r} is not a valid template ({err}); fields are written "
                        "{text}, a literal brace {{ or }}") from None
    names = {re.split(r"[.\[]", name)[0] for _, name, _, _ in parsed if name is not None}
    if "" in names or any(name.isdigit() for name in names):
        raise DataError(f"task.template {template!r} has a field without a name ({{}} or {{0}}); name the example "
                        "field, e.g. {text}")
    return names


def check_fields(template: str, data: TextDataset, available: set[str]) -> None:
    missing = template_fields(template) - available
    if missing:
        raise DataError(f"task.template uses {', '.join('{' + m + '}' for m in sorted(missing))}, but the examples "
                        f"of {data.name} have the fields {sorted(available)} (data.text_columns picks them)")


def label_shift(labels: np.ndarray, num_classes: int, strength: float) -> torch.Tensor:
    """Logit adjustment against label skew: `strength` x the log of these labels' frequencies (add-one smoothed,
    so a class the client lacks gets a large finite offset, not minus infinity).

    Added to the logits of a client's training loss, it lets the offsets explain the client's own class prior,
    so its local steps stop pushing the shared classifier towards the classes it happens to hold; evaluation and
    the shared model never see it."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ValueError(f"labels span classes {int(labels.min())}..{int(labels.max())}, but the task has "
                         f"{num_classes} classes")
    counts = np.bincount(labels, minlength=num_classes)
    return torch.from_numpy(strength * np.log((counts + 1.0) / (counts.sum() + num_classes))).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a view, so that equal means bit-identical (not -0.0 == 0.0)."""
    return t.view(-1).view(torch.uint8)


def shifted(logits: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    return logits if shift is None else logits + shift.to(logits)


def refuse_body(body: BodyFeatures | None, task_type: str) -> None:
    """Remembered body features feed a prompt classifier's label head; any other task is handed none."""
    if body is not None:
        raise ValueError(f"remembered body features are read by prompt-classification tasks, not {task_type}")


class Task:
    """Common batching and evaluation; subclasses define encoding and the per-batch logits/loss."""

    # A classification template that reads no field gives every example the same input: nothing to learn.
    template_needs_a_field = True
    # The loss reads the logits of the whole vocabulary (causal-lm): a prefix-cached pass runs the output layer in
    # full, and its cost counts it; the classification tasks read a few label rows, too few to count.
    full_vocabulary = False
    # `cached_loss` runs only the blocks above a PrefixCache's split (prompt-classification and causal-lm)
    splits_at_prefix = False
    num_classes: int | None = None  # classification tasks: the width of the logits
    device = torch.device("cpu")  # where batches are made: the model's device (run/setup.py sets it)

    def __init__(self, tokenizer, config: TaskConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.template = config.template
        if not template_fields(config.template) and self.template_needs_a_field:
            raise DataError(f"task.template {config.template!r} uses no example field, so every example would read "
                            "the same; put {text} (or another data field) where the example goes")

    def _render(self, fields: dict[str, str]) -> str:
        try:
            return self.template.format(**fields)
        except KeyError as err:  # examples whose fields differ from the first one's
            raise DataError(f"task.template uses the field {{{err.args[0]}}} but an example has only the fields "
                            f"{sorted(fields)} (data.text_columns picks them)") from None

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        # One call per chunk: a fast tokenizer encodes a list in one go (35,154 tweets: 3.5 s instead of 6.1).
        ids = [row for start in range(0, len(texts), 4096)
               for row in self.tokenizer(texts[start:start + 4096], add_special_tokens=True)["input_ids"]]
        # Keep the end of an over-long prompt: it holds the question the label word answers.
        return [row[-self.config.max_length:] for row in ids]

    def encode(self, data: TextDataset) -> Encoded:
        if data.labels is None:
            raise DataError(f"{data.name} has no labels, and task.type {self.config.type} needs them "
                            "(data.label_column names the label column)")
        if data.fields:
            check_fields(self.template, data, set(data.fields[0]))
        ids = self._tokenize([self._render(f) for f in data.fields])
        return Encoded(ids, np.asarray(data.labels, dtype=np.int64))

    def collate(self, data: Encoded, indices) -> Batch:
        rows = [data.input_ids[i] for i in indices]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, : len(r)] = torch.tensor(r)
            mask[k, : len(r)] = 1
        labels = torch.as_tensor(data.labels[list(indices)])
        return Batch(ids, mask, labels).to(self.device)

    def logits(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def split_logits(self, model: torch.nn.Module, prefixes: PrefixCache, batch: Batch) -> torch.Tensor:
        """The batch's logits with the frozen bottom read from (or run once into) `prefixes`'s memo."""
        raise ValueError(f"a split evaluation works with prompt-classification and causal-lm tasks, not "
                         f"{self.config.type}")

    def cached_loss(self, model: torch.nn.Module, cache: PrefixCache, batch: Batch,
                    shift: torch.Tensor | None = None, *, body: BodyFeatures | None = None) -> Callable[[], float]:
        raise ValueError(f"zo.cache: prefix works with prompt-classification and causal-lm tasks, not "
                         f"{self.config.type}")

    def loss_tensor(self, model: torch.nn.Module, batch: Batch, shift: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss as a tensor (differentiable when autograd is on: first-order baselines use it); `shift`
        (one value per class, `label_shift`) is added to the logits of the training loss only."""
        return F.cross_entropy(shifted(self.logits(model, batch), shift), batch.labels)

    @torch.no_grad()
    def loss(self, model: torch.nn.Module, batch: Batch, shift: torch.Tensor | None = None) -> float:
        return float(self.loss_tensor(model, batch, shift))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, data: Encoded, batch_size: int = 32,
                 indices=None, *, body: BodyFeatures | None = None,
                 prefixes: PrefixCache | None = None) -> dict[str, float]:
        """Accuracy and mean loss over `indices` (all examples by default); `body`: remembered features to read
        instead of running the frozen body (prompt-classification only); `prefixes`: a split whose memo remembers
        each example's frozen prefix, so only the blocks above it run (`split_logits`)."""
        refuse_body(body, self.config.type)
        order = by_length(data, indices)
        correct, loss_sum = 0, 0.0
        for start in range(0, len(order), batch_size):
            batch = self.collate(data, order[start:start + batch_size])
            logits = self.logits(model, batch) if prefixes is None else self.split_logits(model, prefixes, batch)
            loss_sum += float(F.cross_entropy(logits, batch.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == batch.labels).sum())
        n = max(1, len(order))
        return {"accuracy": correct / n, "loss": loss_sum / n}

    def evaluate_during_training(self, model: torch.nn.Module, data: Encoded, batch_size: int, indices, *,
                                 body: BodyFeatures | None = None,
                                 prefixes: PrefixCache | None = None) -> dict[str, float]:
        """A learning-curve point on the watched examples `indices`: the same measures as the final test."""
        return self.evaluate(model, data, batch_size, indices, body=body, prefixes=prefixes)


def by_length(data: Encoded, indices=None) -> np.ndarray:
    """`indices` (all examples by default) ordered by length: batches of similar lengths waste less compute on
    padding, and an evaluation's totals do not depend on the order."""
    order = np.arange(len(data)) if indices is None else np.asarray(indices)
    return order[np.argsort([len(data.input_ids[i]) for i in order], kind="stable")]


def last_position(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each row's hidden state at its last real token (right padding): rows x hidden."""
    last = batch.attention_mask.sum(1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def verbalizer_option(words: Sequence[str]) -> str:
    """A `--set` option that sets task.verbalizer to `words`, quoted for a shell: ready to copy."""
    items = ", ".join(w if LABEL_WORD.fullmatch(w) else json.dumps(w, ensure_ascii=False) for w in words)
    return "--set '" + f"task.verbalizer=[{items}]".replace("'", "'\\''") + "'"


def label_verbalizer(label_names: Sequence[str]) -> list[str]:
    """task.verbalizer's default: the data's label names, when each is one word or code the model can answer with
    (a note says so and how to choose others). Names that are phrases or numbers stop the run with a `--set` line
    naming them, in class order, to edit into one word each."""
    names = list(label_names)
    if all(LABEL_WORD.fullmatch(name) for name in names):
        logger.info("task.verbalizer is unset: the model answers with the label names %s; to choose other words, "
                    "one per class in this order: %s", names, verbalizer_option(names))
        return names
    raise DataError(f"task.verbalizer is unset, and the data's label names {names} are not single words the model "
                    f"could answer with; give one word per class, in this order, e.g. edit each name to a word in "
                    f"{verbalizer_option(names)}")


class PromptClassification(Task):
    splits_at_prefix = True

    def __init__(self, tokenizer, config: TaskConfig, num_classes: int,
                 label_names: Sequence[str] | None = None) -> None:
        """`label_names` (the data's, in class order) stand in for an unset task.verbalizer (`label_verbalizer`)."""
        super().__init__(tokenizer, config)
        defaulted = not config.verbalizer and label_names is not None and len(label_names) == num_classes
        self.verbalizer = label_verbalizer(label_names) if defaulted else list(config.verbalizer)
        if len(self.verbalizer) != num_classes:
            raise DataError(f"task.verbalizer has {len(self.verbalizer)} words {self.verbalizer} for the data's "
                            f"{num_classes} classes; give one word per class, in the order of the label names")
        ids = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in self.verbalizer]
        empty = [w for w, i in zip(self.verbalizer, ids, strict=True) if not i]
        if empty:
            raise DataError(f"task.verbalizer words {empty} encode to no token; pick real words")
        self.label_token_ids = torch.tensor([i[0] for i in ids])
        self.num_classes = num_classes
        if len(set(self.label_token_ids.tolist())) != num_classes:
            where = "the label names (task.verbalizer is unset)" if defaulted else "task.verbalizer words"
            raise DataError(f"{where} {self.verbalizer} share their first token, so the model could not tell their "
                            f"classes apart; pick words that start differently: {verbalizer_option(self.verbalizer)}")

    def _rows(self, body: BodyFeatures, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The body features of the examples `ids` (token ids each) from `body`, running only those it has not
        seen (each alone)."""
        return body.lookup(ids, partial(self._features_alone, body.cache))

    def _batch_rows(self, body: BodyFeatures, batch: Batch) -> torch.Tensor:
        """The body features of a batch's rows from `body`, running only the rows not seen before."""
        lengths = batch.attention_mask.sum(1).tolist()
        return self._rows(body, [row[:n] for row, n in zip(batch.input_ids.tolist(), lengths, strict=True)])

    def _features_alone(self, cache: PrefixCache, ids: Sequence[int]) -> torch.Tensor:
        """One example's body features (hidden), run alone with no padding: the only way features are computed,
        so a row is a function of the example alone, never of the batch that met it, and a remembered row
        (BodyFeatures.lookup) equals a recomputed one bit for bit."""
        device = next(cache.backbone.parameters()).device
        input_ids = torch.as_tensor([list(ids)], dtype=torch.long, device=device)
        alone = Batch(input_ids, torch.ones_like(input_ids), torch.zeros(1, dtype=torch.long, device=device))
        return self._capture_last(cache, alone)[0]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, data: Encoded, batch_size: int = 32,
                 indices=None, *, body: BodyFeatures | None = None,
                 prefixes: PrefixCache | None = None) -> dict[str, float]:
        """Accuracy and mean loss over `indices`; with `body` (every block frozen) each example runs through the
        body once per memo, and afterwards only the final norm and the head read its remembered row."""
        if body is None:
            return super().evaluate(model, data, batch_size, indices, prefixes=prefixes)
        order = by_length(data, indices)
        if not order.size:
            return {"accuracy": 0.0, "loss": 0.0}
        logits = self.feature_logits(model, body.cache, self.last_features(body.cache, data, order, body=body))
        labels = torch.as_tensor(data.labels[order], device=logits.device)
        return {"accuracy": int((logits.argmax(-1) == labels).sum()) / order.size,
                "loss": float(F.cross_entropy(logits, labels, reduction="sum")) / order.size}

    def logits(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        lm = unwrap(model)
        backbone = getattr(lm, lm.base_model_prefix)
        hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        return self.logits_from_hidden(model, hidden, batch)

    def split_logits(self, model: torch.nn.Module, prefixes: PrefixCache, batch: Batch) -> torch.Tensor:
        prefix = prefixes.capture(batch.input_ids, batch.attention_mask)
        return self.head_logits(model, prefixes.last_hidden(prefix, batch.attention_mask))

    def cached_loss(self, model: torch.nn.Module, cache: PrefixCache, batch: Batch,
                    shift: torch.Tensor | None = None, *, body: BodyFeatures | None = None) -> Callable[[], float]:
        """The batch's loss as a function of the trainable top blocks only: the frozen bottom runs once, here (or
        is read from the simulator's prefix memo), or not at all when `body` (every block frozen) remembers its rows."""
        if body is not None:
            return self.feature_loss_fn(model, cache, self._batch_rows(body, batch), batch.labels, shift)
        prefix = cache.capture(batch.input_ids, batch.attention_mask)
        kept: dict = {}  # block outputs a pass reuses while the blocks' trainable tensors keep their bits

        @torch.no_grad()
        def loss() -> float:  # the top block runs at each row's last position, all the label logits read
            logits = self.head_logits(model, cache.last_hidden(prefix, batch.attention_mask, kept))
            return float(F.cross_entropy(shifted(logits, shift), batch.labels))

        return loss

    @torch.no_grad()
    def last_features(self, cache: PrefixCache, data: Encoded, indices: np.ndarray, *,
                      body: BodyFeatures | None = None) -> torch.Tensor:
        """What the final norm receives at each example's last position (examples x hidden), for a model whose
        blocks are all frozen (`cache` splits at the final norm): the only input the label logits read, so a client
        computes it once and takes as many steps on it as it likes (zo.cache: features). Each example runs alone,
        whether `body` remembers it or not: the two give the same bits."""
        if cache.start != len(cache.layers):
            raise ValueError(f"cached features need every block frozen; the trainable tensors start at block "
                             f"{cache.start} of {len(cache.layers)}")
        ids = [data.input_ids[i] for i in np.asarray(indices)]
        if body is not None:
            return self._rows(body, ids)
        return torch.stack([self._features_alone(cache, row) for row in ids])

    @torch.no_grad()
    def _capture_last(self, cache: PrefixCache, batch: Batch) -> torch.Tensor:
        prefix = cache.capture(batch.input_ids, batch.attention_mask)
        hidden = prefix.args[0] if prefix.args else prefix.kwargs["hidden_states"]
        return last_position(hidden, batch)

    def feature_loss(self, model: torch.nn.Module, cache: PrefixCache, features: torch.Tensor, labels: torch.Tensor,
                     shift: torch.Tensor | None = None) -> float:
        """The mean loss of examples given by their `last_features`: the final norm and the head, nothing more."""
        return self.feature_loss_fn(model, cache, features, labels, shift)()

    def feature_loss_fn(self, model: torch.nn.Module, cache: PrefixCache, features: torch.Tensor,
                        labels: torch.Tensor, shift: torch.Tensor | None = None) -> Callable[[], float]:
        """`feature_loss` as a function of the current weights, for a ZO step that reads it once per query: the
        module lookups are done once, and the normed features are kept while the norm's values stay bit for bit
        the same (they move only when the norm is trainable)."""
        head, norm = self._head(model, features.device), cache.backbone.norm
        params = [_bits(p.detach()) for p in norm.parameters()]  # views: they see the weights move in place
        kept: list = []  # [the norm's bytes, norm(features)]

        @torch.no_grad()
        def loss() -> float:
            if not kept or not all(torch.equal(p, q) for p, q in zip(params, kept[0], strict=True)):
                kept[:] = [[p.clone() for p in params], norm(features)]
            return float(F.cross_entropy(shifted(head(kept[1]), shift), labels))

        return loss

    def feature_logits(self, model: torch.nn.Module, cache: PrefixCache, features: torch.Tensor) -> torch.Tensor:
        """Label-word logits of examples given by their `last_features`."""
        return self.head_logits(model, cache.backbone.norm(features))

    def logits_from_hidden(self, model: torch.nn.Module, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Label-word logits at each row's last position, from the backbone's last hidden state."""
        return self.head_logits(model, last_position(hidden, batch))

    def head_logits(self, model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Label-word logits of last-position hidden states (rows x hidden, after the final norm)."""
        return self._head(model, h.device)(h)

    def _head(self, model: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """`head_logits` with the head's modules looked up once; its weights are read at each call."""
        lm = unwrap(model)
        head = lm.get_output_embeddings()
        ids = self.label_token_ids.to(device)
        bias = getattr(head, "bias", None)

        def logits(h: torch.Tensor) -> torch.Tensor:
            rows = label_head_rows(lm)
            out = h @ (rows if rows is not None else head.weight[ids]).to(h.dtype).T  # a narrowed head widens here
            return out if bias is None else out + bias[ids]

        return logits


class EncoderClassification(Task):
    def logits(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
