"""Noise shaped by the features each trainable coordinate multiplies (`zo.precondition: features` or `channels`).

A coordinate of a norm gain or a linear weight acts on one input feature, so its gradient scales with that
feature's size. Decoder LMs carry a few "massive" feature channels far above the median, and the coordinates that
read them hold most of the squared gradient: isotropic noise then spends each step's one scalar on those few
steep coordinates, and every other coordinate's update is mostly noise. Drawing coordinate j's noise with scale
1 / rms(feature j) (a diagonal Gauss-Newton preconditioner: the estimate's mean becomes P^2 g) lets the steps
see the rest.

The feature sizes are measured once, on random token sequences through the starting model: the massive channels
are a property of the model, not of the data, so no party's data is read and every party derives the same shape.
The server pays the passes (`SETUP_PASSES` of `SEQUENCES` x `LENGTH` tokens) once; a deployment sends the shape
down once.

Per trainable tensor: an RMSNorm-like gain (a module with `variance_epsilon`) or `nn.LayerNorm` weight uses its
normalized input; an `nn.Linear` weight (a LoRA A or B, a full projection) its input features along its columns;
a prompt classifier's label head (trainable.label_head) the last hidden state the output projection reads, where
the massive channels make a linear head's loss steep along a few of its columns and flat along the rest;
anything else keeps flat noise. Within a tensor the shape is median-relative, clipped to [1/32, 4] (a dead
channel is not given a huge step) and scaled to a mean square of 1, so eps and each tensor's noise energy keep
their meaning.

`zo.precondition: channels` takes the opposite view: where a few coordinates hold nearly all of a tensor's squared
gradient (SmolLM2-135M's top norm gains: docs/results/gradient_concentration.md), the noise on every other
coordinate is what limits a ZO step, so only the coordinates reading each tensor's `zo.channels` largest features
move: a bool mask, and each step estimates the gradient over those few coordinates alone.

The shape is not bit-exact across machines: the passes' matrix products sum in an order that depends on the
device, the BLAS and the thread count. So `zofed replay`, which would measure it again, refuses a run with such
noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from zofed.models.selection import label_head_owner

SEQUENCES, LENGTH, BATCH = 64, 64, 8  # random sequences measured, their length, and how many a pass
SETUP_PASSES = SEQUENCES // BATCH
CLIP = (1 / 32, 4.0)
SEED = 0x5EA1  # one fixed draw of token sequences: every party measures the same ones


def _is_norm(module: torch.nn.Module) -> bool:
    return hasattr(module, "variance_epsilon") or isinstance(module, torch.nn.LayerNorm)


def _features(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The features the module's weight multiplies: a norm's normalized input, a linear layer's input."""
    if hasattr(module, "variance_epsilon"):  # Llama/Qwen-style RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    if isinstance(module, torch.nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)
    return x


def _shape(rms: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor's flat noise multipliers from its input features' RMS (repeated over `rows` output rows)."""
    scale = (rms.median() / rms.clamp_min(1e-12)).clamp(*CLIP)
    flat = scale.repeat(rows)
    return flat / flat.pow(2).mean().sqrt()


@torch.no_grad()
def feature_rms(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per trainable tensor that multiplies features, the RMS of each feature it reads, from random token sequences
    (a tensor that reads none is left out)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        head_owner = label_head_owner(name)
        if head_owner is not None:  # the label words' rows multiply what the output projection reads: the last hidden
            module = (model.get_submodule(head_owner) if head_owner else model).get_output_embeddings()
        else:
            module = model.get_submodule(owner) if owner else model
            if leaf != "weight" or not (isinstance(module, torch.nn.Linear) or _is_norm(module)):
                continue

        def measure(mod, args, name=name):
            features = _features(mod, args[0].float())
            flat = features.reshape(-1, features.shape[-1])
            sums[name] = sums.get(name, 0) + flat.pow(2).sum(0)
            counts[name] = counts.get(name, 0) + flat.shape[0]

        hooks.append(module.register_forward_pre_hook(measure))
    try:
        device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(SEED))
        for start in range(0, SEQUENCES, BATCH):
            batch = ids[start:start + BATCH].to(device)
            model(input_ids=batch, attention_mask=torch.ones_like(batch))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (sums[name] / counts[name]).sqrt() for name in sums}


def feature_noise_scales(model: torch.nn.Module, names: Sequence[str],
                         params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """Per trainable tensor, flat multipliers of its noise (None: flat noise), from random token sequences."""
    measured = feature_rms(model, names)
    scales: list[torch.Tensor | None] = []
    for name, param in zip(names, params, strict=True):
        if name not in measured:
            scales.append(None)
            continue
        rms = measured[name]
        scales.append(_shape(rms, param.numel() // rms.numel()).to(param.device, torch.float32))
    return scales


def top_channel_masks(model: torch.nn.Module, names: Sequence[str], params: Sequence[torch.nn.Parameter],
                      channels: int) -> list[torch.Tensor | None]:
    """Per trainable tensor, a flat bool mask of the coordinates that read its `channels` largest features (every
    output row's, for a matrix); None for a tensor that reads none, or no more than `channels` (all of it moves)."""
    measured = feature_rms(model, names)
    masks: list[torch.Tensor | None] = []
    for name, param in zip(names, params, strict=True):
        rms = measured.get(name)
        if rms is None or rms.numel() <= channels:
            masks.append(None)
            continue
        # a stable sort breaks ties by channel index, so every party picks the same channels from the same sizes
        order = torch.sort(rms.cpu(), descending=True, stable=True).indices
        top = torch.zeros(rms.numel(), dtype=torch.bool)
        top[order[:channels]] = True
        masks.append(top.repeat(param.numel() // rms.numel()).to(param.device))
    return masks


def combine(masks: Sequence[torch.Tensor | None] | None,
            scales: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None] | None:
    """One per-coordinate weight per tensor: a selection mask times the noise shape (either may be None)."""
    masks = masks if masks is not None else [None] * len(scales)
    out = [s if m is None else m.float() if s is None else m * s for m, s in zip(masks, scales, strict=True)]
    return None if all(w is None for w in out) else out
