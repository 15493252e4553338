"""Mistakes in the task settings are user errors naming their config key, not ValueError tracebacks."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from zofed.cli import app
from zofed.data.sources import DataError, TextDataset
from zofed.data.tasks import TaskConfig, make_task
from zofed.models.tiny import tiny_tokenizer

DATA = TextDataset([{"text": "a good movie"}, {"text": "a bad movie"}], [1, 0], ["negative", "positive"], "reviews")


def _task(**config: object):
    return make_task(TaskConfig(**config), tiny_tokenizer(), 2)


def test_verbalizer_length_must_match_the_classes() -> None:
    with pytest.raises(DataError, match=r"task\.verbalizer has 3 words .* for the data's 2 classes"):
        _task(verbalizer=["negative", "neutral", "positive"])
    with pytest.raises(DataError, match=r"task\.verbalizer has 0 words"):
        _task()  # the default verbalizer is empty


def test_verbalizer_words_must_have_distinct_first_tokens() -> None:
    with pytest.raises(DataError, match=r"task\.verbalizer words \['good', 'good'\] share their first token"):
        _task(verbalizer=["good", "good"])


def test_template_field_the_data_lacks() -> None:
    task = _task(template="review : {txt} sentiment :", verbalizer=["negative", "positive"])
    with pytest.raises(DataError, match=r"task\.template uses \{txt\}, but the examples of reviews have the "
                                        r"fields \['text'\]"):
        task.encode(DATA)


def test_template_without_a_field_or_malformed() -> None:
    with pytest.raises(DataError, match=r"task\.template 'sentiment :' uses no example field.*\{text\}"):
        _task(template="sentiment :", verbalizer=["negative", "positive"])
    with pytest.raises(DataError, match=r"task\.template 'review : \{text sentiment :' is not a valid template"):
        _task(template="review : {text sentiment :", verbalizer=["negative", "positive"])
    with pytest.raises(DataError, match=r"task\.template 'review : \{\}' has a field without a name"):
        _task(template="review : {}", verbalizer=["negative", "positive"])


def test_causal_lm_template_field_the_data_lacks() -> None:
    task = make_task(TaskConfig(type="causal-lm", template="Q: {question}\nA:"), tiny_tokenizer(), None)
    data = TextDataset([{"instruction": "say hi", "response": "hi"}], None, None, "dolly")
    with pytest.raises(DataError, match=r"task\.template uses \{question\}.*\['context', 'instruction', 'response'\]"):
        task.encode(data)


def test_unlabelled_data_for_a_classification_task() -> None:
    with pytest.raises(DataError, match=r"task\.type prompt-classification needs labelled data"):
        make_task(TaskConfig(verbalizer=["negative", "positive"]), tiny_tokenizer(), None)
    task = _task(verbalizer=["negative", "positive"])
    with pytest.raises(DataError, match=r"unlabelled has no labels.*data\.label_column"):
        task.encode(TextDataset([{"text": "x"}], None, None, "unlabelled"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("task.verbalizer=[negative, neutral, positive]", "task.verbalizer"),
        ("task.template='review : {txt} . sentiment :'", "task.template"),
        ("trainable.lora_targets=[qproj]", "trainable.lora_targets"),
    ],
)
def test_cli_prints_one_error_line_and_exits_2(tiny_workspace, tmp_path, override: str, key: str) -> None:
    settings = [f"model.name={tiny_workspace / 'model'}", f"data.source={tiny_workspace / 'train.jsonl'}",
                f"data.test_source={tiny_workspace / 'test.jsonl'}", "task.template='review : {text} . sentiment :'",
                "task.verbalizer=[negative, positive]", "trainable.mode=lora", "train.steps=1",
                f"out_dir={tmp_path / 'run'}", override]
    result = CliRunner().invoke(app, ["finetune", *(arg for s in settings for arg in ("--set", s))])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # typer.Exit(2), not an escaped exception
    assert "Traceback" not in result.output
    # stdout ends with the one error message (rich wraps it to the console width; the progress bars are stderr).
    before, sep, message = result.stdout.partition("error:")
    assert sep and "error:" not in message, result.stdout
    assert " ".join(message.split()).startswith(key), result.stdout
