"""Benchmark: every federated method on the same data, model, split and forward-pass budget.

The headline matrix: methods x datasets (SST-2, AG News from ../shared/data; AG News gets a seeded
6,000/1,600 train/test split of its 7,600-example file) x Dirichlet alpha (0.1, 1.0) x seeds, on SmolLM2 with
its RMSNorm gains perturbed and a prompt. Every ZO method gets the same rounds x clients per round x local
steps, so the same number of forward passes; first-order baselines take the same number of local steps.
Two references share the table: zero-shot (the untrained model) and centralized MeZO on the clients' pooled
training examples with the same forward-pass budget. Forward passes count the full model's forward-pass
equivalents over the sampled clients: 2 per query and local step for ZO, 3 per first-order local step.
The methods are the registered ones (zofed.fl.methods) plus this benchmark's zofed ablations.
Each finished run appends one row to docs/results/federated.json; rows already there are skipped, so the
matrix can be completed over several sittings, and an interrupted run resumes from its checkpoint.

Run: `make bench-federated` (all rows), or pick rows: `--methods zo-seeds decomfl --datasets sst2
--alphas 0.1 --seeds 0`. Skipped with a message when ../shared/data is absent. `--table-only` runs nothing
and needs no data: it rewrites docs/results/federated.md and the figures from docs/results/federated.json,
saving back the JSON's corrections (first-order rows written before client compute was counted in full).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from row_pool import record_rows, run_rows  # benchmarks/ is the script's own directory, so first on sys.path

from zofed.atomic_files import write_atomic_text
from zofed.data.builtin import shared_data_dir
from zofed.data.partition import client_splits
from zofed.data.tasks import Encoded
from zofed.fl.methods import get_method, method_names
from zofed.fl.plan import LocalTraining
from zofed.fl.rounds import peak_rss_mib
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import load_config
from zofed.run.federated import per_client_accuracy, run_federated, worst_decile_mean
from zofed.run.federated_config import FederatedConfig
from zofed.run.finetune import finetune
from zofed.run.metrics import MetricsLog
from zofed.run.setup import build

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
# zofed and its ablations first; "zofed without either" is exactly zo-seeds (same seeds, sgd lr 1 on the server).
# zofed-size-blocks keeps zofed's one-block steps but draws the block in proportion to its size, the same for every
# client: against zofed it prices the personal distribution, against zofed-no-personal (dense steps) the one-block
# steps themselves. zofed-tilt adds the ZO-AdaMU-style lean of every direction towards the server's first moment.
# zofed-blocks4 and zofed-blocks8 cut the 61 gains into 4 or 8 runs of layers instead of one block per tensor;
# zofed-shared gives the round's clients DeComFL's shared step seeds, each still drawing blocks from its own pi.
# zofed-cosine starts the server step at twice the default and lowers it along a cosine to zero at the last round.
ABLATIONS = ["zofed-size-blocks", "zofed-tilt", "zofed-blocks4", "zofed-blocks8", "zofed-shared", "zofed-cosine",
             "zofed-no-personal", "zofed-no-momentum"]
# The base methods are the registered ones (a new registration joins the benchmark), zofed first.
METHODS = ["zofed", *ABLATIONS, *(m for m in method_names() if m != "zofed")]
# zofed's ZO baselines: every registered method that does not back-propagate, zofed itself aside.
ZO_BASELINES = [m for m in method_names(first_order=False) if m != "zofed"]
REFERENCES = ["zero-shot", "centralized-mezo"]
# The prompt is one line: the label word follows "Sentiment:" after a space.
TASKS = {
    "sst2": ["task.template='Review: {text} Sentiment:'", "task.verbalizer=[' negative', ' positive']"],
    "agnews": ["task.template='Article: {text} Topic:'",
               "task.verbalizer=[' World', ' Sports', ' Business', ' Technology']"],
}
# Sized for a 2-core machine: one SST-2 row takes a few minutes, an AG News row about twice that.
ROUNDS, CLIENTS_PER_ROUND, LOCAL_STEPS, BATCH = 10, 3, 4, 8
NUM_CLIENTS, TEST_FRACTION = 10, 0.1
BUDGET = [f"federation.clients_per_round={CLIENTS_PER_ROUND}",
          f"federation.local_steps={LOCAL_STEPS}", f"federation.partition.num_clients={NUM_CLIENTS}",
          f"federation.partition.test_fraction={TEST_FRACTION}", f"train.batch_size={BATCH}", "data.eval_examples=100",
          "federation.eval_every=5", "task.max_length=64", "train.eval_batch_size=32"]
METHOD_SETTINGS = {
    "zofed": [], "zofed-size-blocks": ["federation.sampling.mix=1.0"], "zofed-tilt": ["federation.sampling.tilt=0.5"],
    "zofed-blocks4": ["federation.sampling.blocks=4"], "zofed-blocks8": ["federation.sampling.blocks=8"],
    "zofed-shared": ["federation.sampling.shared_seeds=true"],
    "zofed-cosine": ["federation.server_optimizer.decay=cosine", "federation.server_optimizer.lr=2e-2"],
    "zofed-no-personal": ["federation.sampling.personalize=false"],
    "zofed-no-momentum": ["federation.server_optimizer.name=sgd"],
    "zo-seeds": [], "decomfl": [], "fedkseed": ["federation.pool_size=64"], "fedmezo": [],
    "fedavg": ["federation.server_optimizer.name=sgd"],
    "fedadam": ["federation.server_optimizer.name=adam", "federation.server_optimizer.lr=1e-3"],
}
# MeZO lr 3e-4: the projected gradients on these gains are ~3-4 in size, so a step moves each by ~1e-3.
COMMON = ["optimizer.name=mezo", "optimizer.lr=3e-4", "zo.eps=1e-3", "federation.first_order_lr=1e-3"]
# SmolLM2-135M's trainable sets: 61 RMSNorm gains of 576 (2 in each of 30 layers and the final norm) for the ZO
# methods; LoRA r 8 on q (576 -> 576) and v (576 -> 192) in the 30 layers for the first-order ones.
GAIN_TENSORS, HIDDEN = 61, 576
LORA_VALUES = 30 * 8 * ((576 + 576) + (576 + 192))
MODELS = {
    "smollm2-135m": ["model.name=smollm2-135m", "trainable.mode=patterns", "trainable.patterns=['norm\\.weight$']"],
    # MiniLM has no verbalizer: a classification head (new, random) on top, trained with the LayerNorm gains.
    "minilm-l6": ["model.name=minilm-l6", "task.type=encoder-classification", "trainable.mode=patterns",
                  "trainable.patterns=['LayerNorm\\.weight$', '^classifier\\.']"],
}


def row_key(method: str, dataset: str, alpha: float, seed: int, model: str, rounds: int = ROUNDS) -> str:
    """Rows of the headline budget keep their short key; a longer run (`--rounds`) is its own row."""
    return f"{method}|{dataset}|{alpha}|{seed}|{model}" + ("" if rounds == ROUNDS else f"|r{rounds}")


def _base_method(method: str) -> str:
    """The registered federation.method a benchmark row runs: its ablations are zofed with settings changed."""
    return "zofed" if method in ABLATIONS else get_method(method).name


def _first_order(method: str) -> bool:
    """Whether a row's clients back-propagate (the references are not federated methods)."""
    return method not in REFERENCES and get_method(_base_method(method)).first_order


def _config(method: str, dataset: str, alpha: float, seed: int, out: Path, model: str,
            rounds: int = ROUNDS) -> FederatedConfig:
    settings = METHOD_SETTINGS.get(method, []) + ([f"federation.method={_base_method(method)}"]
                                                  if method in METHODS else [])
    task = TASKS[dataset] if model == "smollm2-135m" else []
    if _first_order(method) and model == "smollm2-135m":
        settings = [*settings, "trainable.mode=lora"]  # first-order baselines train LoRA (r 8 on q, v)
    return load_config(None, [*MODELS[model], *COMMON, *task, *BUDGET, f"federation.rounds={rounds}", *settings,
                              f"data.source=shared:{dataset}", f"federation.partition.alpha={alpha}",
                              f"federation.partition.seed={seed}", f"train.seed={seed}", f"out_dir={out}"],
                       schema=FederatedConfig)


def run_row(method: str, dataset: str, alpha: float, seed: int, model: str = "smollm2-135m",
            rounds: int = ROUNDS) -> dict:
    suffix = ("" if model == "smollm2-135m" else f"-{model}") + ("" if rounds == ROUNDS else f"-r{rounds}")
    out = ROOT / "runs" / "bench" / "federated" / f"{method}-{dataset}-a{alpha}-s{seed}{suffix}"
    config = _config(method, dataset, alpha, seed, out, model, rounds)
    if method in REFERENCES:
        return _reference_row(method, config, dataset, alpha, seed, out)
    results = run_federated(config, resume=find_checkpoint(out / "checkpoint") is not None,
                            show_progress=sys.stderr.isatty())
    return row_from_results(method, dataset, alpha, seed, config, out, results)


def row_from_results(method: str, dataset: str, alpha: float, seed: int, config: FederatedConfig, out: Path,
                     results: dict) -> dict:
    fed = config.federation
    return {"method": method, "dataset": dataset, "alpha": alpha, "model": config.model.name, "seed": seed,
            "final_accuracy": round(results["test"]["accuracy"], 4),
            "client_accuracy_mean": round(results["client_accuracy_mean"], 4),
            "client_accuracy_worst10": round(results["client_accuracy_worst10"], 4),
            "bytes_up_per_client_round": results["bytes_up_per_client_round"],
            "bytes_down_per_client_round": results["bytes_down_per_client_round"],
            "rounds": fed.rounds, "clients": fed.partition.num_clients, "clients_per_round": fed.clients_per_round,
            "local_steps": fed.local_steps, "forward_passes": results["forward_passes"],
            "forward_passes_per_client_round": results["forward_passes_per_client_round"],
            "peak_rss_mib": _peak(out), "eval_curve": _eval_curve(out),
            "wall_seconds": _round_seconds(out), "run_dir": str(out.relative_to(ROOT))}


def _row_process(method: str, dataset: str, alpha: float, seed: int, model: str, rounds: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_row(method, dataset, alpha, seed, model, rounds), "peak_rss_scope": "row", "torch_threads": threads}


def _reference_row(method: str, config: FederatedConfig, dataset: str, alpha: float, seed: int, out: Path) -> dict:
    """Zero-shot (no training) and centralized MeZO on the clients' pooled training examples, with the
    federated ZO methods' forward-pass budget; both scored on the full test split and on every client's
    held-out examples like the federated rows."""
    t0 = time.perf_counter()
    setup = build(config)
    splits = client_splits(setup.train_data, config.federation.partition)
    steps = ROUNDS * CLIENTS_PER_ROUND * LOCAL_STEPS if method == "centralized-mezo" else 0
    if steps:
        pooled = np.concatenate([s.train for s in splits])
        client_view = setup.train
        setup.train = Encoded([client_view.input_ids[i] for i in pooled], client_view.labels[pooled])
        config = config.model_copy(update={"train": config.train.model_copy(update={
            "steps": steps, "eval_every": steps, "checkpoint_every": steps})})
        setup.config = config
        test = finetune(config, resume=find_checkpoint(out / "checkpoint") is not None,
                        show_progress=sys.stderr.isatty(), setup=setup)["test"]
        setup.train = client_view
    else:
        test = setup.task.evaluate(setup.model, setup.test, config.train.eval_batch_size)
    clients = per_client_accuracy(setup, splits, config.train.eval_batch_size)
    return {"method": method, "dataset": dataset, "alpha": alpha, "model": config.model.name, "seed": seed,
            "final_accuracy": round(test["accuracy"], 4), "client_accuracy_mean": round(float(np.mean(clients)), 4),
            "client_accuracy_worst10": round(worst_decile_mean(clients), 4),
            "bytes_up_per_client_round": 0.0, "bytes_down_per_client_round": 0.0, "rounds": 0,
            "clients": len(splits), "clients_per_round": 0, "local_steps": 0,
            "forward_passes": 2 * config.zo.queries * steps,
            "peak_rss_mib": peak_rss_mib(),
            "wall_seconds": round(time.perf_counter() - t0, 1), "run_dir": str(out.relative_to(ROOT))}


def _rounds(out: Path) -> list[dict]:
    """The run's round records (every sitting of a resumed run)."""
    return [r for r in MetricsLog(out / "metrics.jsonl").read() if r.get("event") == "round"]


def _eval_curve(out: Path) -> list[list[float]]:
    """[round, accuracy on the fixed test subset] at every evaluated round."""
    return [[r["round"], r["eval_accuracy"]] for r in _rounds(out) if "eval_accuracy" in r]


def _round_seconds(out: Path) -> float:
    """Seconds of all the run's rounds, also those of earlier sittings when the row was resumed."""
    return round(sum(r["round_seconds"] for r in _rounds(out)), 1)


def _peak(out: Path) -> float:
    return max(r.get("peak_rss_mib", 0.0) for r in MetricsLog(out / "metrics.jsonl").read())


ORDER = REFERENCES + METHODS


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by (dataset, alpha, model, method), methods in the benchmark's order."""
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["dataset"], r["alpha"], r["model"], ORDER.index(r["method"]), r["seed"])):
        groups.setdefault((r["dataset"], r["alpha"], r["model"], r["method"]), []).append(r)
    return groups


def write_figures(rows: list[dict], tag: str = "") -> list[Path]:
    """Per (dataset, alpha): subset accuracy against rounds and against cumulative uplink bytes per client,
    mean over seeds, one line per federated method. `tag` ends the file names (a longer budget's figures)."""
    from matplotlib.figure import Figure

    paths = []
    settings = sorted({(r["dataset"], r["alpha"], r["model"]) for r in rows if r.get("eval_curve")})
    for dataset, alpha, model in settings:
        fig = Figure(figsize=(11, 4.2))
        by_round, by_bytes = fig.subplots(1, 2)
        for (d, a, m, method), rs in _groups(rows).items():
            curves = [r["eval_curve"] for r in rs if r.get("eval_curve")]
            if (d, a, m) != (dataset, alpha, model) or not curves:
                continue
            rounds = np.array([c[0] for c in curves[0]])
            acc = np.mean([[c[1] for c in curve] for curve in curves if len(curve) == len(rounds)], axis=0)
            style = {"lw": 2.5} if method == "zofed" else {"lw": 1.2, "ls": "--" if method.startswith("fed") else "-"}
            label = f"{method} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
            by_round.plot(rounds, acc, marker="o", ms=3, label=label, **style)
            by_bytes.plot(rounds * rs[0]["bytes_up_per_client_round"], acc, marker="o", ms=3, label=label, **style)
        for method in REFERENCES:
            ref = [r["final_accuracy"] for r in rows if (r["dataset"], r["alpha"], r["model"], r["method"])
                   == (dataset, alpha, model, method)]
            if ref:
                by_round.axhline(float(np.mean(ref)), color="grey", lw=0.8, ls=":")
                by_round.text(0.01, float(np.mean(ref)), f"{method} (full test)", fontsize="x-small", color="grey",
                              va="bottom", transform=by_round.get_yaxis_transform())
        by_round.set(xlabel="round", ylabel="accuracy on the fixed test subset", title=f"{dataset}, alpha {alpha}")
        by_bytes.set(xscale="log", xlabel="cumulative uplink bytes per client", title="accuracy against bytes sent")
        by_round.legend(fontsize="x-small")
        fig.tight_layout()
        path = RESULTS / f"federated_{dataset}_a{alpha}_{model}{tag}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _queries() -> int:
    """ZO queries per local step of every row: COMMON leaves zo.queries at the config's default."""
    return load_config(None, COMMON, schema=FederatedConfig).zo.queries


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def expected_forward_passes(row: dict, queries: int) -> tuple[float, float]:
    """A federated row's (per client and round, whole run) forward passes, from its own local steps, clients per
    round and rounds and its method's count (2 per query and local step for ZO, 3 per first-order step)."""
    base = _base_method(row["method"])
    local = LocalTraining(method=base, run_seed=0, round_id=0, local_steps=row["local_steps"], lr=0.0, eps=0.0,
                          queries=queries)
    per_client = get_method(base).forward_passes(local)
    return per_client, per_client * row["clients_per_round"] * row["rounds"]


def correct_forward_passes(rows: list[dict]) -> int:
    """Rows written before client compute was counted in full (first-order rows counted 2 per local step, as a
    ZO query does) get the count their own fields give, and `forward_passes_corrected: true`; every federated
    row gets `forward_passes_per_client_round`. Returns how many rows this call corrected."""
    queries, corrected = _queries(), 0
    for row in rows:
        if row["method"] in REFERENCES:  # zero-shot 0, centralized MeZO 2 per query and step: written right
            continue
        per_client, total = expected_forward_passes(row, queries)
        if row["forward_passes"] != total:
            row.update(forward_passes=_number(total), forward_passes_corrected=True)
            corrected += 1
        if row.get("forward_passes_corrected") or "forward_passes_per_client_round" not in row:
            row["forward_passes_per_client_round"] = _number(per_client)
    return corrected


def load_table(path: Path) -> dict:
    """docs/results/federated.json with its rows brought up to date (curves read from run directories still
    here, forward passes corrected), saved back atomically when anything changed."""
    table = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    changed = correct_forward_passes(list(table["rows"].values()))
    for row in table["rows"].values():  # rows written before curves were recorded
        if "eval_curve" not in row and row["rounds"] and (ROOT / row["run_dir"] / "metrics.jsonl").is_file():
            row["eval_curve"] = _eval_curve(ROOT / row["run_dir"])
            changed += 1
    if changed:
        write_atomic_text(path, json.dumps(table, indent=2))
    return table


def _sampling(rounds: int, clients: int, clients_per_round: int, local_steps: int) -> tuple[float, float]:
    """How many times a client is sampled over a run, in expectation, and the probes (local steps) that makes."""
    visits = rounds * clients_per_round / clients
    return visits, visits * local_steps


def _mean(rs: list[dict], key: str = "final_accuracy") -> float:
    return float(np.mean([r[key] for r in rs]))


def budget_lines(rows: list[dict], longer: bool) -> list[str]:
    """What the headline budget is and what these rows resolve at it, every number from the constants or rows."""
    fed = [r for r in rows if r["method"] not in REFERENCES]
    passes = {fo: sorted({r["forward_passes"] for r in fed if _first_order(r["method"]) == fo}) for fo in (False, True)}
    visits, probes = _sampling(ROUNDS, NUM_CLIENTS, CLIENTS_PER_ROUND, LOCAL_STEPS)
    lines = ["## The budget and what it resolves", "",
             f"A headline run makes {ROUNDS} rounds of {CLIENTS_PER_ROUND} of {NUM_CLIENTS} clients, each "
             f"{LOCAL_STEPS} local steps of batch {BATCH}: "
             + "; ".join(f"{'first-order' if fo else 'ZO'} rows cost {', '.join(f'{p:,.0f}' for p in ps)} forward "
                         "passes" for fo, ps in passes.items() if ps)
             + f". A client is sampled {ROUNDS} x {CLIENTS_PER_ROUND} / {NUM_CLIENTS} = {visits:g} times in "
             f"expectation and so makes {probes:g} probes over a run; a zofed probe moves one block, and SmolLM2's "
             f"gains are {GAIN_TENSORS} blocks (one per tensor) unless `federation.sampling.blocks` cuts them "
             "otherwise. More rounds give the per-client block statistics more probes, and more clients per round "
             "put more clients' label mixes into each round"
             + (" (the section \"A longer budget\" has runs with more rounds)" if longer else "")
             + ". The full test splits score every budget, so final accuracies compare across budgets. Per "
             "setting (points are 100 x accuracy; standard deviations over seeds, as in the table):", ""]
    for (dataset, alpha, model), by in _settings(rows).items():
        parts = []
        if "zero-shot" in by and "centralized-mezo" in by:
            zero, central = _mean(by["zero-shot"]), _mean(by["centralized-mezo"])
            parts.append(f"centralized MeZO {100 * (central - zero):+.2f} points over zero-shot ({zero:.4f} -> "
                         f"{central:.4f})")
        means = {m: _mean(rs) for m, rs in by.items() if m not in REFERENCES}
        if means and "zero-shot" in by:
            best = max(means, key=means.get)
            parts.append(f"best federated method {best} {100 * (means[best] - _mean(by['zero-shot'])):+.2f} points "
                         "over zero-shot")
        stds = {m: 100 * float(np.std([r["final_accuracy"] for r in rs])) for m, rs in by.items()
                if m not in REFERENCES and len(rs) > 1}
        for label, names in (("registered ZO methods", ["zofed", *ZO_BASELINES]),
                             ("with zofed's ablations", ["zofed", *ABLATIONS, *ZO_BASELINES])):
            zo = {m: means[m] for m in names if m in means}
            if len(zo) > 1:
                hi, lo = max(zo, key=zo.get), min(zo, key=zo.get)
                parts.append(f"{label} ({len(zo)}) span {100 * (zo[hi] - zo[lo]):.2f} points (best {hi}, worst {lo})")
            spread = {m: stds[m] for m in zo if m in stds}
            if label.startswith("registered") and spread:
                hi, lo = max(spread, key=spread.get), min(spread, key=spread.get)
                parts.append(f"their seed standard deviations {spread[lo]:.2f} ({lo}) to {spread[hi]:.2f} ({hi}) "
                             "points")
        if stds:
            hi, lo = max(stds, key=stds.get), min(stds, key=stds.get)
            parts.append(f"seed standard deviations of all {len(stds)} methods with two or more seeds "
                         f"{stds[lo]:.2f} ({lo}) to {stds[hi]:.2f} ({hi}) points")
        if parts:
            lines.append(f"- **{dataset}, alpha {alpha}, {model}**: " + "; ".join(parts))
    return lines


def _settings(rows: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """Rows by (dataset, alpha, model), then by method in the benchmark's order."""
    settings: dict[tuple, dict[str, list[dict]]] = {}
    for (dataset, alpha, model, method), rs in _groups(rows).items():
        settings.setdefault((dataset, alpha, model), {})[method] = rs
    return settings


def _paired(by: dict[str, list[dict]], other: str) -> tuple[list[int], float, float]:
    """The seeds zofed and `other` share (a seed fixes the split and the batches), and both means on them."""
    mine = {r["seed"]: r["final_accuracy"] for r in by["zofed"]}
    theirs = {r["seed"]: r["final_accuracy"] for r in by[other]}
    seeds = sorted(mine.keys() & theirs.keys())
    return seeds, float(np.mean([mine[s] for s in seeds])), float(np.mean([theirs[s] for s in seeds]))


def target_lines(rows: list[dict], alpha: float = 0.1, model: str = "smollm2-135m") -> list[str]:
    """zofed's targets (set at Dirichlet alpha 0.1; the same comparisons at other alphas for reference), each
    against a baseline on the seeds the two share."""
    title = (f"## zofed's targets (alpha {alpha}, {model})" if alpha == 0.1 else
             f"## The same comparisons at alpha {alpha} ({model}; the targets are set at alpha 0.1)")
    lines = [title, "",
             "Each comparison uses the seeds zofed and that baseline share; `seeds` lists them.", ""]
    for dataset in TASKS:
        by = {m: rs for (d, a, mo, m), rs in _groups(rows).items() if (d, a, mo) == (dataset, alpha, model)}
        if "zofed" not in by:
            continue
        lines.append(f"**{dataset}**")
        margins = {}
        for m in ZO_BASELINES:
            if m in by:
                seeds, z, other = _paired(by, m)
                if seeds:
                    margins[m] = (100 * (z - other), seeds, other)
        if margins:
            worst = min(margins, key=lambda m: margins[m][0])
            margin, seeds, other = margins[worst]
            lines.append(f"- best ZO final accuracy by >= 2 points: smallest margin is against {worst} ({other:.4f}, "
                         f"seeds {seeds}): {margin:+.2f} points: {'met' if margin >= 2 else 'missed'}. All margins: "
                         + ", ".join(f"{m} {v[0]:+.2f} ({len(v[1])} seeds)" for m, v in margins.items()))
        if "fedmezo" in by:
            half = ROUNDS // 2
            seeds = sorted({r["seed"] for r in by["fedmezo"]} & {r["seed"] for r in by["zofed"]})
            fedmezo_end = float(np.mean([r["eval_curve"][-1][1] for r in by["fedmezo"] if r["seed"] in seeds]))
            zofed_half = float(np.mean([dict(map(tuple, r["eval_curve"]))[half] for r in by["zofed"]
                                        if r["seed"] in seeds]))
            lines.append(f"- FedMeZO's final subset accuracy ({fedmezo_end:.4f}) reached by round {half}: zofed has "
                         f"{zofed_half:.4f} (seeds {seeds}): {'met' if zofed_half >= fedmezo_end else 'missed'}")
        if "fedavg" in by:
            seeds, z, fedavg = _paired(by, "fedavg")
            gap = round(100 * (fedavg - z), 2)
            mine = _mean(by["zofed"], "bytes_up_per_client_round")
            theirs = _mean(by["fedavg"], "bytes_up_per_client_round")
            up = theirs / mine
            uplink = (f"- uplink >= 1,000x smaller than FedAvg's (its LoRA update, {theirs:,.0f} bytes per client "
                      f"and round against zofed's {mine:,.1f}): {up:,.0f}x: {'met' if up >= 1000 else 'missed'}")
            if "fedmezo" in by:  # the target is against FedAvg; this is the same trainable set sent dense
                dense = _mean(by["fedmezo"], "bytes_up_per_client_round")
                uplink += (f". Against a dense upload of zofed's own trainable set (FedMeZO's, {dense:,.0f} bytes): "
                           f"{dense / mine:,.0f}x smaller")
            mem = max(r["peak_rss_mib"] for r in by["zofed"]) / max(r["peak_rss_mib"] for r in by["fedavg"])
            lines += [f"- within 3 points of FedAvg ({fedavg:.4f}, seeds {seeds}): gap {gap:+.2f} points: "
                      f"{'met' if gap <= 3 else 'missed'}", uplink,
                      f"- peak memory <= 1/3 of FedAvg's (process peak RSS, model weights included): "
                      f"{mem:.2f}: {'met' if mem <= 1 / 3 else 'missed'}", *_client_memory_lines()]
        lines.append("")
    return lines if len(lines) > 4 else []


def _client_memory_lines() -> list[str]:
    """One client's round measured on its own (benchmarks/client_memory.py), when that benchmark has run."""
    path = RESULTS / "client_memory.json"
    if not path.is_file():
        return []
    cells = json.loads(path.read_text())["rows"]
    peaks = ", ".join(f"{c['zofed_over_fedavg_peak']:.2f} at {c['batch']}x{c['seq_len']}" for c in cells)
    working = ", ".join(f"{c['zofed_over_fedavg_working']:.2f}" for c in cells)
    return [f"- the same for one client's round alone (`client_memory.md`, batch x tokens): peak {peaks}; "
            f"memory above the loaded model {working}"]


def longer_budget_lines(rows: list[dict]) -> list[str]:
    """Rows run with more rounds than the headline budget (`--rounds`), and zofed's margin over each other
    method on the seeds they share."""
    if not rows:
        return []
    budgets = sorted({(r["rounds"], r["clients"], r["clients_per_round"], r["local_steps"]) for r in rows})
    probes = "; ".join(f"{b[0]} rounds: sampled {v:g} times, {n:g} probes" for b in budgets
                       for v, n in [_sampling(*b)])
    visits, headline = _sampling(ROUNDS, NUM_CLIENTS, CLIENTS_PER_ROUND, LOCAL_STEPS)
    lines = ["## A longer budget", "",
             "The same runs with more rounds (every other setting as above), to see whether zofed's per-client "
             "block statistics pay off once they have more probes to fit: a client is, in expectation, "
             f"sampled {visits:g} times and makes {headline:g} probes in the headline {ROUNDS} rounds ({probes}). "
             "Margins are zofed's, on the seeds both rows have.", "",
             "| dataset | alpha | model | rounds | method | seeds | final accuracy (mean ± std) | client mean "
             "| zofed's margin (points) | wall s (mean) |", "|" + "---|" * 10]
    figures = []
    for rounds in sorted({r["rounds"] for r in rows}):
        budget = [r for r in rows if r["rounds"] == rounds]
        groups = _groups(budget)
        for (dataset, alpha, model, method), same in groups.items():
            by = {m: rs for (d, a, mo, m), rs in groups.items() if (d, a, mo) == (dataset, alpha, model)}
            margin = ""
            if method != "zofed" and "zofed" in by:
                seeds, z, other = _paired(by, method)
                margin = f"{100 * (z - other):+.2f} ({len(seeds)} seeds)" if seeds else ""
            acc = np.array([r["final_accuracy"] for r in same])
            lines.append(f"| {dataset} | {alpha} | {model} | {rounds} | {method} | {len(same)} "
                         f"| {acc.mean():.4f} ± {acc.std():.4f} "
                         f"| {np.mean([r['client_accuracy_mean'] for r in same]):.4f} | {margin} "
                         f"| {np.mean([r['wall_seconds'] for r in same]):.0f} |")
        figures += write_figures(budget, f"_r{rounds}")
    return [*lines, "", *[f"![{p.stem}]({p.name})" for p in figures], ""]


def _forward_pass_lines(all_rows: list[dict]) -> str:
    """How forward passes are counted, and how many rows carry a corrected count and why."""
    text = ("Forward passes count the full model's forward-pass equivalents summed over the sampled clients: 2 per "
            "query and local step for ZO, 3 per first-order local step (a forward, and a backward worth two).")
    corrected = [r for r in all_rows if r.get("forward_passes_corrected")]
    if corrected:
        fo = sum(_first_order(r["method"]) for r in corrected)
        text += (f" {len(corrected)} of the JSON's {len(all_rows)} rows ({fo} first-order, {len(corrected) - fo} ZO) "
                 "carry `forward_passes_corrected: true`: they were written before client compute was counted in "
                 "full, when a first-order local step counted 2 like a ZO query, and their count is recomputed "
                 "from each row's own local steps, clients per round and rounds.")
    return text


def _thread_lines(rows: list[dict]) -> str:
    threads: dict[str, int] = {}
    for r in rows:
        key = str(r["torch_threads"]) if "torch_threads" in r else "not recorded"
        threads[key] = threads.get(key, 0) + 1
    return ("Torch threads per row (`torch_threads` in the JSON): "
            + ", ".join(f"{k}: {n} row{'s' if n > 1 else ''}" for k, n in sorted(threads.items()))
            + ". `--jobs` runs rows side by side "
            "on the same cores and the JSON does not record how many rows shared the machine, so wall seconds "
            "compare rows only roughly.")


def write_table(all_rows: list[dict]) -> None:
    rows = [r for r in all_rows if r["rounds"] in (0, ROUNDS)]  # the headline budget; references have 0
    groups = _groups(rows)
    first_order = [m for m in method_names(first_order=True) if any(r["method"] == m for r in rows)]
    zo_passes = 2 * _queries() * ROUNDS * CLIENTS_PER_ROUND * LOCAL_STEPS
    lines = ["# Federated methods on one budget", "",
             f"SmolLM2-135M with a prompt and label words; ZO methods perturb the RMSNorm gains ({GAIN_TENSORS} "
             f"tensors of {HIDDEN}, {GAIN_TENSORS * HIDDEN:,} values), the first-order methods "
             f"({', '.join(first_order)}) back-propagate into LoRA (r 8 on q and v, {LORA_VALUES:,} values). MiniLM-L6 "
             "rows put a new, randomly initialized classification head on the encoder and train it with the "
             "LayerNorm gains, by ZO or back-propagation. "
             f"{NUM_CLIENTS} clients (Dirichlet label skew), {CLIENTS_PER_ROUND} per round, {LOCAL_STEPS} local "
             f"steps of batch {BATCH}, {ROUNDS} rounds. Final accuracy is on the full test split; client accuracy on "
             f"each client's own held-out {TEST_FRACTION:.0%}. {_forward_pass_lines(all_rows)} Wall seconds are, as "
             "this benchmark writes them, the rounds' own seconds summed from the run's metrics (all sittings of a "
             "resumed row), not the evaluations; rows written by earlier versions may hold an older measure that "
             f"also counted the subset evaluations, and the JSON does not mark them. {_thread_lines(all_rows)} "
             "Reproduce: `make bench-federated`; `python benchmarks/federated.py --table-only` rebuilds this page "
             "and the figures from the JSON.", "",
             "| dataset | alpha | model | method | seeds | final accuracy (mean ± std) | client mean "
             "| client worst 10% | bytes up / client / round | bytes down / client / round "
             "| forward passes (per client and round) | peak RSS (MiB) | wall s (mean) |",
             "|" + "---|" * 13]
    for (dataset, alpha, model, method), rs in groups.items():
        acc = np.array([r["final_accuracy"] for r in rs])
        per_client = rs[0].get("forward_passes_per_client_round")
        lines.append(f"| {dataset} | {alpha} | {model} | {method} | {len(rs)} | {acc.mean():.4f} ± {acc.std():.4f} "
                     f"| {np.mean([r['client_accuracy_mean'] for r in rs]):.4f} "
                     f"| {np.mean([r['client_accuracy_worst10'] for r in rs]):.4f} "
                     f"| {rs[0]['bytes_up_per_client_round']:,.0f} | {rs[0]['bytes_down_per_client_round']:,.0f} "
                     f"| {rs[0]['forward_passes']:,.0f}" + (f" ({per_client:,.0f})" if per_client else "")
                     + f" | {max(r['peak_rss_mib'] for r in rs):.0f} "
                     f"| {np.mean([r['wall_seconds'] for r in rs]):.0f} |")
    shared_peak = sum(r.get("peak_rss_scope") != "row" for r in rows)
    if shared_peak:
        lines += ["", f"Peak RSS of the {shared_peak} rows without `peak_rss_scope: row` in the JSON is the benchmark "
                  "process's peak so far: such rows ran one after another in one process, so a row that followed a "
                  "heavier one (back-propagating) shows that one's peak. Every row now runs in its own process."]
    longer_rows = [r for r in all_rows if r["rounds"] not in (0, ROUNDS)]
    lines += ["", *target_lines(rows), *target_lines(rows, 1.0), *budget_lines(rows, bool(longer_rows))]
    figures = write_figures(rows)
    present = [m for m in method_names() if any(r["method"] == m for r in all_rows)]
    lines += ["", "Methods: " + "; ".join(f"`{m}`: {get_method(m).summary}" for m in present) + ".", "",
              "`zofed-size-blocks`: zofed with `federation.sampling.mix=1.0` (one-block steps drawn in "
              "proportion to block size, the same for every client); "
              "`zofed-tilt`: zofed with `federation.sampling.tilt=0.5` (each direction leans towards the server's "
              "first moment, sent with the downlink); "
              "`zofed-blocks4`, `zofed-blocks8`: zofed with `federation.sampling.blocks=4` or `8` (one block is a "
              "run of layers); `zofed-shared`: with `federation.sampling.shared_seeds=true`; "
              "`zofed-cosine`: with `federation.server_optimizer.decay=cosine` and `lr=2e-2` (the server step "
              "falls from twice the default to zero over the run); "
              "`zofed-no-personal`: zofed with `federation.sampling.personalize=false` (dense steps); "
              "`zofed-no-momentum`: with "
              "`federation.server_optimizer.name=sgd`; zofed without either is exactly `zo-seeds`. Zero-shot and "
              f"centralized MeZO ({zo_passes:,} forward passes, as one federated ZO run, on the pooled client data) "
              "are references, not federated.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    longer = longer_budget_lines(longer_rows)
    lines += ["", *longer] if longer else []
    write_atomic_text(RESULTS / "federated.md", "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=REFERENCES + METHODS)
    parser.add_argument("--datasets", nargs="*", default=list(TASKS))
    parser.add_argument("--alphas", type=float, nargs="*", default=[0.1, 1.0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--model", choices=list(MODELS), default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds per run (default {ROUNDS}, the headline budget; others are rows of their own)")
    parser.add_argument("--jobs", type=int, default=1, help="rows run at once, each in its own process")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads per row")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing (no data needed): rewrite docs/results/federated.md and the figures from "
                             "docs/results/federated.json, saving its forward-pass corrections back into it")
    args = parser.parse_args()
    if args.jobs < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--jobs, --threads and --rounds must be at least 1")
    path = RESULTS / "federated.json"
    if args.table_only:  # runs nothing, so it needs no data
        if not path.is_file():
            sys.exit(f"--table-only: no {path.relative_to(ROOT)} to build the table from")
        table = load_table(path)
        write_table(list(table["rows"].values()))
        print(f"rewrote {(RESULTS / 'federated.md').relative_to(ROOT)} and its figures from "
              f"{len(table['rows'])} rows", flush=True)
        return
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding sst2/ and agnews/)")
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    table = load_table(path)
    table["meta"] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                     "settings": [*COMMON, *BUDGET, f"federation.rounds={ROUNDS} unless a row's rounds say otherwise"],
                     "models": MODELS}
    # Rows already present are skipped; zero-shot's test accuracy does not depend on the seed. The references
    # are rows of the headline budget only (their rows record no rounds), so --rounds leaves them out.
    if args.rounds != ROUNDS and set(args.methods) & set(REFERENCES):
        print(f"--rounds {args.rounds}: the references ({', '.join(REFERENCES)}) run at the headline budget only; "
              "left out", flush=True)
    pending = [(method, dataset, alpha, seed, args.model, args.rounds) for dataset in args.datasets
               for alpha in args.alphas for seed in args.seeds for method in args.methods
               if row_key(method, dataset, alpha, seed, args.model, args.rounds) not in table["rows"]
               and not (method in REFERENCES and args.rounds != ROUNDS)
               and not (method == "zero-shot" and seed != args.seeds[0])]
    print(f"{len(pending)} rows to run, {args.jobs} at a time", flush=True)
    record_rows(run_rows(_row_process, pending, row_key, args.jobs, args.threads), table, path,
                lambda: write_table(list(table["rows"].values())), "eval_curve")


if __name__ == "__main__":
    main()
