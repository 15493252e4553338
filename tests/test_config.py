"""Config loading: `--set` values that YAML would misread, and the centralized-only keys a federated config refuses."""

import pytest

from zofed.run.config import ConfigError, FinetuneConfig, load_config, parse_overrides
from zofed.run.federated_config import CENTRALIZED_ONLY, FederatedConfig
from zofed.run.stored_config import check_resumed_config, dump_config, pinned


def test_an_override_yaml_cannot_parse_is_its_plain_text():
    cfg = load_config(None, ["task.template=Question: {text} Answer:"])  # a yaml ParserError before
    assert cfg.task.template == "Question: {text} Answer:"
    assert parse_overrides(["train.steps=[1"])[0] == ("train.steps", "[1")  # the schema then refuses the text
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=[1"])


@pytest.mark.parametrize("schema", [FinetuneConfig, FederatedConfig])
def test_a_text_field_keeps_the_text_yaml_would_read_as_a_mapping_a_comment_or_a_bool(schema):
    cfg = load_config(None, ["task.template=Review: {text}\nSentiment:", "model.name=yes",
                             "out_dir=runs/a #1"], schema=schema)
    assert cfg.task.template == "Review: {text}\nSentiment:"  # YAML: {'Review': {'text': None}, 'Sentiment': None}
    assert (cfg.model.name, cfg.out_dir) == ("yes", "runs/a #1")


def test_quoted_text_nulls_and_non_text_values_still_parse_as_yaml():
    cfg = load_config(None, ["task.template='review : {text} .'", 'data.format="jsonl"', "data.test_source=null",
                             "task.verbalizer=[' no', ' yes']", "optimizer.lr=1e-3", "train.steps=7"])
    assert (cfg.task.template, cfg.data.format, cfg.data.test_source) == ("review : {text} .", "jsonl", None)
    assert (cfg.task.verbalizer, cfg.optimizer.lr, cfg.train.steps) == ([" no", " yes"], 1e-3, 7)
    # YAML's double quotes take escapes: another way to put a newline into a template
    assert load_config(None, ['task.template="Q: {text}\\nA:"']).task.template == "Q: {text}\nA:"


def test_a_template_with_a_newline_from_a_yaml_block_scalar(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  template: |-\n    Review: {text}\n    Sentiment:\n")
    assert load_config(path).task.template == "Review: {text}\nSentiment:"


@pytest.mark.parametrize(("override", "instead"), [
    ("optimizer.schedule=cosine", "constant optimizer.lr"), ("optimizer.warmup=5", "constant optimizer.lr"),
    ("train.steps=50", "federation.rounds"), ("train.eval_every=2", "federation.eval_every"),
    ("train.checkpoint_every=1", "checkpoints after every round")])
def test_a_federated_config_refuses_the_centralized_only_keys_it_would_ignore(override, instead):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key} is a centralized setting.*{instead}"):
        load_config(None, [override], schema=FederatedConfig)
    assert load_config(None, [override])  # a centralized run uses it
    assert set(CENTRALIZED_ONLY) == {"optimizer.schedule", "optimizer.warmup", "train.steps", "train.eval_every",
                                     "train.checkpoint_every"}


def test_a_dumped_federated_config_loads_again_and_resumes(tmp_path):
    cfg = load_config(None, ["federation.recipe=none", "federation.rounds=3", "train.batch_size=4",
                             f"out_dir={tmp_path}"], schema=FederatedConfig)
    dump_config(cfg, tmp_path / "config.yaml")  # it holds train.steps etc. at their defaults
    stored = load_config(tmp_path / "config.yaml", schema=FederatedConfig)
    assert stored == pinned(cfg) != cfg  # the method's server defaults are written out
    assert stored.federation.server_optimizer.granularity == "global"
    check_resumed_config(cfg, tmp_path / "config.yaml")
    # a default value set explicitly is no different from a dumped one
    assert load_config(None, ["train.steps=200"], schema=FederatedConfig).train.steps == 200


def test_an_unset_estimator_is_the_methods_own_and_is_stored_as_such(tmp_path):
    from zofed.run.federated_config import federation_plan

    def plan(*overrides):
        cfg = load_config(None, list(overrides), schema=FederatedConfig)
        return cfg, federation_plan(cfg, num_clients=10)

    # zofed: one-sided queries around a shared centre once a step has several queries; one query stays central
    assert plan("zo.queries=4")[1].estimator == "forward"
    assert plan("zo.queries=1")[1].estimator == "central"
    # the baselines run their published central difference; a set estimator wins over any method's default
    assert plan("zo.queries=4", "federation.method=decomfl")[1].estimator == "central"
    assert plan("zo.queries=4", "zo.estimator=central")[1].estimator == "central"
    assert load_config(None, ["zo.queries=4"]).zo.resolved_estimator(None) == "central"  # centralized runs
    # the stored config names the estimator that ran, so a resume after a default changes names the change
    cfg, _ = plan("zo.queries=4", f"out_dir={tmp_path}")
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", schema=FederatedConfig).zo.estimator == "forward"
    check_resumed_config(cfg, tmp_path / "config.yaml")
    central = load_config(None, ["zo.queries=4", "zo.estimator=central", f"out_dir={tmp_path}"], schema=FederatedConfig)
    with pytest.raises(ConfigError, match=r"zo.estimator \('forward' -> 'central'\)"):
        check_resumed_config(central, tmp_path / "config.yaml")


def test_a_validation_split_is_carved_from_training_data_and_can_stand_in_for_the_test(tiny_workspace, tmp_path):
    """data.validation_examples holds out a seeded split of the training data; evaluate_on: validation makes every
    evaluation read it, so a setting is tuned without the test split."""
    from zofed.run.config import ConfigError, FinetuneConfig
    from zofed.run.setup import load_splits

    base = [f"model.name={tiny_workspace / 'model'}", f"data.source={tiny_workspace / 'train.jsonl'}",
            f"data.test_source={tiny_workspace / 'test.jsonl'}"]
    plain_train, plain_test = load_splits(load_config(None, base, schema=FinetuneConfig))
    train, test = load_splits(load_config(None, [*base, "data.validation_examples=40"], schema=FinetuneConfig))
    assert len(train) == len(plain_train) - 40 and len(test) == len(plain_test)
    train2, validation = load_splits(load_config(None, [*base, "data.validation_examples=40",
                                                        "data.evaluate_on=validation"], schema=FinetuneConfig))
    from collections import Counter

    def texts(data):
        return Counter(f["text"] for f in data.fields)

    assert len(validation) == 40 and texts(validation) + texts(train2) == texts(plain_train)  # a partition of train
    assert [f["text"] for f in train2.fields] == [f["text"] for f in train.fields]  # the same carve both times
    with pytest.raises(ConfigError, match="needs data.validation_examples"):
        load_config(None, [*base, "data.evaluate_on=validation"], schema=FinetuneConfig)


def test_device_dtype_and_gpu_share_are_checked_where_they_are_read(tmp_path):
    config = load_config(None, ["model.dtype=bfloat16", "flower.client_gpus=0.25"], schema=FederatedConfig)
    assert (config.model.device, config.model.dtype, config.flower.client_gpus) == ("auto", "bfloat16", 0.25)
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=int8"], schema=FinetuneConfig)
    with pytest.raises(ConfigError, match="flower.client_gpus"):
        load_config(None, ["flower.client_gpus=-1"], schema=FederatedConfig)
