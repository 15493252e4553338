"""The causal-lm task: instruction tuning on (instruction, context, response) records.

The loss is the mean next-token loss over the response tokens (and the end-of-sequence token) only; with
`task.generate_eval` an evaluation also answers greedily and scores ROUGE-L against the reference responses
(zofed.data.generation). The prompt is the tokenizer's chat template or a text template (`task.prompt_format`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn.functional as F

from zofed.data.dataset import DataError, TextDataset
from zofed.data.generation import Progress, generate_texts, rouge_l
from zofed.data.tasks import DEFAULT_TEMPLATE, Batch, Encoded, Task, TaskConfig, check_fields, refuse_body
from zofed.models.selection import unwrap
from zofed.zo.prefix import PrefixCache

if TYPE_CHECKING:
    from zofed.data.body_features import BodyFeatures

INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{context}\n\n### Response:\n"


def scored(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions whose next token the loss scores (a (batch, length - 1) mask: the response and end-of-sequence
    tokens) and those next tokens, in the mask's row-major order."""
    mask = labels[:, 1:] != -100
    return mask, labels[:, 1:][mask]


def scored_logits(model: torch.nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The output layer's logits at the scored positions only, from the backbone's last hidden state: on a long
    prompt the vocabulary projection of every position would cost more than the top blocks do."""
    lm = unwrap(model)
    logits = lm.get_output_embeddings()(hidden[:, :-1][mask])
    cap = getattr(lm.config, "final_logit_softcapping", None)  # Gemma 2 caps its logits after the projection
    return logits if cap is None else torch.tanh(logits / cap) * cap


def last_hidden(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The backbone's last hidden state (after its final norm), without the output layer; a LoRA model's adapters
    live inside the backbone's blocks, so they run."""
    backbone = unwrap(model).base_model
    return backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).last_hidden_state


def resolve_prompt_format(tokenizer, config: TaskConfig) -> Literal["chat", "template"]:
    """How a causal-lm task writes its prompts: the tokenizer's chat template or a text template."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    template_set = config.template != DEFAULT_TEMPLATE
    if config.prompt_format == "chat":
        if not has_chat:
            raise DataError("task.prompt_format=chat needs a tokenizer with a chat template, and this model's has "
                            "none; use task.prompt_format=template (task.template, or the built-in instruction "
                            "template)")
        if template_set:  # it would be silently ignored
            raise DataError("task.template is not used with task.prompt_format=chat; drop one of the two")
        return "chat"
    if config.prompt_format == "template" or template_set:  # a template the user wrote wins over auto's chat
        return "template"
    return "chat" if has_chat else "template"


class CausalLM(Task):
    """Instruction tuning: the loss covers the response (and end-of-sequence) tokens only; with
    `task.generate_eval` evaluation also generates greedily and scores ROUGE-L against the reference responses."""

    template_needs_a_field = False  # a fixed instruction before each response is a valid causal-lm prompt
    full_vocabulary = True
    splits_at_prefix = True
    # Told (answers done, answers asked) after each generated batch of an evaluation: a run shows it on its
    # progress bar, since generating takes minutes on a CPU where the rest of an evaluation takes seconds.
    on_generated: Callable[[int, int], None] | None = None

    def __init__(self, tokenizer, config: TaskConfig) -> None:
        super().__init__(tokenizer, config)
        self.prompt_format = resolve_prompt_format(tokenizer, config)
        self.template = config.template if config.template != DEFAULT_TEMPLATE else INSTRUCTION_TEMPLATE

    def prompt(self, fields: dict[str, str]) -> list[int]:
        """The prompt's token ids for one example (its instruction and context, or the template's fields)."""
        fields = {"instruction": "", "context": "", **fields}
        if self.prompt_format == "chat":
            user = "\n\n".join(text for text in (fields["instruction"], fields["context"]) if text)
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                      add_generation_prompt=True)
            # The chat template writes the special tokens the model expects; the tokenizer must not add more.
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(self._render(fields), add_special_tokens=True)["input_ids"]

    def generation_prompt(self, prompt: list[int]) -> list[int]:
        """What generation starts from: the end of an over-long prompt, which holds the cue to answer (the assistant
        turn); training instead cuts the response, so the two agree whenever the prompt fits task.max_length."""
        return prompt[-self.config.max_length:]

    def _check_prompt_fields(self, data: TextDataset) -> None:
        if not data.fields:
            return
        available = set(data.fields[0])
        if self.prompt_format == "template":
            check_fields(self.template, data, {"instruction", "context", *available})
        elif "instruction" not in available:  # an empty user turn would teach nothing
            raise DataError(f"task.prompt_format chat builds the user turn from the instruction and context fields, "
                            f"but the examples of {data.name} have the fields {sorted(available)} (data.text_columns "
                            "picks them); or set task.prompt_format=template with a task.template")

    def encode(self, data: TextDataset) -> Encoded:
        self._check_prompt_fields(data)
        ids, prompt_lengths, prompts, references = [], [], [], []
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        for f in data.fields:
            prompt = self.prompt(f)
            reference = f.get("response", "")
            response = self.tokenizer(reference, add_special_tokens=False)["input_ids"] + eos
            row = (prompt + response)[: self.config.max_length]
            ids.append(row)
            prompt_lengths.append(min(len(prompt), len(row)))
            prompts.append(self.generation_prompt(prompt))
            references.append(reference)
        return Encoded(ids, None, prompt_lengths, prompts, references)

    def collate(self, data: Encoded, indices) -> Batch:
        rows = [data.input_ids[i] for i in indices]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for k, i in enumerate(indices):
            r = data.input_ids[i]
            ids[k, : len(r)] = torch.tensor(r)
            mask[k, : len(r)] = 1
            labels[k, data.prompt_lengths[i]: len(r)] = torch.tensor(r[data.prompt_lengths[i]:])
        return Batch(ids, mask, labels).to(self.device)

    def loss_tensor(self, model: torch.nn.Module, batch: Batch, shift: torch.Tensor | None = None) -> torch.Tensor:
        if shift is not None:
            raise ValueError("a logit shift (federation.logit_adjust) needs a classification task, not causal-lm")
        mask, targets = scored(batch.labels)
        return F.cross_entropy(scored_logits(model, last_hidden(model, batch), mask), targets)

    def cached_loss(self, model: torch.nn.Module, cache: PrefixCache, batch: Batch,
                    shift: torch.Tensor | None = None, *, body: BodyFeatures | None = None) -> Callable[[], float]:
        """The batch's response loss as a function of the trainable top blocks only: the frozen bottom runs once,
        here (or is read from the simulator's prefix memo), and each call runs the blocks from the cache's split
        up, the final norm and the output layer (at the scored positions only; the cache's cost still counts it at
        every position, an upper bound)."""
        refuse_body(body, self.config.type)
        if shift is not None:
            raise ValueError("a logit shift (federation.logit_adjust) needs a classification task, not causal-lm")
        if cache.output_layer is None:  # its passes would run a layer the cache does not charge
            raise ValueError("a causal-lm cached loss needs a PrefixCache built with output_layer=True")
        prefix = cache.capture(batch.input_ids, batch.attention_mask)
        mask, targets = scored(batch.labels)

        @torch.no_grad()
        def loss() -> float:
            return float(F.cross_entropy(scored_logits(model, cache.hidden(prefix), mask), targets))

        return loss

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, data: Encoded, batch_size: int = 16,
                 indices=None, max_new_tokens: int | None = None, *,
                 body: BodyFeatures | None = None, prefixes: PrefixCache | None = None) -> dict[str, float]:
        """The mean response-token loss over `indices` (all examples by default) and, with task.generate_eval > 0,
        the mean ROUGE-L of greedy generations (at most `max_new_tokens`, default task.max_new_tokens, new
        tokens) for the first generate_eval of them; `prefixes`: a split whose memo remembers each example's
        frozen prefix, so the loss runs only the blocks above it (generation runs the whole model)."""
        refuse_body(body, self.config.type)
        order = np.arange(len(data)) if indices is None else np.asarray(indices)
        total, count = 0.0, 0
        for start in range(0, len(order), batch_size):
            batch = self.collate(data, order[start:start + batch_size])
            mask, targets = scored(batch.labels)
            hidden = (last_hidden(model, batch) if prefixes is None
                      else prefixes.hidden(prefixes.capture(batch.input_ids, batch.attention_mask)))
            logits = scored_logits(model, hidden, mask)
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += len(targets)
        result = {"loss": total / max(1, count)}
        if self.config.generate_eval > 0:
            result["rougeL"] = self.generation_score(model, data, order[: self.config.generate_eval], batch_size,
                                                     max_new_tokens)
        return result

    def evaluate_during_training(self, model: torch.nn.Module, data: Encoded, batch_size: int, indices, *,
                                 body: BodyFeatures | None = None,
                                 prefixes: PrefixCache | None = None) -> dict[str, float]:
        """A learning-curve point: answers at most task.curve_max_new_tokens long (unset: max_new_tokens)."""
        return self.evaluate(model, data, batch_size, indices, self.config.curve_max_new_tokens, body=body,
                             prefixes=prefixes)

    def generate(self, model: torch.nn.Module, prompts: list[list[int]], batch_size: int = 16,
                 progress: Progress | None = None, max_new_tokens: int | None = None) -> list[str]:
        """Greedy responses to tokenized prompts (from `prompt`), at most `max_new_tokens` (default
        task.max_new_tokens) long."""
        limit = max_new_tokens or self.config.max_new_tokens
        return generate_texts(model, self.tokenizer, prompts, max_new_tokens=limit, batch_size=batch_size,
                              progress=progress)

    def generation_score(self, model: torch.nn.Module, data: Encoded, indices, batch_size: int = 16,
                         max_new_tokens: int | None = None) -> float:
        """Mean ROUGE-L of the greedy responses to the examples at `indices` against their reference responses."""
        if data.prompt_ids is None or data.references is None:
            raise ValueError("generation-based evaluation needs the prompts and references that CausalLM.encode "
                             "stores; this data set was encoded without them")
        report, total = self.on_generated, len(indices)
        progress = None if report is None else (lambda done: report(done, total))
        predictions = self.generate(model, [data.prompt_ids[i] for i in indices], batch_size, progress,
                                    max_new_tokens=max_new_tokens)
        return rouge_l(predictions, [data.references[i] for i in indices])
