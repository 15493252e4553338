"""Where a model runs (`model.device`) and how its frozen weights are stored (`model.dtype`).

Half-precision storage applies to the frozen weight matrices of linear and embedding layers, which hold nearly
all of a language model's bytes. They are widened back to fp32 one layer at a time as the forward pass reaches
them, so every activation, the trainable tensors, the plus/minus perturbation and the finite difference stay in
fp32: a perturbation of eps = 1e-3 on a gain near 0.26 would vanish in bf16, whose spacing there is about 0.002.
The frozen weights themselves are rounded once, at load, so a half-precision client computes the loss of a
slightly different model, never a noisier difference. Its update is still made of seeds and scalars, which a
server on any device and in any precision rebuilds exactly.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F

DEVICES = "auto, cpu, cuda, cuda:N or mps"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` is the first of cuda and mps that this torch build can use, else the CPU; a named accelerator that
    is not there is an error, never a silent fall back to the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"model.device {name!r} is not a device; choose {DEVICES}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device {name!r}: this torch build sees no CUDA GPU (torch {torch.__version__}); "
                             "use model.device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"model.device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"model.device {name!r}: MPS is not available on this machine; use cpu or auto")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"model.device {name!r} is not supported; choose {DEVICES}")
    return device


def _widened_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return F.linear(x, self.weight.to(x.dtype), bias)


def _widened_embedding(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                       self.sparse).float()


def place_model(model: torch.nn.Module, trainable: Sequence[torch.nn.Parameter], device: torch.device,
                dtype: torch.dtype) -> int:
    """Move `model` to `device` and store its frozen linear and embedding weights in `dtype` (widened to fp32 as
    they are used); the `trainable` parameters stay fp32. Returns how many weight values are stored narrower."""
    model.to(device)
    if dtype == torch.float32:
        return 0
    keep = {id(p) for p in trainable}
    narrowed: set[int] = set()
    count = 0
    for module in model.modules():
        widen = {torch.nn.Linear: _widened_linear, torch.nn.Embedding: _widened_embedding}.get(type(module))
        weight = getattr(module, "weight", None)
        if widen is None or not isinstance(weight, torch.nn.Parameter) or id(weight) in keep:
            continue
        if id(weight) not in narrowed:  # a tied weight is shared by two modules: narrow it once
            weight.data = weight.data.to(dtype)
            narrowed.add(id(weight))
            count += weight.numel()
        module.forward = types.MethodType(widen, module)
    # The weights may still be views of the fp32 file mapped from the cache: any fp32 tensor left there (norms,
    # biases, trainable tensors) keeps the whole mapping, and every page the narrowing read, resident. Copying
    # them out lets the mapping go, so the process holds the narrow weights only.
    for tensor in [*model.parameters(), *model.buffers()] if count else ():
        if tensor.dtype != dtype:
            tensor.data = tensor.data.clone()
    return count
