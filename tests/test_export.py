"""`zofed export`: a run's tuned model loads with plain transformers (or peft) and computes what the run's did."""

import pytest
import torch
from test_finetune import _config
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from typer.testing import CliRunner

from zofed.cli import app
from zofed.models.selection import LABEL_HEAD
from zofed.models.tiny import tiny_encoder
from zofed.run.config import ConfigError
from zofed.run.export import export_run
from zofed.run.finetune import finetune
from zofed.run.setup import load_run


def _trained(ws, out, *extra):
    finetune(_config(ws, out, *extra, steps=4), show_progress=False)
    setup = load_run(out)
    batch = setup.task.collate(setup.test, list(range(8)))
    return setup, batch


@torch.no_grad()
def _logits(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def test_a_full_model_export_loads_with_plain_transformers_and_gives_the_runs_logits(tiny_workspace, tmp_path):
    setup, batch = _trained(tiny_workspace, tmp_path / "run", "trainable.mode=patterns",
                            "trainable.patterns=['norm\\.weight$']")
    base = AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
    exported = export_run(tmp_path / "run", tmp_path / "hf")
    assert exported.kind == "full model" and "model.safetensors" in exported.files
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.allclose(_logits(plain, batch), _logits(setup.model, batch), atol=1e-5)
    assert not torch.allclose(_logits(base, batch), _logits(plain, batch), atol=1e-4)  # the tuned gains travelled
    assert not (tmp_path / "hf.partial").exists()
    with pytest.raises(ConfigError, match="already exists"):
        export_run(tmp_path / "run", tmp_path / "hf")
    with pytest.raises(ConfigError, match="--merge folds a LoRA adapter"):
        export_run(tmp_path / "run", tmp_path / "merged", merge=True)


def test_a_trained_label_head_is_written_into_an_untied_output_embedding(tiny_workspace, tmp_path):
    setup, batch = _trained(tiny_workspace, tmp_path / "run", "trainable.mode=none", "trainable.label_head=true")
    rows = getattr(setup.model, LABEL_HEAD)
    assert not torch.equal(rows, setup.model.get_output_embeddings().weight[setup.task.label_token_ids])
    export_run(tmp_path / "run", tmp_path / "hf")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not plain.config.tie_word_embeddings
    last = batch.attention_mask.sum(1) - 1
    words = _logits(plain, batch)[torch.arange(len(last)), last][:, setup.task.label_token_ids]
    assert torch.allclose(words, setup.task.logits(setup.model, batch), atol=1e-5)
    embedding = AutoModelForCausalLM.from_pretrained(tiny_workspace / "model").get_input_embeddings().weight
    assert torch.equal(plain.get_input_embeddings().weight, embedding)  # the input side kept its rows


def test_a_lora_run_exports_an_adapter_peft_loads_and_a_merged_model(tiny_workspace, tmp_path):
    from peft import PeftModel

    setup, batch = _trained(tiny_workspace, tmp_path / "run", "trainable.mode=lora")
    exported = export_run(tmp_path / "run", tmp_path / "adapter")
    assert exported.kind == "peft adapter" and "adapter_config.json" in exported.files
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_workspace / "model"),
                                        tmp_path / "adapter")
    expected = _logits(setup.model, batch)
    assert torch.allclose(_logits(adapted, batch), expected, atol=1e-5)
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--merge"])
    assert result.exit_code == 0, result.output
    assert "full model (LoRA merged) written" in " ".join(result.output.split())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logits(merged, batch), expected, atol=1e-5)
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(tiny_workspace / "model"), batch),
                              expected, atol=1e-4)  # the adapter is not the identity


def test_an_encoder_classifier_exports_with_its_tuned_head(tiny_workspace, tmp_path):
    encoder = tiny_encoder(num_labels=2, seed=3)
    encoder.model.save_pretrained(tmp_path / "encoder")
    encoder.tokenizer.save_pretrained(tmp_path / "encoder")
    setup, batch = _trained(tiny_workspace, tmp_path / "run", f"model.name={tmp_path / 'encoder'}",
                            "task.type=encoder-classification", "task.template='{text}'", "trainable.mode=patterns",
                            "trainable.patterns=['classifier']")
    export_run(tmp_path / "run", tmp_path / "hf")
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert torch.allclose(_logits(plain, batch), _logits(setup.model, batch), atol=1e-5)
    missing = CliRunner().invoke(app, ["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "not a zofed run directory" in " ".join(missing.output.split())


def test_an_export_fills_an_empty_out_but_never_one_that_filled_up_while_it_ran(tiny_workspace, tmp_path, monkeypatch):
    from zofed.run import export

    _trained(tiny_workspace, tmp_path / "run", "trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "model.safetensors" in export_run(tmp_path / "run", empty).files
    out, load_run = tmp_path / "hf", export.load_run
    out.mkdir()

    def load_then_someone_writes(run_dir):  # `out` was empty when export looked, then a file appeared
        setup = load_run(run_dir)
        (out / "notes.txt").write_text("mine")
        return setup

    monkeypatch.setattr(export, "load_run", load_then_someone_writes)
    with pytest.raises(ConfigError, match="hf is no longer empty; nothing was written over it"):
        export_run(tmp_path / "run", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and not (tmp_path / "hf.partial").exists()
