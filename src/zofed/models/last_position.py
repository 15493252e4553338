"""The top block of a decoder run at each row's last position only: what a classification loss reads.

A prompt classifier reads the label logits off each row's last real token. Below the top block every position
matters (the blocks above attend to them), but the top block's output is read at that one position: its keys and
values need every position, while its query, attention output, residual and MLP are needed at the last one. On
SmolLM2 the MLP and the query and output projections are 94% of a block's weights: its top block ran 11 times
faster this way (docs/engine.md), a pass over the top 4 blocks about a quarter faster.

The result is the full block's at that position within float rounding (the products run over other shapes), not
bit for bit. The keys and values over every position cost most of such a pass, so it comes in two halves
(`attended_at_last_position`, `finish_at_last_position`): a pass that changes only the post-attention norm or the
MLP reuses the first. Only transformers' Llama block (SmolLM2 and the other Llama-architecture models) is computed
this way: its attention is plain scaled dot-product attention with rotary positions and grouped key-value heads; any
other block runs whole (`supports_last_position`). Rows must be right-padded (each row's real tokens first), as
zofed's collate pads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # the block whose arithmetic is reproduced here
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, repeat_kv, rotate_half
except ImportError:  # a transformers without Llama: every block runs whole
    LlamaDecoderLayer = None  # type: ignore[assignment,misc]


def supports_last_position(block: torch.nn.Module) -> bool:
    """Whether `block` can be run at the last positions alone: exactly transformers' Llama block, whose attention
    is eager or SDPA (the same softmax attention) with no dropout in effect (Llama's default of 0, or eval mode)."""
    if LlamaDecoderLayer is None or type(block) is not LlamaDecoderLayer:
        return False
    attn = block.self_attn
    if attn.training and attn.attention_dropout:
        return False
    return getattr(attn.config, "_attn_implementation", "eager") in ("eager", "sdpa")


def feeds_attention(name: str) -> bool:
    """Whether the tensor called `name` (a Llama block's, as named in the model) changes what the block's attention
    gives at the last position: its input norm and attention projections (LoRA adapters on them included), not its
    post-attention norm or MLP."""
    return ".self_attn." in name or ".input_layernorm." in name


def attended_at_last_position(block: torch.nn.Module, hidden: torch.Tensor, last: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The residual stream of `block` (a Llama block) after its attention, at position `last[b]` of each row b
    (rows x width), given its input `hidden` (rows x positions x width) and the rotary embeddings (cos, sin) the
    backbone passes its blocks. Each row's query attends to its positions up to `last[b]`, as the causal mask lets
    it."""
    attn = block.self_attn
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    normed = block.input_layernorm(hidden)
    width = attn.head_dim
    query = attn.q_proj(normed[rows, last]).view(len(rows), 1, -1, width).transpose(1, 2)
    key = attn.k_proj(normed).view(*hidden.shape[:2], -1, width).transpose(1, 2)
    value = attn.v_proj(normed).view(*hidden.shape[:2], -1, width).transpose(1, 2)
    cos, sin = (t.expand(hidden.shape[0], *t.shape[1:]) for t in position_embeddings)
    cos_q, sin_q = cos[rows, last][:, None, None], sin[rows, last][:, None, None]
    query = query * cos_q + rotate_half(query) * sin_q
    key = key * cos[:, None] + rotate_half(key) * sin[:, None]
    key, value = repeat_kv(key, attn.num_key_value_groups), repeat_kv(value, attn.num_key_value_groups)
    visible = torch.arange(hidden.shape[1], device=hidden.device)[None] <= last[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible[:, None, None, :],
                                         scale=attn.scaling)
    return hidden[rows, last] + attn.o_proj(out.transpose(1, 2).reshape(len(rows), -1))


def finish_at_last_position(block: torch.nn.Module, attended: torch.Tensor) -> torch.Tensor:
    """The output of `block` at the last positions from its residual after attention (`attended_at_last_position`):
    the post-attention norm and the MLP, row by row."""
    return attended + block.mlp(block.post_attention_layernorm(attended))


def block_at_last_position(block: torch.nn.Module, hidden: torch.Tensor, last: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The output of `block` (a Llama block) at position `last[b]` of each row b (rows x width), given its input
    `hidden` (rows x positions x width) and the rotary embeddings: its attention, then its MLP."""
    return finish_at_last_position(block, attended_at_last_position(block, hidden, last, position_embeddings))
