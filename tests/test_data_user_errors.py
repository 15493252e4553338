"""Mistakes in the task settings are user errors naming their config key, not ValueError tracebacks."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from zofed.cli import app
from zofed.data.dataset import DataError, TextDataset
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
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


def test_an_unset_verbalizer_takes_label_names_that_are_words(caplog) -> None:
    """A new user's labelled file and no task.verbalizer: label names that are words or codes are the answers,
    with one note saying so and how to choose others."""
    with caplog.at_level("INFO", logger="zofed.data"):
        task = make_task(TaskConfig(), tiny_tokenizer(), 2, ["negative", "positive"])
    assert task.verbalizer == ["negative", "positive"]
    assert task.label_token_ids.tolist() == [tiny_tokenizer().convert_tokens_to_ids(w) for w in task.verbalizer]
    (note,) = [r.getMessage() for r in caplog.records if "task.verbalizer is unset" in r.getMessage()]
    assert "--set 'task.verbalizer=[negative, positive]'" in note
    given = make_task(TaskConfig(verbalizer=["bad", "good"]), tiny_tokenizer(), 2, ["negative", "positive"])
    assert given.verbalizer == ["bad", "good"]  # a set verbalizer wins


@pytest.mark.parametrize(("names", "option"), [
    (["very negative", "negative"], "--set 'task.verbalizer=[\"very negative\", negative]'"),
    (["0", "1"], "--set 'task.verbalizer=[\"0\", \"1\"]'"),
    (["it's bad", "good"], "--set 'task.verbalizer=[\"it'\\''s bad\", good]'"),
])
def test_an_unset_verbalizer_and_label_names_that_are_not_words(names, option) -> None:
    """Phrases and numbers are not taken as answers: the error names them, in class order, in a line to edit."""
    with pytest.raises(DataError, match=r"task\.verbalizer is unset, and the data's label names") as err:
        make_task(TaskConfig(), tiny_tokenizer(), 2, names)
    assert str(err.value).endswith(option)


def test_label_names_that_share_a_first_token_say_where_the_words_came_from() -> None:
    with pytest.raises(DataError, match=r"the label names \(task\.verbalizer is unset\) \['fine', 'okay'\] share "
                                        r"their first token.*--set 'task\.verbalizer=\[fine, okay\]'"):
        make_task(TaskConfig(), tiny_tokenizer(), 2, ["fine", "okay"])  # the tiny vocabulary has neither: [UNK]


def _labelled_csv(path, labels) -> None:
    words = ["the", "movie", "was", "a", "it", "not"]
    with path.open("w") as f:
        f.write("text,label\n")
        for i in range(48):
            f.write(f"{words[i % 6]} w{i % 7} {words[(i * 5) % 6]},\"{labels[i % len(labels)]}\"\n")


def _run_args(tiny_workspace, data, out, *extra: str) -> list[str]:
    settings = [f"model.name={tiny_workspace / 'model'}", "federation.partition.num_clients=3",
                "federation.clients_per_round=2", "federation.local_steps=1", "train.batch_size=4",
                "data.eval_examples=8", *extra]
    return ["run", "--data", str(data), "--rounds", "1", "--out", str(out),
            *(arg for s in settings for arg in ("--set", s))]


def test_zofed_run_on_a_labelled_file_without_a_verbalizer(tiny_workspace, tmp_path) -> None:
    """`zofed run --data FILE` on a file of 6 word labels runs, answering with the label names; the run's config
    pins them, so it resumes with the verbalizer still unset."""
    labels = ["good", "bad", "great", "awful", "positive", "negative"]
    _labelled_csv(tmp_path / "six.csv", labels)
    result = CliRunner().invoke(app, _run_args(tiny_workspace, tmp_path / "six.csv", tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "task.verbalizer is unset" in result.output
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert stored["task"]["verbalizer"] == sorted(labels)  # the label names' order: sorted distinct values
    again = CliRunner().invoke(app, [*_run_args(tiny_workspace, tmp_path / "six.csv", tmp_path / "run"), "--resume"])
    assert again.exit_code == 0, again.output


def test_zofed_run_on_labels_that_are_phrases_says_what_to_set(tiny_workspace, tmp_path) -> None:
    _labelled_csv(tmp_path / "phrases.csv", ["very good", "good", "bad"])
    result = CliRunner().invoke(app, _run_args(tiny_workspace, tmp_path / "phrases.csv", tmp_path / "run"))
    assert result.exit_code == 2, result.output
    message = " ".join(result.stdout.partition("error:")[2].split())
    assert message.startswith("task.verbalizer is unset") and "very good" in message, result.stdout


def test_a_file_whose_format_cannot_be_guessed_says_what_to_set(tiny_workspace, tmp_path) -> None:
    """The CLI user's way to name a format is a config key, not load_file's argument."""
    (tmp_path / "reviews.data").write_text("text,label\na good movie,positive\n")
    result = CliRunner().invoke(app, _run_args(tiny_workspace, tmp_path / "reviews.data", tmp_path / "run"))
    assert result.exit_code == 2, result.output
    message = " ".join(result.stdout.partition("error:")[2].split())
    assert "cannot tell the format from the extension '.data'" in message
    assert "--set data.format=FORMAT" in message and "csv, tsv, jsonl, json, label-text" in message
