"""One caching setting, zo.cache (auto | none | prefix | features): the keys it replaced are refused with a message
naming it, in a user's config and in a run directory's stored config alike; auto caches the frozen prefix wherever
the model and the trainable set allow it."""

import pytest
import yaml
from toy_federation import tiny_federated_config

from zofed.run.config import ConfigError, FinetuneConfig, load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.setup import build, load_run

RETIRED = {
    "zo.prefix_cache=true": "zo.prefix_cache was replaced by zo.cache: prefix",
    "federation.feature_cache=12": "federation.feature_cache=12 was replaced by zo.cache: features with "
                                   "federation.cached_examples=12",
    "train.remember_features=true": "train.remember_features and train.features_dir are gone: .* set "
                                    "ZOFED_FEATURE_STORE=DIR",
    "train.features_dir=/tmp/features": "train.remember_features and train.features_dir are gone",
}


@pytest.mark.parametrize("override", sorted(RETIRED))
def test_a_retired_key_is_refused_naming_what_replaced_it(override):
    with pytest.raises(ConfigError, match=RETIRED[override]):
        load_config(None, [override], schema=FederatedConfig)
    if not override.startswith("federation."):  # centralized runs refuse them too
        with pytest.raises(ConfigError, match=RETIRED[override]):
            load_config(None, [override], schema=FinetuneConfig)


def test_cached_examples_default_to_one_batch_and_only_go_with_cached_features():
    plain = load_config(None, ["federation.recipe=none"], schema=FederatedConfig)
    assert (plain.zo.cache, plain.federation.cached_examples, plain.feature_cache()) == ("auto", None, 0)
    # auto caches a round's prefixes wherever the setup splits the model: the bottom runs once a round, not a step
    assert plain.feature_cache(prefix_split=True) == plain.train.batch_size == 16
    per_step = load_config(None, ["federation.recipe=none", "federation.cached_examples=0"], schema=FederatedConfig)
    assert per_step.feature_cache(prefix_split=True) == 0  # 0: every step captures its own batch
    first_order = load_config(None, ["federation.method=fedavg"], schema=FederatedConfig)
    assert first_order.feature_cache(prefix_split=True) == 0  # back-propagation runs every batch through the top
    one_batch = load_config(None, ["trainable.mode=none", "trainable.label_head=true", "zo.cache=features",
                                   "train.batch_size=6"], schema=FederatedConfig)
    assert one_batch.feature_cache() == 6
    recipe = load_config(None, ["federation.recipe=head"], schema=FederatedConfig)
    assert (recipe.zo.cache, recipe.federation.cached_examples, recipe.feature_cache()) == ("features", 8, 8)
    weights = load_config(None, [], schema=FederatedConfig)  # the default: the round's prefixes below the top block
    assert (weights.zo.cache, weights.federation.cached_examples, weights.feature_cache()) == ("prefix", 8, 8)
    assert load_config(None, ["zo.cache=prefix", "trainable.mode=none", "trainable.label_head=true"],
                       schema=FederatedConfig).feature_cache() == 16
    round_prefixes = load_config(None, ["zo.cache=prefix", "federation.cached_examples=4"], schema=FederatedConfig)
    assert round_prefixes.feature_cache() == 4  # the round's prefixes, for blocks above a frozen bottom
    with pytest.raises(ConfigError, match="federation.cached_examples=4 .* this run has zo.cache: none"):
        load_config(None, ["zo.cache=none", "federation.cached_examples=4"], schema=FederatedConfig)
    with pytest.raises(ConfigError, match="fedavg back-propagates"):
        load_config(None, ["zo.cache=prefix", "federation.cached_examples=4", "federation.method=fedavg"],
                    schema=FederatedConfig)
    with pytest.raises(ConfigError, match="cached_examples=0 .* is for zo.cache: prefix"):
        load_config(None, ["federation.recipe=head", "federation.cached_examples=0"], schema=FederatedConfig)
    with pytest.raises(ConfigError, match="zo.cache"):
        load_config(None, ["zo.cache=everything"], schema=FederatedConfig)


def test_a_run_directory_stored_with_a_retired_key_is_refused_on_resume_and_load(tiny_workspace, tmp_path):
    """No silent migration: a stored config that names a retired key says what replaced it."""
    out = tmp_path / "run"
    config = tiny_federated_config(tiny_workspace, out, "trainable.mode=none", "trainable.label_head=true",
                                   "zo.cache=prefix", "federation.rounds=1")
    run_federated(config, show_progress=False)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["zo"]["cache"] == "prefix"
    load_run(out)  # the stored config loads back as it is
    del stored["zo"]["cache"]
    stored["zo"]["prefix_cache"] = True  # what an earlier zofed wrote
    (out / "config.yaml").write_text(yaml.safe_dump(stored))
    with pytest.raises(ConfigError, match="zo.prefix_cache was replaced by zo.cache: prefix"):
        load_run(out)
    with pytest.raises(ConfigError, match="zo.prefix_cache was replaced by zo.cache: prefix"):
        run_federated(config.model_copy(update={"federation": config.federation.model_copy(
            update={"rounds": 2})}), resume=True, show_progress=False)


def test_auto_caches_the_prefix_where_the_trainable_set_lies_above_the_lowest_block(tiny_workspace, tmp_path):
    def cached(*overrides: str) -> float | None:
        setup = build(tiny_federated_config(tiny_workspace, tmp_path / "x", *overrides))
        return None if setup.cache is None else setup.pass_fraction

    layers = "trainable.lora_layers=[-1]"
    top = cached(layers)
    assert top is not None and 0 < top < 1  # LoRA in the top block: the bottom runs once a batch
    assert cached(layers, "zo.cache=prefix") == top
    assert cached(layers, "zo.cache=none") is None
    assert cached() is None  # LoRA in every block: nothing below to cache, so auto caches nothing
    assert cached("trainable.mode=none", "trainable.label_head=true") == 0.0  # every block frozen
    # where a prefix cannot be cached (the embeddings train) auto falls back to none; prefix asked for says why
    assert cached("trainable.mode=all") is None
    with pytest.raises(ConfigError, match="zo.cache: prefix needs a decoder-only model .* none in the embeddings"):
        cached("trainable.mode=all", "zo.cache=prefix")


def test_a_run_with_auto_counts_the_cached_passes_and_learns_what_the_uncached_run_learns(tiny_workspace, tmp_path):
    def run(name: str, *overrides: str) -> dict:
        return run_federated(tiny_federated_config(tiny_workspace, tmp_path / name, "trainable.lora_layers=[-1]",
                                                   *overrides), show_progress=False)

    runs = {"per_step": run("per_step", "zo.cache=auto", "federation.cached_examples=0"),
            "none": run("none", "zo.cache=none"), "round": run("round", "zo.cache=auto")}
    # the bottom captured each step: fewer passes counted, the same losses as the uncached run
    assert runs["per_step"]["forward_passes"] < runs["none"]["forward_passes"]
    assert runs["per_step"]["test"]["loss"] == pytest.approx(runs["none"]["test"]["loss"], rel=1e-4)
    # auto's default, the round's prefixes: the bottom captured once a round, fewer passes still
    assert runs["round"]["forward_passes"] < runs["per_step"]["forward_passes"]
