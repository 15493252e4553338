"""Benchmark: every federated method on the same data, model, split and forward-pass budget.

The headline matrix: methods x datasets (SST-2, AG News from ../shared/data; AG News gets a seeded
6,000/1,600 train/test split of its 7,600-example file) x Dirichlet alpha (0.1, 1.0) x seeds, on SmolLM2 with
its RMSNorm gains perturbed and a prompt. Every ZO method gets the same rounds x clients per round x local
steps, so the same number of forward passes; first-order baselines take the same number of local steps.
Two references share the table: zero-shot (the untrained model) and centralized MeZO on the clients' pooled
training examples with the same forward-pass budget.
Each finished run appends one row to docs/results/federated.json; rows already there are skipped, so the
matrix can be completed over several sittings, and an interrupted run resumes from its checkpoint.

Run: `make bench-federated` (all rows), or pick rows: `--methods zo-seeds decomfl --datasets sst2
--alphas 0.1 --seeds 0`. Skipped with a message when ../shared/data is absent.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from zofed.data.builtin import shared_data_dir
from zofed.data.partition import client_splits
from zofed.data.tasks import Encoded
from zofed.fl.rounds import peak_rss_mib
from zofed.run.checkpoint import find_checkpoint, write_atomic_text
from zofed.run.config import FederatedConfig, load_config
from zofed.run.federated import per_client_accuracy, run_federated, worst_decile_mean
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
METHODS = ["zofed", "zofed-size-blocks", "zofed-tilt", "zofed-blocks4", "zofed-blocks8", "zofed-shared",
           "zofed-cosine",
           "zofed-no-personal", "zofed-no-momentum", "zo-seeds", "decomfl",
           "fedkseed", "fedmezo", "fedavg", "fedadam"]
REFERENCES = ["zero-shot", "centralized-mezo"]
# The prompt is one line: the label word follows "Sentiment:" after a space.
TASKS = {
    "sst2": ["task.template='Review: {text} Sentiment:'", "task.verbalizer=[' negative', ' positive']"],
    "agnews": ["task.template='Article: {text} Topic:'",
               "task.verbalizer=[' World', ' Sports', ' Business', ' Technology']"],
}
# Sized for a 2-core machine: one SST-2 row takes a few minutes, an AG News row about twice that.
ROUNDS, CLIENTS_PER_ROUND, LOCAL_STEPS, BATCH = 10, 3, 4, 8
BUDGET = [f"federation.clients_per_round={CLIENTS_PER_ROUND}",
          f"federation.local_steps={LOCAL_STEPS}", "federation.partition.num_clients=10",
          "federation.partition.test_fraction=0.1", f"train.batch_size={BATCH}", "data.eval_examples=100",
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
    """The federation.method a benchmark row runs: its ablations are zofed with settings changed."""
    return "zofed" if method.startswith("zofed") else method


def _config(method: str, dataset: str, alpha: float, seed: int, out: Path, model: str,
            rounds: int = ROUNDS) -> FederatedConfig:
    settings = METHOD_SETTINGS.get(method, []) + ([f"federation.method={_base_method(method)}"]
                                                  if method in METHODS else [])
    task = TASKS[dataset] if model == "smollm2-135m" else []
    if method in ("fedavg", "fedadam") and model == "smollm2-135m":
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
            "peak_rss_mib": _peak(out), "eval_curve": _eval_curve(out),
            "wall_seconds": _round_seconds(out), "run_dir": str(out.relative_to(ROOT))}


def _row_process(method: str, dataset: str, alpha: float, seed: int, model: str, rounds: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    return {**run_row(method, dataset, alpha, seed, model, rounds), "peak_rss_scope": "row", "torch_threads": threads}


def run_rows(pending: list[tuple], jobs: int, threads: int) -> Iterator[tuple[str, dict | BaseException]]:
    """Yield (key, row) as rows finish, or (key, the exception) for a row that failed: one bad row must not stop
    the others. Every row runs in a fresh process, so its peak RSS is its own and not the heaviest earlier row's;
    `jobs` rows run at once."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(_row_process, *args, threads): row_key(*args) for args in pending}
        for future in as_completed(futures):
            error = future.exception()
            yield futures[future], error if error is not None else future.result()


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
            "clients": len(splits), "clients_per_round": 0, "local_steps": 0, "forward_passes": 2 * steps,
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


ZO_BASELINES = ["zo-seeds", "decomfl", "fedkseed", "fedmezo"]
BUDGET_NOTE = [
    "## What a larger budget would change", "",
    "Each run here costs 240 forward passes of batch 8 (a few minutes on 2 cores), so ZO methods move the "
    "model little. The main thing a larger budget would give is more progress; centralized MeZO on the pooled "
    "data gives a sense of how much. More rounds would give the per-client block statistics time to "
    "accumulate; in 10 rounds a client is sampled about 3 times and makes about 12 probes over 61 blocks, so "
    "its distribution is mostly "
    "the federation-wide prior (the section \"A longer budget\", where present, has runs with more rounds). "
    "More clients per round would smooth the label pull of each round under "
    "alpha 0.1. The seeds' spread (1-3 points) is as large as the gaps between the ZO methods even at five seeds. "
    "LoRA for the ZO methods (as for FedAvg here) would give them more capacity, at the same uplink. The full "
    "test splits are used at the end whatever the budget, so the final accuracies are comparable across "
    "budgets. MiniLM-L6 starts from a random classification head: at this budget no method, first-order "
    "included, moves it far from chance on SST-2, so its rows show the harness on an encoder rather than rank "
    "the methods; it needs a head trained first or thousands of steps.", ""]


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
            up = by["fedavg"][0]["bytes_up_per_client_round"] / by["zofed"][0]["bytes_up_per_client_round"]
            mem = max(r["peak_rss_mib"] for r in by["zofed"]) / max(r["peak_rss_mib"] for r in by["fedavg"])
            lines += [f"- within 3 points of FedAvg ({fedavg:.4f}, seeds {seeds}): gap {gap:+.2f} points: "
                      f"{'met' if gap <= 3 else 'missed'}",
                      f"- uplink >= 1,000x smaller than FedAvg's: {up:,.0f}x: {'met' if up >= 1000 else 'missed'}",
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
    lines = ["## A longer budget", "",
             "The same runs with more rounds (every other setting as above), to see whether zofed's per-client "
             "block statistics, which ten rounds leave mostly at their prior, pay off once they have probes to fit. "
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


def write_table(all_rows: list[dict]) -> None:
    rows = [r for r in all_rows if r["rounds"] in (0, ROUNDS)]  # the headline budget; references have 0
    groups = _groups(rows)
    lines = ["# Federated methods on one budget", "",
             f"SmolLM2-135M with a prompt and label words; ZO methods perturb the RMSNorm gains (35,136 values), "
             f"FedAvg and FedAdam back-propagate into LoRA (r 8 on q and v, 460,800 values). MiniLM-L6 rows put a "
             f"new, randomly initialized classification head on the encoder and train it with the LayerNorm gains, "
             f"by ZO or (FedAvg, FedAdam) back-propagation. 10 clients "
             f"(Dirichlet label skew), {CLIENTS_PER_ROUND} per round, {LOCAL_STEPS} local "
             f"steps of batch {BATCH}, {ROUNDS} rounds. Final accuracy is on the full test split; client accuracy on "
             "each client's own held-out 10%. Wall seconds sum the rounds' own seconds from the run's metrics (all "
             "sittings of a resumed row), not the evaluations; 8 early rows whose run directories are gone "
             "keep the older measure, which also counted the subset evaluations (about 8% more). Rows with "
             "`torch_threads: 1` in the JSON ran two at a time, one thread each (`--jobs 2 --threads 1`): each takes "
             "about 1.6 times as long as one row alone on both cores, so a pair finishes about 1.25 times sooner "
             "than two rows in turn. The seed-0 rows "
             "shared the machine with other work, so their wall times are longer still. "
             "Reproduce: `make bench-federated`.", "",
             "| dataset | alpha | model | method | seeds | final accuracy (mean ± std) | client mean "
             "| client worst 10% | bytes up / client / round | bytes down / client / round | forward passes "
             "| peak RSS (MiB) | wall s (mean) |",
             "|" + "---|" * 13]
    for (dataset, alpha, model, method), rs in groups.items():
        acc = np.array([r["final_accuracy"] for r in rs])
        lines.append(f"| {dataset} | {alpha} | {model} | {method} | {len(rs)} | {acc.mean():.4f} ± {acc.std():.4f} "
                     f"| {np.mean([r['client_accuracy_mean'] for r in rs]):.4f} "
                     f"| {np.mean([r['client_accuracy_worst10'] for r in rs]):.4f} "
                     f"| {rs[0]['bytes_up_per_client_round']:,.0f} | {rs[0]['bytes_down_per_client_round']:,.0f} "
                     f"| {rs[0]['forward_passes']:,} | {max(r['peak_rss_mib'] for r in rs):.0f} "
                     f"| {np.mean([r['wall_seconds'] for r in rs]):.0f} |")
    if any(r.get("peak_rss_scope") != "row" for r in rows):
        lines += ["", "Peak RSS of rows without `peak_rss_scope: row` in the JSON is the benchmark process's peak "
                  "so far: they ran one after another in one process, so a row that followed a heavier one (FedAvg "
                  "back-propagating) shows that one's peak. Newer rows run in their own process."]
    lines += ["", *target_lines(rows), *target_lines(rows, 1.0), *BUDGET_NOTE]
    figures = write_figures(rows)
    lines += ["", "`zofed-size-blocks`: zofed with `federation.sampling.mix=1.0` (one-block steps drawn in "
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
              "centralized MeZO (same forward passes as one federated ZO run, on the pooled client data) are "
              "references, not federated.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    longer = longer_budget_lines([r for r in all_rows if r["rounds"] not in (0, ROUNDS)])
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
    args = parser.parse_args()
    if args.jobs < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--jobs, --threads and --rounds must be at least 1")
    if shared_data_dir() is None:
        print("skipped: ../shared/data not found (set ZOFED_SHARED_DATA to a folder holding sst2/ and agnews/)")
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "federated.json"
    table = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "rows": {}}
    for row in table["rows"].values():  # rows written before curves were recorded
        if "eval_curve" not in row and row["rounds"] and (ROOT / row["run_dir"] / "metrics.jsonl").is_file():
            row["eval_curve"] = _eval_curve(ROOT / row["run_dir"])
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
    failed = []
    for key, row in run_rows(pending, args.jobs, args.threads):
        if isinstance(row, BaseException):
            failed.append(key)
            print(f"row {key} failed, the others go on: {type(row).__name__}: {row}", file=sys.stderr, flush=True)
            continue
        table["rows"][key] = row
        write_atomic_text(path, json.dumps(table, indent=2))
        write_table(list(table["rows"].values()))
        print(json.dumps({k: v for k, v in row.items() if k != "eval_curve"}), flush=True)
    if failed:
        sys.exit(f"{len(failed)} of {len(pending)} rows failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
