"""Tiny random-init models with an in-memory word-level tokenizer, for fast unit tests everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zofed.models.registry import CAUSAL_LM, ENCODER, LoadedModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_TINY_SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
_TINY_WORDS = [
    "the", "movie", "review", "sentiment", "is", "was", "a", "it", "not", "and",
    "good", "bad", "great", "awful", "positive", "negative", "neutral", ":", ".", ",",
]  # fmt: skip


def tiny_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerBase:
    """A word-level tokenizer built in memory: specials, a few real words, then "w0", "w1", ... ."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    fixed = _TINY_SPECIALS + _TINY_WORDS
    if vocab_size < len(fixed):
        raise ValueError(
            f"vocab_size must be at least {len(fixed)} to hold the fixed words, got {vocab_size}"
        )
    words = fixed + [f"w{i}" for i in range(vocab_size - len(fixed))]
    backend = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces, verbatim
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=128,
        padding_side="right",
        clean_up_tokenization_spaces=False,  # decode(encode(text)) gives back the lowercased text exactly
        # Llama's forward rejects token_type_ids, and the shared tokenizer must serve both tiny models.
        model_input_names=["input_ids", "attention_mask"],
    )
    return tokenizer


def tiny_causal_lm(vocab_size: int = 64, seed: int = 0, num_layers: int = 2) -> LoadedModel:
    """A random Llama (~21k parameters at vocab 64 and 2 layers) for fast unit tests; same seed, same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = _seeded(lambda: LlamaForCausalLM(config), seed)
    return LoadedModel(model=model, tokenizer=tokenizer, kind=CAUSAL_LM, name="tiny-llama", source="<memory>")


def tiny_encoder(num_labels: int = 2, seed: int = 0, vocab_size: int = 64) -> LoadedModel:
    """A random 2-layer BERT classifier sharing tiny_tokenizer's vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = tiny_tokenizer(vocab_size)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _seeded(lambda: BertForSequenceClassification(config), seed)
    return LoadedModel(model=model, tokenizer=tokenizer, kind=ENCODER, name="tiny-bert", source="<memory>")


def _seeded(build, seed: int) -> torch.nn.Module:
    # fork_rng leaves the caller's global RNG stream untouched, so building a model mid-test is harmless.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(dtype=torch.float32).eval()


