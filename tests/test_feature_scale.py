"""zo.precondition=features: noise scaled by 1 / RMS of the feature each coordinate multiplies; zo.precondition=
channels: noise only on the coordinates reading each tensor's largest features."""

import pytest
import torch
from toy_federation import tiny_federated_config

from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm
from zofed.run.federated import run_federated
from zofed.run.replay import replay_run
from zofed.zo.feature_scale import CLIP, combine, feature_noise_scales, feature_rms, top_channel_masks
from zofed.zo.noise import NoiseSource
from zofed.zo.perturb import Perturbation

MASSIVE = 5  # the hidden channel made massive


def _model_with_a_massive_channel(patterns):
    """A tiny Llama whose embeddings carry channel MASSIVE at 30 times the others' size, as LMs' massive
    activations do; LoRA or gains trainable."""
    model = tiny_causal_lm(num_layers=2).model
    with torch.no_grad():
        model.get_input_embeddings().weight[:, MASSIVE] *= 30
    mode = {"mode": "lora", "lora_r": 2} if patterns is None else {"mode": "patterns", "patterns": patterns}
    return select_trainable(model, TrainableConfig(**mode))


def test_a_massive_feature_channel_gets_small_noise_and_every_tensor_keeps_unit_energy():
    model, trainable = _model_with_a_massive_channel([r"layers\.0\.input_layernorm\.weight$",
                                                      r"layers\.1\.mlp\.up_proj\.weight$"])
    scales = feature_noise_scales(model, trainable.names, trainable.params)
    gain, up = scales
    assert gain.shape == (32,) and abs(float(gain.pow(2).mean()) - 1) < 1e-5
    others = torch.cat([gain[:MASSIVE], gain[MASSIVE + 1:]])
    assert float(gain[MASSIVE]) < 0.1 * float(others.median())  # the steep channel barely moves
    assert float(gain.max() / gain.min()) <= CLIP[1] / CLIP[0] + 1e-4
    # up_proj (out x 32) multiplies its block's normed hidden state: one scale per input column, in every row
    rows = up.view(-1, 32)
    assert torch.equal(rows, rows[0].expand_as(rows)) and abs(float(up.pow(2).mean()) - 1) < 1e-5
    again = feature_noise_scales(model, trainable.names, trainable.params)
    assert all(torch.equal(a, b) for a, b in zip(scales, again, strict=True))  # no data, no randomness left


def test_lora_factors_are_shaped_by_their_inputs_and_a_selection_mask_is_kept():
    model, trainable = _model_with_a_massive_channel(None)
    scales = feature_noise_scales(model, trainable.names, trainable.params)
    by_name = dict(zip(trainable.names, scales, strict=True))
    a = next(v for n, v in by_name.items() if "lora_A" in n)
    assert a.view(2, 32)[:, MASSIVE].max() < 0.2 * a.view(2, 32).median()  # A reads the hidden state
    assert all(v is not None for v in scales)  # B is a linear layer too: shaped by A's outputs
    mask = [torch.arange(t.numel()) % 2 == 0 for t in trainable.params]
    weights = combine(mask, scales)
    assert all(int(w.count_nonzero()) == int(m.sum()) for w, m in zip(weights, mask, strict=True))
    assert torch.equal(weights[0], mask[0] * scales[0])
    assert combine(None, [None, None]) is None


def test_a_label_head_is_shaped_by_the_last_hidden_state_it_reads():
    model = tiny_causal_lm(num_layers=2).model
    with torch.no_grad():
        model.get_input_embeddings().weight[:, MASSIVE] *= 30
    # a head on three label words' rows
    model, trainable = select_trainable(model, TrainableConfig(mode="none", label_head=True), [0, 1, 2])
    (head,) = feature_noise_scales(model, trainable.names, trainable.params)
    assert head.shape == (3 * 32,) and abs(float(head.pow(2).mean()) - 1) < 1e-5
    columns = head.view(3, 32)
    assert torch.equal(columns, columns[0].expand_as(columns))  # one scale per hidden feature, in every class's row
    # the final norm keeps the massive channel massive, so the head's column reading it gets the smallest noise
    assert int(columns[0].argmin()) == MASSIVE and float(columns[0, MASSIVE]) < 0.2 * float(columns[0].median())


def test_shaped_noise_is_the_flat_noise_times_the_weights():
    source = NoiseSource("rademacher")
    weights = torch.linspace(0.1, 2.0, 10)
    flat = Perturbation().direction(source, 7, 0, 0, 10, 1.0).clone()
    shaped = Perturbation(masks=[weights]).direction(source, 7, 0, 0, 10, 1.0)
    assert torch.allclose(shaped, flat * weights)


def test_a_federated_run_with_shaped_noise_rebuilds_and_resumes_exactly(tiny_workspace, tmp_path):
    """The shape is measured again on the starting model when a run resumes: the resumed run ends where an
    uninterrupted one does, and it differs from a run with flat noise."""
    def run(out, rounds, *extra):
        return run_federated(tiny_federated_config(tiny_workspace, out, "federation.method=zofed",
                                                   f"federation.rounds={rounds}", *extra), resume=True,
                             show_progress=False)

    whole = run(tmp_path / "whole", 2, "zo.precondition=features")
    run(tmp_path / "split", 1, "zo.precondition=features")
    resumed = run(tmp_path / "split", 2, "zo.precondition=features")
    flat = run(tmp_path / "flat", 2)
    from safetensors.torch import load_file

    final = {name: load_file(str(tmp_path / name / "final" / "trainable.safetensors"))
             for name in ("whole", "split", "flat")}
    assert all(torch.equal(final["whole"][k], final["split"][k]) for k in final["whole"])
    assert any(not torch.equal(final["whole"][k], final["flat"][k]) for k in final["whole"])
    assert whole["test"] == resumed["test"] and whole["rejected_uplinks"] == flat["rejected_uplinks"] == 0


def test_channel_masks_keep_the_coordinates_reading_the_largest_features():
    model, trainable = _model_with_a_massive_channel([r"layers\.0\.input_layernorm\.weight$",
                                                      r"layers\.1\.mlp\.up_proj\.weight$"])
    gain, up = top_channel_masks(model, trainable.names, trainable.params, 3)
    rms = feature_rms(model, trainable.names)[trainable.names[0]]
    assert gain.dtype == torch.bool and int(gain.sum()) == 3 and bool(gain[MASSIVE])
    assert set(torch.nonzero(gain).flatten().tolist()) == set(torch.topk(rms, 3).indices.tolist())
    rows = up.view(-1, 32)  # the same input columns in every output row
    assert torch.equal(rows, rows[0].expand_as(rows)) and int(rows[0].sum()) == 3 and bool(rows[0, MASSIVE])
    assert top_channel_masks(model, trainable.names, trainable.params, 32) == [None, None]  # every channel: all moves


def test_a_federated_run_on_channel_masks_moves_only_those_coordinates(tiny_workspace, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    norms = ("trainable.mode=patterns", "trainable.patterns=['layers\\..*norm\\.weight$']", "zo.cache=none")
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "masked", *norms, "zo.precondition=channels",
                                        "zo.channels=2"), show_progress=False)
    final = load_file(str(tmp_path / "masked" / "final" / "trainable.safetensors"))
    start = dict(AutoModelForCausalLM.from_pretrained(tiny_workspace / "model").named_parameters())
    moved = {k: torch.nonzero(final[k] != start[k]).flatten().tolist() for k in final}
    assert len(moved) == 4 and any(moved.values()) and all(len(v) <= 2 for v in moved.values())
    assert replay_run(tmp_path / "masked").matches  # the replay measures the same channels again


def test_zofeds_server_steps_the_masked_set_by_its_lr(tiny_workspace, tmp_path):
    """zofed's server (adam, one mean square for the update, steps relative to each tensor's RMS) moves the values
    a channel mask lets move by lr of the gains' RMS in its first round, as it moves an unmasked set: the pinned
    values do not count in its mean square."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    norms = ("trainable.mode=patterns", "trainable.patterns=['layers\\..*norm\\.weight$']", "zo.cache=none",
             "federation.rounds=1", "federation.server_optimizer.tau=1e-12")
    for name, extra in (("masked", ("zo.precondition=channels", "zo.channels=2")), ("all", ())):
        run_federated(tiny_federated_config(tiny_workspace, tmp_path / name, *norms, *extra), show_progress=False)
        final = load_file(str(tmp_path / name / "final" / "trainable.safetensors"))
        start = dict(AutoModelForCausalLM.from_pretrained(tiny_workspace / "model").named_parameters())
        assert all(torch.equal(start[k], torch.ones_like(start[k])) for k in final)  # every gain's RMS is 1
        steps = torch.cat([(final[k] - start[k]).detach().flatten() for k in sorted(final)])
        movable = 2 * len(final) if name == "masked" else steps.numel()  # a tensor its sampling left out counts
        assert (int(steps.count_nonzero()) <= movable < steps.numel()) == (name == "masked")
        assert float(steps.square().sum() / movable) ** 0.5 == pytest.approx(1e-2, rel=1e-4)
