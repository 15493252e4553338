"""Instruction tuning judged by generation: prompt formats and the response-only loss, greedy batched generation,
ROUGE-L, and rougeL in centralized and federated runs, on the tiny random-init causal LM."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rouge_score import rouge_scorer
from safetensors.torch import load_file
from toy_federation import tiny_federated_config
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from zofed.cli import app
from zofed.data.causal_lm import INSTRUCTION_TEMPLATE
from zofed.data.dataset import DataError, TextDataset
from zofed.data.generation import generate_ids, rouge_l
from zofed.data.task_factory import make_task
from zofed.data.tasks import TaskConfig
from zofed.models.selection import TrainableConfig, select_trainable
from zofed.models.tiny import tiny_causal_lm, tiny_tokenizer
from zofed.run.config import ConfigError, load_config
from zofed.run.federated import run_federated
from zofed.run.federated_config import FederatedConfig
from zofed.run.finetune import finetune
from zofed.run.generate import generate_from_run, read_prompts

# A chat template in the tiny vocabulary; its [EOS] inside the prompt checks that the mask goes by position.
CHAT_TEMPLATE = ("{% for m in messages %}[BOS] {{ m['content'] }} [EOS] {% endfor %}"
                 "{% if add_generation_prompt %}[BOS] review :{% endif %}")
EXAMPLES = [{"instruction": "w1 w2 is", "context": "the movie", "response": "good w3 w4"},
            {"instruction": "w5 was", "context": "", "response": "bad"}]
PAD, EOS = 0, 3


def _chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _sharpened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Larger random weights: the random init repeats the last prompt token whatever the prompt, so greedy
    decoding only depends on the prompt (and padding mistakes only show) once the weights are larger."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


PROMPTS = [[5, 6, 7, 8, 9], [13], [20, 21, 22, 23, 24, 25, 26], [8, 9, 10], [30, 31]]  # lengths out of order


@pytest.mark.parametrize("prompt_format", ["template", "chat"])
def test_the_loss_counts_the_response_and_eos_only(prompt_format):
    tokenizer = _chat_tokenizer() if prompt_format == "chat" else tiny_tokenizer()
    task = make_task(TaskConfig(type="causal-lm"), tokenizer, None)  # auto: the chat template when there is one
    assert task.prompt_format == prompt_format
    encoded = task.encode(TextDataset(EXAMPLES, None, None, "dolly"))
    for k, example in enumerate(EXAMPLES):
        if prompt_format == "chat":  # the user turn is the instruction, then the context when there is one
            user = "\n\n".join(t for t in (example["instruction"], example["context"]) if t)
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
            assert text.endswith("[BOS] review :") and ("the movie" in text) == bool(example["context"])
        else:
            text = INSTRUCTION_TEMPLATE.format(**example)
        prompt = tokenizer(text, add_special_tokens=prompt_format == "template")["input_ids"]
        response = tokenizer(example["response"], add_special_tokens=False)["input_ids"] + [EOS]
        assert encoded.input_ids[k] == prompt + response and encoded.prompt_lengths[k] == len(prompt)
        assert encoded.prompt_ids[k] == prompt and encoded.references[k] == example["response"]

    model = tiny_causal_lm(seed=0).model
    batch = task.collate(encoded, [0, 1])
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # By hand: each response token (and the EOS) predicted from the position before it; nothing else counts.
    terms = [F.cross_entropy(logits[k, t - 1], torch.tensor(row[t]), reduction="none")
             for k, (row, p) in enumerate(zip(encoded.input_ids, encoded.prompt_lengths, strict=True))
             for t in range(p, len(row))]
    assert len(terms) == 4 + 2  # "good w3 w4" + eos, "bad" + eos
    assert task.loss(model, batch) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-5)
    assert task.evaluate(model, encoded, 2) == {"loss": pytest.approx(float(torch.stack(terms).mean()), rel=1e-5)}


def test_prompt_format_settings():
    chat = _chat_tokenizer()
    assert make_task(TaskConfig(type="causal-lm", prompt_format="template"), chat, None).prompt_format == "template"
    # A template the user wrote wins over auto's chat template.
    assert make_task(TaskConfig(type="causal-lm", template="{instruction} :"), chat, None).prompt_format == "template"
    with pytest.raises(DataError, match="prompt_format=chat needs a tokenizer with a chat template"):
        make_task(TaskConfig(type="causal-lm", prompt_format="chat"), tiny_tokenizer(), None)
    task = make_task(TaskConfig(type="causal-lm", prompt_format="chat"), chat, None)
    with pytest.raises(DataError, match="user turn from the instruction and context fields"):
        task.encode(TextDataset([{"text": "the movie", "response": "good"}], None, None, "tweets"))
    with pytest.raises(ValueError, match="task.generate_eval: settings of task.type causal-lm"):
        TaskConfig(type="prompt-classification", generate_eval=4)


def test_generation_stops_each_row_at_eos_and_after_max_new_tokens():
    model = _sharpened(tiny_causal_lm(seed=0).model)
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, out: calls.append(1))
    short, long = [8, 9], [20, 21, 22, 23]
    free = generate_ids(model, [short, long], pad_id=PAD, eos_id=EOS, max_new_tokens=5)
    assert [len(r) for r in free] == [5, 5] and len(calls) == 5  # no EOS on this path: five tokens, five passes

    def eos_for_the_first_row(module, inputs, out):
        out = out.clone()
        out[0, -1, EOS] = 1e4  # the batch is sorted by length: row 0 is the short prompt
        return out

    calls.clear()
    hook = model.lm_head.register_forward_hook(eos_for_the_first_row)
    stopped = generate_ids(model, [long, short], pad_id=PAD, eos_id=EOS, max_new_tokens=5)
    assert stopped == [free[1], []]  # input order; the stopped row ends, the other runs to max_new_tokens
    hook.remove()

    def eos_everywhere(module, inputs, out):
        out = out.clone()
        out[..., EOS] = 1e4
        return out

    calls.clear()
    model.lm_head.register_forward_hook(eos_everywhere)
    assert generate_ids(model, [short, long], pad_id=PAD, eos_id=EOS, max_new_tokens=5) == [[], []]
    assert len(calls) == 1  # every row stopped after its first token: no second pass


def test_left_padded_batches_give_what_one_prompt_at_a_time_gives():
    model = _sharpened(tiny_causal_lm(seed=0).model)
    alone = [generate_ids(model, [p], pad_id=PAD, eos_id=EOS, max_new_tokens=8)[0] for p in PROMPTS]
    assert len({tuple(r) for r in alone}) == len(PROMPTS)  # the prompts lead to different continuations
    assert all(len(set(r)) > 1 for r in alone if r)  # not one repeated token
    widths = []  # the prompt widths the model is handed (later steps feed one token from the KV cache)
    model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    assert generate_ids(model, PROMPTS, pad_id=PAD, eos_id=EOS, max_new_tokens=8, batch_size=3) == alone
    assert [w for w in widths if w > 1] == [3, 7]  # sorted by length: (1, 2, 3) then (5, 7), each left-padded
    done = []
    generate_ids(model, PROMPTS, pad_id=PAD, eos_id=EOS, max_new_tokens=2, batch_size=3, progress=done.append)
    assert done == [3, 5]


def test_generation_runs_the_lora_adapter_of_a_peft_model():
    base = _sharpened(tiny_causal_lm(seed=0).model)
    model, trainable = select_trainable(base, TrainableConfig(mode="lora", lora_r=2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable.params:
            p.copy_(torch.randn(p.shape, generator=gen))  # B starts at zero: give the adapter an effect
    tuned = generate_ids(model, PROMPTS, pad_id=PAD, eos_id=EOS, max_new_tokens=6, batch_size=3)
    with model.disable_adapter():
        plain = generate_ids(model, PROMPTS, pad_id=PAD, eos_id=EOS, max_new_tokens=6, batch_size=3)
    assert tuned != plain
    assert tuned == [generate_ids(model, [p], pad_id=PAD, eos_id=EOS, max_new_tokens=6)[0] for p in PROMPTS]


def test_rouge_l_is_the_mean_f1_of_rouge_score():
    assert rouge_l(["the cat sat on the mat"], ["the cat sat on the mat"]) == 1.0
    assert rouge_l(["good movie"], ["awful film"]) == 0.0
    # LCS "the cat on the mat": 5 of 6 words each way, so P = R = F1 = 5/6.
    assert rouge_l(["the cat sat on the mat"], ["the cat is on the mat"]) == pytest.approx(5 / 6)
    assert rouge_l(["running dogs"], ["run dog"]) == 1.0  # stemmed
    predictions = ["the cat sat on the mat", "good movie", "a quick brown fox", "it rained all day long"]
    references = ["the cat is on the mat", "awful film", "the quick brown fox jumps", "it was a long rainy day"]
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    direct = np.mean([scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)])
    assert rouge_l(predictions, references) == pytest.approx(direct)
    assert rouge_l([], []) == 0.0
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        rouge_l(["a", "b"], ["a"])


# ---------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def instructions(tiny_workspace, tmp_path_factory):
    """Instruction data in the tiny vocabulary, and the tiny workspace's model directory."""
    root = tmp_path_factory.mktemp("instructions")
    rng = np.random.default_rng(0)
    for name, n in (("train", 40), ("test", 12)):
        with (root / f"{name}.jsonl").open("w") as f:
            for _ in range(n):
                a, b, c = rng.integers(0, 30, size=3)
                word = rng.choice(["good", "bad", "great"])
                f.write(json.dumps({"instruction": f"w{a} w{b} is", "context": f"the movie w{c}",
                                    "response": f"it was {word}"}) + "\n")
    return tiny_workspace / "model", root


def _overrides(instructions, out):
    model, data = instructions
    return [f"model.name={model}", f"data.source={data / 'train.jsonl'}", f"data.test_source={data / 'test.jsonl'}",
            "data.text_columns=[instruction, context, response]", "data.label_column=null", "data.eval_examples=6",
            "task.type=causal-lm", "task.generate_eval=3", "task.max_new_tokens=4", "trainable.mode=lora",
            "trainable.lora_r=2", "optimizer.lr=0.02", "zo.eps=0.01", "train.batch_size=4", f"out_dir={out}"]


@pytest.fixture(scope="module")
def centralized_run(instructions, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm") / "run"
    config = load_config(None, [*_overrides(instructions, out), "train.steps=2", "train.eval_every=1",
                                "train.checkpoint_every=2"])
    return out, finetune(config, show_progress=False)


def test_a_centralized_causal_lm_run_reports_rouge_l(centralized_run):
    out, results = centralized_run
    written = json.loads((out / "results.json").read_text())
    assert written["test"] == results["test"] and set(written["test"]) == {"loss", "rougeL"}
    assert 0.0 <= written["test"]["rougeL"] <= 1.0
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("eval_rougeL" in r for r in evals)


def test_a_run_stores_the_prompt_format_auto_resolved_to_and_resumes_under_it(instructions, tmp_path):
    import yaml

    out = tmp_path / "run"
    first = load_config(None, [*_overrides(instructions, out), "train.steps=1", "train.checkpoint_every=1"])
    assert first.task.prompt_format == "auto"
    finetune(first, show_progress=False)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["task"]["prompt_format"] == "template"  # the tiny tokenizer has no chat template
    # Resuming with auto continues under the stored format; asking for another one names the change.
    more = load_config(None, [*_overrides(instructions, out), "train.steps=2", "train.checkpoint_every=1"])
    assert finetune(more, resume=True, show_progress=False)["steps"] == 2
    chat = load_config(None, [*_overrides(instructions, out), "train.steps=3", "task.prompt_format=chat"])
    with pytest.raises(ConfigError, match=r"task.prompt_format \('template' -> 'chat'\)"):
        finetune(chat, resume=True, show_progress=False)


def test_evaluate_scores_the_first_generate_eval_examples(centralized_run):
    from zofed.run.setup import load_run

    setup = load_run(centralized_run[0])
    task, data = setup.task, setup.test
    _sharpened(setup.model)  # the run's near-zero model writes only ":", which ROUGE drops: no words to match
    watched = [5, 2, 7, 9]
    predictions = task.generate(setup.model, [data.prompt_ids[i] for i in watched])
    assert all(0 < len(p.split()) <= 4 for p in predictions)  # word-level tokens: at most max_new_tokens words
    # References that the first three generations match exactly, and the fourth does not at all.
    data.references = list(data.references)
    for i, prediction in zip(watched, [*predictions[:3], "zzz"], strict=True):
        data.references[i] = prediction
    assert task.evaluate(setup.model, data, 4, watched)["rougeL"] == 1.0
    seen = []  # what a run's progress bar is told: answers done after each batch, of how many
    task.on_generated = lambda done, total: seen.append((done, total))
    task.evaluate(setup.model, data, 2, watched)
    assert seen == [(2, 3), (3, 3)]
    task.on_generated = None
    # A curve point answers at most task.curve_max_new_tokens; the final test keeps task.max_new_tokens.
    short = task.generate(setup.model, [data.prompt_ids[i] for i in watched[:3]], max_new_tokens=1)
    assert all(len(p.split()) <= 1 for p in short) and any(len(p.split()) > 1 for p in predictions[:3])
    setup.task.config = task.config.model_copy(update={"curve_max_new_tokens": 1})
    curve_point = task.evaluate_during_training(setup.model, data, 4, watched)["rougeL"]
    assert curve_point == pytest.approx(rouge_l(short, predictions[:3])) and curve_point < 1.0
    assert task.evaluate(setup.model, data, 4, watched)["rougeL"] == 1.0
    setup.task.config = task.config.model_copy(update={"generate_eval": 4})
    assert task.evaluate(setup.model, data, 4, watched)["rougeL"] == 0.75
    setup.task.config = task.config.model_copy(update={"generate_eval": 0})
    assert set(task.evaluate(setup.model, data, 4, watched)) == {"loss"}


def test_generate_from_run_answers_each_prompt(centralized_run, tmp_path):
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"instruction": "w1 w2 is", "context": "the movie"}\n\n{"instruction": "w7 is"}\n')
    prompts = read_prompts(lines)
    assert prompts == [{"instruction": "w1 w2 is", "context": "the movie"}, {"instruction": "w7 is"}]
    completions = generate_from_run(centralized_run[0], [*prompts, "w3 was"], max_new_tokens=2)
    assert len(completions) == 3 and all(isinstance(c, str) and len(c.split()) <= 2 for c in completions)
    plain = tmp_path / "prompts.txt"
    plain.write_text("w1 w2 is\nw3 was\n")
    assert read_prompts(plain) == ["w1 w2 is", "w3 was"]


def test_zofed_generate_prints_each_prompt_and_the_runs_completion(centralized_run):
    expected = generate_from_run(centralized_run[0], ["w3 was"], max_new_tokens=3)[0]
    shown = CliRunner().invoke(app, ["generate", str(centralized_run[0]), "-p", "w3 was", "--max-new-tokens", "3"])
    assert shown.exit_code == 0, shown.output
    assert [line.rstrip() for line in shown.stdout.splitlines() if line.strip()] == ["> w3 was", expected.strip()]
    none = CliRunner().invoke(app, ["generate", str(centralized_run[0])])
    assert none.exit_code == 2 and "give at least one --prompt" in none.output


def test_a_federated_causal_lm_run_reports_rouge_l_per_round_and_per_client(instructions, tmp_path):
    def federated(out, *extra):
        return load_config(None, [*_overrides(instructions, out), "federation.method=zo-seeds",
                                  "federation.clients_per_round=2", "federation.local_steps=1",
                                  "federation.partition.scheme=iid", "federation.partition.num_clients=4", *extra],
                           schema=FederatedConfig)

    out = tmp_path / "fed"
    results = run_federated(federated(out, "federation.rounds=2", "federation.eval_every=1"), show_progress=False)
    rounds = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2] and all(0 <= r["eval_rougeL"] <= 1 for r in rounds)
    written = json.loads((out / "results.json").read_text())
    assert written["client_metric"] == "rougeL" and len(written["client_rougeL"]) == 4
    assert written["client_rougeL_mean"] == pytest.approx(np.mean(written["client_rougeL"]))
    assert written["eval_rougeL_start"] is not None and written["eval_rougeL_final"] == rounds[-1]["eval_rougeL"]
    assert "rougeL" in results["test"]
    # Clients without held-out examples: the headline metric still comes from the task, not from client results.
    written = run_federated(federated(tmp_path / "bare", "federation.rounds=1", "federation.partition.test_fraction=0"),
                            show_progress=False)
    assert written["client_metric"] == "rougeL" and written["client_rougeL"] == []
    assert written["eval_rougeL_start"] is not None and "eval_accuracy_start" not in written
    # `zofed report` plots and tabulates ROUGE-L for these runs, and will not put them beside a classification.
    report = CliRunner().invoke(app, ["report", str(out), str(tmp_path / "bare"), "--out", str(tmp_path / "rep")])
    assert report.exit_code == 0, report.output
    table = (tmp_path / "rep" / "report.md").read_text()
    assert "| test ROUGE-L | client mean |" in table and f"| {results['test']['rougeL']:.4f} |" in table
    classification = tmp_path / "cls"
    run_federated(tiny_federated_config(instructions[0].parent, classification, "federation.rounds=1"),
                  show_progress=False)
    mixed = CliRunner().invoke(app, ["report", str(out), str(classification), "--out", str(tmp_path / "mixed")])
    assert mixed.exit_code != 0 and "one headline metric" in mixed.output and "cls: accuracy" in mixed.output


def test_generating_from_a_classification_run_is_refused(tiny_workspace, tmp_path):
    out, ws = tmp_path / "cls", tiny_workspace
    finetune(load_config(None, [f"model.name={ws / 'model'}", f"data.source={ws / 'train.jsonl'}",
                                f"data.test_source={ws / 'test.jsonl'}", "data.eval_examples=4",
                                "data.test_examples=4", "task.template='{text} :'",
                                "task.verbalizer=[negative, positive]", "train.steps=0", f"out_dir={out}"]),
             show_progress=False)
    with pytest.raises(ConfigError, match="generation needs task.type causal-lm"):
        generate_from_run(out, ["w1"], max_new_tokens=2)


def test_instruction_records_with_an_empty_context_load_when_the_column_is_optional(tiny_workspace, tmp_path):
    """Many Dolly records have no context: data.optional_columns lets that column be empty, and without it the
    loader names the setting."""
    from zofed.run.setup import load_splits

    records = [{"instruction": f"say w{i}", "context": "" if i % 2 else "w3 w4", "response": f"w{i}"} for i in range(6)]
    (tmp_path / "dolly.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    base = [f"model.name={tiny_workspace / 'model'}", f"data.source={tmp_path / 'dolly.jsonl'}",
            "data.text_columns=[instruction, context, response]", "data.label_column=null", "task.type=causal-lm"]
    with pytest.raises(DataError, match=r"empty text in column 'context' \(data.optional_columns=\[context\]"):
        load_splits(load_config(None, base))
    train, test = load_splits(load_config(None, [*base, "data.optional_columns=[context]"]))
    assert len(train) + len(test) == 6 and sum(f["context"] == "" for f in [*train.fields, *test.fields]) == 3


def test_a_held_out_category_becomes_the_test_task(tiny_workspace, tmp_path):
    """data.heldout_column/values: the chosen category's records leave training and are the whole test set (the
    given test file is not used); bad settings name what is wrong."""
    from zofed.run.setup import load_splits

    categories = ["qa", "summary", "creative"]
    records = [{"instruction": f"say w{i}", "context": "", "response": f"w{i}", "category": categories[i % 3]}
               for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "test.jsonl").write_text(json.dumps(records[0]) + "\n")
    base = [f"model.name={tiny_workspace / 'model'}", f"data.source={tmp_path / 'train.jsonl'}",
            f"data.test_source={tmp_path / 'test.jsonl'}", "data.optional_columns=[context]",
            "data.text_columns=[instruction, context, response, category]", "data.label_column=null",
            "task.type=causal-lm"]
    train, test = load_splits(load_config(None, [*base, "data.heldout_column=category",
                                                 "data.heldout_values=[creative]"]))
    assert [f["category"] for f in test.fields] == ["creative"] * 4 and len(test) == 4
    assert len(train) == 8 and "creative" not in {f["category"] for f in train.fields}
    no_file = [o for o in base if not o.startswith("data.test_source")]  # no fifth is split off for testing
    train, test = load_splits(load_config(None, [*no_file, "data.heldout_column=category",
                                                 "data.heldout_values=[creative]"]))
    assert (len(train), len(test)) == (8, 4)
    with pytest.raises(ConfigError, match=r"\['poetry'\] not among .*'category' values \['creative', 'qa', "):
        load_splits(load_config(None, [*base, "data.heldout_column=category", "data.heldout_values=[poetry]"]))
    with pytest.raises(ConfigError, match="nothing is left to train on"):
        load_splits(load_config(None, [*base, "data.heldout_column=category",
                                       "data.heldout_values=[qa, summary, creative]"]))
    with pytest.raises(ConfigError, match="example 0 has no such field"):
        load_splits(load_config(None, [*base, "data.heldout_column=topic", "data.heldout_values=[qa]"]))
    with pytest.raises(ConfigError, match="needs both data.heldout_column"):
        load_config(None, [*base, "data.heldout_column=category"])


def test_showing_generation_reports_answers_while_open_and_then_lets_go():
    from zofed.data.generation import showing_generation

    task = make_task(TaskConfig(type="causal-lm", generate_eval=2), tiny_tokenizer(), None)
    shown = []
    with showing_generation(task, shown.append):
        task.on_generated(1, 2)
    assert shown == ["evaluating: 1/2 answers generated"] and task.on_generated is None
    classification = make_task(TaskConfig(verbalizer=["good", "bad"]), tiny_tokenizer(), 2)
    with showing_generation(classification, shown.append):  # nothing to report, nothing set
        assert not hasattr(classification, "on_generated")


def test_a_federated_causal_lm_run_with_top_block_lora_and_the_prefix_cached_ends_as_without_it(instructions,
                                                                                                tmp_path):
    """LoRA on the top block only (trainable.lora_layers=[-1]) lets the frozen bottom run once per batch: with each
    step capturing its own batch the run ends bit-identical to the uncached one and is charged (1 - f) + (q + 1) f
    passes a step (q = 2)."""
    finals, passes = {}, {}
    for cached in (False, True):
        out = tmp_path / f"fed-{cached}"
        config = load_config(None, [*_overrides(instructions, out), "federation.method=zofed",
                                    "trainable.lora_layers=[-1]", "zo.queries=2", "federation.clients_per_round=2",
                                    "federation.local_steps=2", "federation.partition.scheme=iid",
                                    "federation.partition.num_clients=4", "federation.rounds=2",
                                    "task.generate_eval=0", f"zo.cache={'prefix' if cached else 'none'}",
                                    *(["federation.cached_examples=0"] if cached else [])],
                             schema=FederatedConfig)
        passes[cached] = run_federated(config, show_progress=False)["forward_passes_per_client_round"]
        finals[cached] = load_file(str(out / "final" / "trainable.safetensors"))
    assert sorted(finals[True]) == sorted(finals[False]) and all(".layers.1." in name for name in finals[True])
    assert all(torch.equal(finals[False][k], finals[True][k]) for k in finals[True])
    assert any(finals[True][k].abs().sum() > 0 for k in finals[True] if "lora_B" in k)  # it trained
    # a cached pass runs the top block and the vocabulary projection: its share of their weights (f) is charged,
    # one-sided: q + 1 passes a step after the capture pass
    lm = AutoModelForCausalLM.from_pretrained(instructions[0])
    blocks, head = [sum(p.numel() for p in b.parameters()) for b in lm.model.layers], lm.lm_head.weight.numel()
    adapters = sum(v.numel() for v in finals[True].values())
    f = (blocks[1] + adapters + head) / (sum(blocks) + adapters + head)
    assert passes[False] == 2 * 3 and passes[True] == pytest.approx(2 * ((1 - f) + 3 * f))


def test_the_shipped_instruction_config_runs_on_its_example_records(tiny_workspace, tmp_path):
    """configs/federated_instruct.yaml (the README's instruction-tuning example) with the tiny model: its records
    load under its columns, the natural split by category gives one client per category, and a round trains the
    top blocks' adapters through the prefix cache and ends with ROUGE-L on the example test file."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "configs" / "federated_instruct.yaml",
                         [f"model.name={tiny_workspace / 'model'}", "federation.rounds=1", "federation.eval_every=1",
                          f"data.source={root / 'examples' / 'instructions_train.jsonl'}",
                          f"data.test_source={root / 'examples' / 'instructions_test.jsonl'}",
                          "task.max_new_tokens=4", f"out_dir={tmp_path / 'run'}",
                          "trainable.lora_layers=[-1]"],  # the tiny model has 2 blocks: its top one, as SmolLM2's 2
                         schema=FederatedConfig)
    results = run_federated(config, show_progress=False)
    records = [json.loads(line) for line in (root / "examples" / "instructions_train.jsonl").read_text().splitlines()]
    clients = json.loads((tmp_path / "run" / "partition.json").read_text())["clients"]
    held = [{records[i]["category"] for i in c["train"]} for c in clients]
    assert all(len(categories) == 1 for categories in held)  # each client holds one category, and all of it
    assert sorted(categories.pop() for categories in held) == ["brainstorming", "open_qa", "summarization"]
    assert sorted(i for c in clients for i in c["train"]) == list(range(len(records)))
    assert results["test_examples"] == 8 and 0 <= results["test"]["rougeL"] <= 1
    # the cached passes cost less than the config's 4 queries would on the whole model (5 passes a step)
    assert results["forward_passes_per_client_round"] < (config.zo.queries + 1) * config.federation.local_steps
    adapters = load_file(tmp_path / "run" / "final" / "trainable.safetensors")
    assert adapters and all(".layers.1." in name and "lora_" in name for name in adapters)
