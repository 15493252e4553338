"""zofed's recommended settings (run/recipes.py): what `zofed run` gets without a config, what a config keeps, and
that a run with no trainable set given really trains the label head and the top block's norm gains on a round's
cached prefixes (the weights recipe), and the head recipe the label head alone on cached features."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.config import ConfigError, load_config
from zofed.run.federated_config import FederatedConfig
from zofed.run.recipes import HEAD, WEIGHTS


def _load(*overrides: str) -> FederatedConfig:
    return load_config(None, list(overrides), schema=FederatedConfig)


def test_no_config_gets_the_weights_recipe_and_a_stored_config_loads_back_the_same():
    cfg = _load()
    assert cfg.federation.recipe == "weights"
    assert (cfg.trainable.mode, cfg.trainable.label_head, cfg.trainable.top_norms) == ("none", True, 1)
    assert (cfg.zo.queries, cfg.zo.cache, cfg.optimizer.lr, cfg.train.batch_size) == (8, "prefix", 1e-3, 8)
    fed = cfg.federation
    assert (fed.rounds, fed.local_steps, fed.scalar_bits, fed.cached_examples, fed.logit_adjust, fed.average_from) == \
        (WEIGHTS["federation"]["rounds"], 48, 16, 8, 1.0, 0.5)
    assert (fed.server_optimizer.name, fed.server_optimizer.lr) == ("sgd", 1.0)
    assert FederatedConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump()))) == cfg
    head = _load("federation.recipe=head")  # the linear probe, by name
    assert (head.trainable.top_norms, head.zo.cache, head.federation.rounds) == (0, "features", HEAD["federation"][
        "rounds"])


def test_the_config_wins_key_by_key_and_whole_sections_stay_the_users():
    cfg = _load("zo.queries=4", "federation.rounds=7")
    assert (cfg.federation.recipe, cfg.zo.queries, cfg.federation.rounds, cfg.feature_cache()) == \
        ("weights", 4, 7, 8)
    split = _load("trainable.label_head_per_class=true")  # a setting of the recipe's own head keeps the recipe
    assert (split.federation.recipe, split.trainable.mode, split.trainable.label_head_per_class) == \
        ("weights", "none", True)
    # an adaptive server with no lr takes the method's default lr, not plain averaging's 1.0
    adam = _load("federation.server_optimizer.name=adam").federation.server_optimizer
    assert (adam.name, adam.lr) == ("adam", None)


@pytest.mark.parametrize("override", ["trainable.mode=lora", "trainable.label_head=true", "trainable.top_norms=2",
                                      "federation.method=fedkseed",
                                      "optimizer.name=zo-adam", "model.name=minilm-l6", "task.type=causal-lm",
                                      "federation.recipe=none"])
def test_a_config_that_chose_otherwise_keeps_the_schema_defaults(override):
    cfg = _load(override)
    assert cfg.federation.recipe == "none"
    assert (cfg.zo.queries, cfg.zo.cache, cfg.feature_cache(), cfg.federation.average_from) == (1, "auto", 0, None)


def test_a_local_decoder_gets_the_recipe_of_the_built_in_whatever_its_name(tiny_workspace, tmp_path):
    """What the model is decides, not its name: a save_pretrained decoder directory and a GGUF file get the recipe
    the built-in decoder gets; an encoder directory, or a hub id nothing is known of before loading, does not."""
    assert _load(f"model.name={tiny_workspace / 'model'}").federation.recipe == "weights"
    gguf = tmp_path / "model.q4.bin"
    gguf.write_bytes(b"GGUF" + bytes(12))
    assert _load(f"model.name={gguf}").federation.recipe == "weights"
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    assert _load(f"model.name={encoder}").federation.recipe == "none"
    assert _load(f"model.name={encoder}", "model.kind=causal-lm").federation.recipe == "weights"
    assert _load("model.name=someone/some-model").federation.recipe == "none"
    forced = _load("federation.recipe=head", "trainable.mode=patterns", "trainable.patterns=['norm']",
                   "trainable.label_head=false")
    assert (forced.federation.recipe, forced.trainable.mode, forced.zo.queries) == ("head", "patterns", 8)
    with pytest.raises(ConfigError, match="federation.recipe"):
        _load("federation.recipe=fast")


def _run_tiny(tiny_workspace, out, *extra: str):
    return CliRunner().invoke(app, [
        "run", "--model", str(tiny_workspace / "model"), "--data", str(tiny_workspace / "train.jsonl"),
        "--set", f"data.test_source={tiny_workspace / 'test.jsonl'}", "--set", "model.kind=causal-lm",
        "--set", "task.template=review : {text} . sentiment :", "--set", "task.verbalizer=[negative, positive]",
        "--set", "data.eval_examples=20", "--set", "federation.partition.num_clients=4",
        "--set", "federation.clients_per_round=2", "--rounds", "2", "--out", str(out), *extra])


def test_run_without_a_trainable_set_trains_the_head_and_the_top_blocks_norms_on_cached_prefixes(tiny_workspace,
                                                                                                  tmp_path):
    out = tmp_path / "run"
    result = _run_tiny(tiny_workspace, out)
    assert result.exit_code == 0, result.output
    assert "recipe=weights" in result.output
    results = json.loads((out / "results.json").read_text())
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["federation"]["recipe"] == "weights" and stored["trainable"]["top_norms"] == 1
    from safetensors.torch import load_file

    final = load_file(str(out / "final" / "trainable.safetensors"))
    assert sorted(final) == ["label_head", "model.layers.1.input_layernorm.weight",
                             "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"]
    # a round's 8 cached prefixes (batch 8) below the top block, 1 - f of a pass, then 48 steps of 9 passes, the
    # first over the top block (f = 1/2, the top of the tiny Llama's two), the others over it only where the step
    # drew one of its norms (else over the head, a small share): between these two
    charged = results["forward_passes_per_client_round"]
    assert 0.5 + 48 * 0.5 < charged < 0.5 + 48 * 9 * 0.5
    assert 384 * 2 <= results["bytes_up_per_client_round"] < 1024


def test_the_head_recipe_trains_the_label_head_on_cached_features(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    result = _run_tiny(tiny_workspace, out, "--set", "federation.recipe=head")
    assert result.exit_code == 0, result.output
    assert "recipe=head" in result.output
    results = json.loads((out / "results.json").read_text())
    # one pass of 8 cached examples a client round (batch 8), then 48 steps of 8 one-sided queries (9 passes) on
    # the features, each pass at the head's share (the tiny Llama's final norm and 2 label rows: 96 of 18,624)
    per_client = 1.0 + 48 * 9 * (32 * 3 / (2 * 9280 + 32 * 2))
    assert results["forward_passes_per_client_round"] == pytest.approx(per_client)
    assert results["forward_passes"] == pytest.approx(2 * 2 * per_client)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["federation"]["recipe"] == "head" and stored["trainable"]["label_head"] is True
    assert 384 * 2 <= results["bytes_up_per_client_round"] < 1024  # 384 float16 scalars and their seeds
