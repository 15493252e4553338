"""model.device and model.dtype: half-precision storage of the frozen weights with fp32 trainable tensors and
fp32 arithmetic, and device names that fail loudly."""

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context

from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan
from zofed.fl.server import rebuild_client_update
from zofed.models.placement import place_model, resolve_device
from zofed.zo.optim import MeZO
from zofed.zo.perturb import Perturbation
from zofed.zo.step import zo_step


def _narrowed_context(mode: str = "all", dtype: torch.dtype = torch.bfloat16, **options):
    ctx = toy_context(mode=mode, **options)
    place_model(ctx.model, ctx.trainable.params, torch.device("cpu"), dtype)
    return ctx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frozen_weights_are_stored_narrow_and_trainable_ones_stay_fp32(dtype):
    ctx = toy_context(mode="lora")
    frozen = {id(m.weight): m.weight.numel() for m in ctx.model.modules()  # a tied weight once
              if type(m) in (torch.nn.Linear, torch.nn.Embedding)
              and all(m.weight is not q for q in ctx.trainable.params)}
    count = place_model(ctx.model, ctx.trainable.params, torch.device("cpu"), dtype)
    assert count == sum(frozen.values()) > 0
    assert all(p.dtype == torch.float32 for p in ctx.trainable.params)
    linear = [m for m in ctx.model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == dtype]
    assert linear, "no frozen linear layer was narrowed"


def test_a_narrow_model_lets_go_of_the_fp32_file_its_weights_were_mapped_from():
    """Weights loaded from a safetensors cache are views of one mapped fp32 file; an fp32 tensor left in it (a
    norm, a bias, a trainable tensor) would keep every page the narrowing read resident."""
    ctx = toy_context(mode="lora")
    tensors = [*ctx.model.parameters(), *ctx.model.buffers()]
    mapped = torch.zeros(sum(t.numel() for t in tensors))  # stands for the mapped file
    offset = 0
    for t in tensors:
        view = mapped[offset:offset + t.numel()].view_as(t)
        view.copy_(t.data)
        t.data = view
        offset += t.numel()
    place_model(ctx.model, ctx.trainable.params, torch.device("cpu"), torch.bfloat16)
    file = mapped.untyped_storage().data_ptr()
    left = [t for t in [*ctx.model.parameters(), *ctx.model.buffers()] if t.untyped_storage().data_ptr() == file]
    assert not left, f"{len(left)} tensors still live in the fp32 file"
    assert any(t.dtype == torch.float32 for t in ctx.model.parameters())  # the copies kept their values' dtype


def test_a_narrow_model_computes_in_fp32_close_to_the_full_one():
    full, narrow = toy_context(mode="lora"), _narrowed_context("lora")
    batch = full.task.collate(full.train, np.arange(16))
    with torch.no_grad():
        logits_full = full.task.logits(full.model, batch)
        logits_narrow = narrow.task.logits(narrow.model, batch)
    assert logits_narrow.dtype == torch.float32
    assert not torch.equal(logits_full, logits_narrow)  # the frozen weights were rounded ...
    assert torch.allclose(logits_full, logits_narrow, rtol=0.05, atol=0.05)  # ... by bf16's 3 digits


def test_a_perturbation_far_below_bf16_spacing_still_moves_the_loss_of_a_narrow_model():
    """eps = 1e-4 on the gains is 30 times below bf16's spacing near 1; computed in fp32 it is not lost, so the
    projected gradients of the narrow model follow the full model's (cosine over 16 seeds)."""
    grads = {}
    gains = [r"norm\.weight$"]
    for name, ctx in (("full", toy_context(patterns=gains)), ("narrow", _narrowed_context(patterns=gains))):
        tensors = ctx.trainable.tensors()
        clean = [t.clone() for t in tensors]
        batch = ctx.task.collate(ctx.train, np.arange(16))
        out = []
        for seed in range(16):
            _, record = zo_step(tensors, lambda b=batch, c=ctx: c.task.loss(c.model, b), MeZO(),
                                MeZO().init(tensors), seed=seed, eps=1e-4, lr=0.0, perturbation=Perturbation(),
                                clean=[t.clone() for t in tensors])
            out.append(record.grads[0])
            for t, c in zip(tensors, clean, strict=True):
                assert torch.equal(t, c)  # lr 0: the step restored the weights exactly
        grads[name] = np.asarray(out)
    assert np.all(grads["narrow"] != 0.0)
    cosine = grads["full"] @ grads["narrow"] / (np.linalg.norm(grads["full"]) * np.linalg.norm(grads["narrow"]))
    assert cosine > 0.95, cosine


def test_an_fp32_server_rebuilds_a_narrow_clients_update_bit_for_bit():
    ctx = _narrowed_context("lora")
    start = [t.clone() for t in ctx.trainable.tensors()]
    local = FederationPlan("zo-seeds", 4, 2, 3, lr=1e-2, eps=1e-2, batch_size=8).round(0)
    update, final = get_method("zo-seeds").train(ctx, start, 1, toy_clients(4)[1], local, np.zeros(0, np.float32))
    client_delta = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    server_start = [t.clone() for t in toy_context(mode="lora").trainable.tensors()]  # an fp32 model's copy
    assert all(torch.equal(a, b) for a, b in zip(server_start, start, strict=True))
    rebuilt = rebuild_client_update(get_method("zo-seeds"), server_start, update, local)
    assert client_delta.norm() > 0
    assert torch.equal(torch.cat([r.reshape(-1) for r in rebuilt]), client_delta)


def test_device_names_resolve_or_fail_naming_the_problem():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ValueError, match="'tpu' is not a device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda:0")
