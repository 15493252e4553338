"""The instruction-tuning benchmark's report (docs/results/instruction.md and its figures), written from the rows
alone: the tuning grid with each chosen point and how far it moved the loss, the finals with their spread, and the
issue's two targets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from curve_plot import draw_seed_band, label_and_save  # benchmarks/ is the script's own directory
from instruction_protocol import (
    BATCH,
    CURVE_EXAMPLES,
    FINAL_SEEDS,
    GRIDS,
    LEVERS,
    LOCAL_STEPS,
    MAX_LENGTH,
    PER_ROUND,
    ROWS,
    TEST_SIZE,
    TOP_BLOCKS,
    TOP_QUERIES,
    TUNE,
    VALIDATION,
    ZERO_SHOT,
    Point,
    chosen_points,
    final_rows,
    pass_fraction,
    per_client_round_cost,
    point_of,
    tune_runs,
    winning_levers,
)

from zofed.atomic_files import write_atomic_text
from zofed.fl.methods import get_method


def points(values) -> np.ndarray:
    return np.asarray(values, dtype=float) * 100


def mean_std(values) -> tuple[float, float]:
    v = points(values)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def settings(rows: list[dict]) -> dict[tuple, dict]:
    """The rows one table compares, by (budget, test examples, final tokens, curve tokens): each row's finals at
    the point its tuning chose at that budget (in seed order), and the zero-shot row scored the same way."""
    groups: dict[tuple, dict] = {}
    chosen = {budget: chosen_points(rows, budget) for budget in {r["budget"] for r in rows if r.get("phase") == TUNE}}
    for r in sorted(rows, key=lambda r: r.get("seed", 0)):
        if (r.get("phase") != TUNE and r["row"] != ZERO_SHOT
                and point_of(r) == chosen.get(r["budget"], {}).get(r["row"])):
            key = (r["budget"], r["test_examples"], r["max_new_tokens"], r["curve_tokens"])
            groups.setdefault(key, {}).setdefault(r["row"], []).append(r)
    for (_, test, tokens, _), group in groups.items():
        group[ZERO_SHOT] = [r for r in rows if r["row"] == ZERO_SHOT and (r["test_examples"], r["max_new_tokens"])
                            == (test, tokens)]
    return {k: {name: g[name] for name in ROWS if g.get(name)} for k, g in sorted(groups.items())}


def target_lines(by_row: dict[str, list[dict]], expected: Sequence[str] = ()) -> list[str]:
    """The issue's two targets, checked from the rows (means over seeds, ROUGE-L points) for zofed as it ships;
    `expected` names the rows the finals run (`final_rows`), so that a row with no final yet keeps the verdict
    provisional."""
    zofed = "zofed"
    means = {name: mean_std([r["test_rougeL"] for r in rs])[0] for name, rs in by_row.items()}
    federated = [n for n in by_row if n != ZERO_SHOT]
    short = [f"{n} {len(by_row.get(n, []))}" for n in dict.fromkeys([*federated, *expected])
             if ROWS[n] is not None and len(by_row.get(n, [])) < len(FINAL_SEEDS)]
    provisional = f" (provisional, seeds run so far: {', '.join(short)} of {len(FINAL_SEEDS)})" if short else ""
    lines = [f"Targets{provisional}:", ""]
    if ZERO_SHOT in means and federated:
        below = [n for n in federated if means[n] < means[ZERO_SHOT]]
        verdict = "met" if not below else f"missed by {', '.join(below)}"
        lines.append(f"- Every federated row at or above zero-shot ({means[ZERO_SHOT]:.2f}): {verdict}. "
                     + "; ".join(f"{n} {means[n] - means[ZERO_SHOT]:+.2f}" for n in federated) + ".")
    else:
        lines.append("- Every federated row at or above zero-shot: not checked yet (needs the zero-shot row and a "
                     "federated one).")
    if zofed in means and "fedkseed" in means:
        gap = means[zofed] - means["fedkseed"]
        verdict = f"met, {gap - 1:.2f} points above the bar" if gap >= 1 else f"missed by {1 - gap:.2f} points"
        line = (f"- zofed at least FedKSeed + 1 point at equal client compute: {zofed} {means[zofed]:.2f}, FedKSeed "
                f"{means['fedkseed']:.2f}, difference {gap:+.2f}: {verdict}")
        mine = {r["seed"]: r["test_rougeL"] for r in by_row[zofed]}
        theirs = {r["seed"]: r["test_rougeL"] for r in by_row["fedkseed"]}
        seeds = sorted(mine.keys() & theirs.keys())
        if len(seeds) >= 2:
            diff = points([mine[s] - theirs[s] for s in seeds])
            line += (f"; paired over seeds {seeds}: {diff.mean():+.2f} (standard error "
                     f"{diff.std(ddof=1) / np.sqrt(len(diff)):.2f})")
        passes = {by_row[n][0]["forward_passes"] for n in (zofed, "fedkseed")}
        lines.append(line + (f"; both spent {passes.pop():,.0f} forward passes." if len(passes) == 1 else
                             "; the two spent different compute (see the table)."))
    else:
        lines.append("- zofed at least FedKSeed + 1 point: not checked yet (needs the rows of zofed and of "
                     "FedKSeed).")
    return lines


def finals_scope_lines(rows: list[dict], budget: float) -> list[str]:
    """Which row the targets judge, the levers the finals leave to their tuning runs, and any lever that beat
    zofed on validation (which would become its default in its own commit before the table is rerun)."""
    left = [row for row in LEVERS if row in chosen_points(rows, budget)]
    if not left:
        return []
    one = len(left) == 1
    lines = [f"The targets judge zofed as `zofed run` ships it; {', '.join(left)} "
             f"{'is a lever' if one else 'are levers'} priced by {'its' if one else 'their'} tuning runs alone "
             f"({'its' if one else 'their'} finals run when `--rows` names {'it' if one else 'them'})."]
    won = winning_levers(rows, budget)
    if won:
        lines[0] += " On validation " + "; ".join(f"{row} beat zofed ({ours:.4f} against {theirs:.4f})"
                                                  for row, (ours, theirs) in won.items()) + \
            ": a lever that wins becomes zofed's default in its own commit, and the table is rerun."
    return [*lines, ""]


def rising_lines(by_row: dict[str, list[dict]]) -> list[str]:
    """The runs whose curve-subset loss ended above its round-0 value: a step that walked away from the start,
    which a mean over seeds hides."""
    rising = [f"{name} seed {r['seed']} ({r['curve'][0][4]:.3f} → {r['curve'][-1][4]:.3f}, its lowest "
              f"{min(c[4] for c in r['curve']):.3f}; test ROUGE-L {100 * r['test_rougeL']:.2f})"
              for name, rs in by_row.items() if name != ZERO_SHOT
              for r in rs if r["curve"][-1][4] > r["curve"][0][4]]
    if not rising:
        return ["No run's curve-subset loss ended above its round-0 value."]
    return [f"Runs whose curve-subset loss ended above its round-0 value: {'; '.join(rising)}."]


def plot_curves(by_row: dict[str, list[dict]], title: str, path: Path) -> None:
    """Subset ROUGE-L against client compute, cumulative uplink bytes per client and rounds: per row the mean over
    its seeds, the seeds' range as a band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    for name, rs in by_row.items():
        if name == ZERO_SHOT:
            continue
        curves = np.array([r["curve"] for r in rs if len(r["curve"]) == len(rs[0]["curve"])], dtype=float)
        draw_seed_band(axes, name, curves, curves[:, :, 3] * 100)
    axes[1].set_xscale("symlog", linthresh=10)  # seeds and scalars (tens of bytes) against dense LoRA updates (MB)
    label_and_save(fig, axes, "ROUGE-L (test subset, points)", title, path, ", symlog")


def _point_label(point: Point) -> str:
    lr, factor = point
    return f"lr {lr:g}" + ("" if factor == 1.0 else f", server x{factor:g}")


def tuning_lines(rows: list[dict]) -> list[str]:
    """Per budget, each row's validation loss at every point of its grid, the chosen one in bold."""
    lines = []
    width = max(len(g) for g in GRIDS.values())
    for budget in sorted({r["budget"] for r in rows if r.get("phase") == TUNE}):
        grid, chosen = tune_runs(rows, budget), chosen_points(rows, budget)
        lines += [f"Tuning at budget {budget:,.0f}: the response loss on {VALIDATION} validation records held out of "
                  "the training data at the end of the run (seed 0; the lowest is chosen, in bold). The ZO rows' lr "
                  "is `optimizer.lr` (MeZO steps), FedAvg's `federation.first_order_lr` (AdamW); server xF multiplies "
                  "the method's default server lr.", "",
                  "| row | " + " | ".join(f"point {i + 1}" for i in range(width)) + " |", "|" + "---|" * (width + 1)]
        for name in ROWS:
            if name not in GRIDS or name not in grid:
                continue
            cells = []
            for point in GRIDS[name]:
                runs = grid[name].get(point)
                value = "not run" if not runs else f"{np.mean([r['validation_loss'] for r in runs]):.4f}"
                cells.append(f"**{_point_label(point)}: {value}**" if point == chosen[name]
                             else f"{_point_label(point)}: {value}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        untuned = [name for name in GRIDS if name not in grid]
        if untuned:
            lines += ["", f"Not tuned yet: {', '.join(untuned)}."]
        lines += ["", *descent_lines(grid, chosen, budget), ""]
    return lines or ["No row has been tuned yet (`--phase tune`): finals are shown only at a tuned point.", ""]


def descent_lines(grid: dict[str, dict[Point, list[dict]]], chosen: dict[str, Point], budget: float) -> list[str]:
    """How far each row's chosen point moved the validation loss (the tune run's evaluation subset, its first point
    against its last), the ZO rows' best against FedAvg's, and the ZO grid points above the chosen one that ended
    above their start (a step too long): what a larger budget, or a finer grid, would have to change."""
    def drop(run: dict) -> float:
        return run["curve"][-1][2] - run["curve"][0][2]

    moved = {name: float(np.mean([drop(r) for r in grid[name][point]])) for name, point in chosen.items()
             if all(len(r.get("curve", [])) >= 2 for r in grid[name][point])}
    if not moved:
        return []
    lines = ["How far each chosen point moved the validation loss (its evaluation subset, start → end of the run): "
             + "; ".join(f"{name} {value:+.4f}" for name, value in moved.items()) + "."]
    zo = {name: value for name, value in moved.items() if not get_method(ROWS[name]).first_order}
    if zo and "fedavg-lora" in moved and min(zo.values()) < 0 < -moved["fedavg-lora"]:
        best = min(zo, key=zo.get)
        ratio = moved["fedavg-lora"] / zo[best]
        lines[0] += (f" The ZO rows' largest drop ({best}) is {ratio:.0f} times smaller than FedAvg-LoRA's at the "
                     f"same compute: at that rate a ZO row would need about {ratio * budget:,.0f} passes to move the "
                     "loss as far as FedAvg-LoRA did in "
                     f"{budget:,.0f} (a linear extrapolation, not a measurement).")
    overshoot = []
    for name, point in chosen.items():
        if name not in zo:
            continue
        above = [p for p in GRIDS[name] if p[0] * p[1] > point[0] * point[1] and p in grid[name]]
        starts = {p: float(np.mean([r["curve"][0][2] for r in grid[name][p]])) for p in above}
        ends = {p: float(np.mean([r["curve"][-1][2] for r in grid[name][p]])) for p in above}
        overshoot += [f"{name} at {_point_label(p)} ({starts[p]:.3f} → {ends[p]:.2f})" for p in above
                      if ends[p] > starts[p]]
    if overshoot:
        lines[0] += (" Grid points above the chosen one that ended above their start, a step too long: "
                     + ", ".join(overshoot) + ".")
    return lines


def write_report(table: dict, out: Path) -> None:
    rows = list(table["rows"].values())
    lines = ["# Instruction tuning at equal client compute: SmolLM2-135M-Instruct on federated Dolly/Alpaca", "",
             "Protocol: `data.source=shared:dolly`, one client per training file (9 clients, natural partition by "
             f"`client`, all records used for training), {PER_ROUND} clients a round, {LOCAL_STEPS} local steps of "
             f"batch {BATCH}, `task.max_length` {MAX_LENGTH}, SmolLM2's chat template. Every row trains LoRA r 8 on "
             "q_proj and v_proj of every block (the ZO rows too: one trainable set for all), but zofed-top2-cached: "
             f"zofed with the same adapters on the top {TOP_BLOCKS} blocks only, the frozen bottom run once a step "
             f"(`zo.cache: prefix`) and {TOP_QUERIES} one-sided queries a step over the top blocks and the vocabulary "
             f"projection ({pass_fraction('zofed-top2-cached'):.3f} of a full pass each) "
             f"({PER_ROUND * per_client_round_cost('zofed-top2-cached'):.1f} passes a round). zofed-start is zofed "
             "with each tensor's relative server step measured against its RMS at the start of the run instead of "
             "its RMS now (`federation.server_optimizer.relative_to=start`). The same client "
             "compute for every "
             "row: a budget in forward-pass equivalents of the full model summed over the federation (a backward "
             "counts as two forwards), so a ZO round costs "
             f"{PER_ROUND * per_client_round_cost('zofed'):g} passes and a FedAvg round "
             f"{PER_ROUND * per_client_round_cost('fedavg-lora'):g}, and each row runs budget // its round cost "
             "rounds (a row charged each step from the tensors it drew, until another round could pass the budget; "
             "zofed-top2-cached's round costs at most the figure above). ROUGE-L F1 (rouge-score, stemmed) of "
             "greedy answers, in points; the final test on the "
             f"{TEST_SIZE}-example global test set, the curves on a fixed {CURVE_EXAMPLES}-example subset of it "
             "(drawn per seed) with shorter answers (the curve tokens below). zero-shot is the starting model (LoRA's "
             "B is zero) on the whole test set, evaluated once: no seed changes it; each run's round-0 point is its "
             "value on the seed's subset. Standard deviations over seeds use n - 1. Server optimizers are each "
             "method's default. Reproduce: `.venv/bin/python benchmarks/instruction.py --phase tune --jobs 2 "
             "--threads 1`, then the same without `--phase`.", "",
             *[f"Zero-shot, the starting model: ROUGE-L {100 * r['test_rougeL']:.2f}, test loss "
               f"{r['test_loss']:.3f} on {r['test_examples']} examples, answers up to {r['max_new_tokens']} tokens, "
               f"scored in {r['final_eval_seconds']:.0f} s." for r in rows if r["row"] == ZERO_SHOT], "",
             *tuning_lines(rows)]
    groups = settings(rows)
    finals = [r for r in rows if r.get("phase") != TUNE]
    shown = sum(len(rs) for g in groups.values() for rs in g.values())
    if shown < len(finals):
        hidden = len(finals) - shown
        lines += [f"{hidden} final {'row' if hidden == 1 else 'rows'} of the table (at an lr the tuning did not "
                  f"choose, or with no federated row scored the same way) {'is' if hidden == 1 else 'are'} not "
                  "shown.", ""]
    for (budget, test, tokens, curve_tokens), by_row in groups.items():
        expected = final_rows()
        lines += [f"## Budget {budget:,.0f} forward passes; test {test} examples, answers up to {tokens} tokens "
                  f"(curves: {curve_tokens})", "",
                  "| row | seeds | test ROUGE-L (mean ± std) | by seed | test loss | subset ROUGE-L round 0 → end "
                  "| subset loss round 0 → end | rounds | forward passes | uplink bytes / client / round "
                  "| s / round (train) |",
                  "|" + "---|" * 11]
        for name, rs in by_row.items():
            score, spread = mean_std([r["test_rougeL"] for r in rs])
            loss = np.mean([r["test_loss"] for r in rs])
            if name == ZERO_SHOT:
                lines.append(f"| {name} | - | {score:.2f} | - | {loss:.3f} | - | - | 0 | 0 | 0 | - |")
                continue
            start, end = (float(np.mean(points([r["curve"][i][3] for r in rs]))) for i in (0, -1))
            loss_start, loss_end = (float(np.mean([r["curve"][i][4] for r in rs])) for i in (0, -1))
            spread_text = f" ± {spread:.2f}" if len(rs) > 1 else " (one seed, no spread yet)"
            by_seed = ", ".join(f"{100 * r['test_rougeL']:.2f}" for r in rs)  # settings keeps seed order
            lines.append(f"| {name} | {len(rs)} | {score:.2f}{spread_text} | {by_seed} | {loss:.3f} "
                         f"| {start:.2f} → {end:.2f} "
                         f"| {loss_start:.3f} → {loss_end:.3f} "
                         f"| {rs[0]['rounds']} | {rs[0]['forward_passes']:,.0f} "
                         f"| {rs[0]['bytes_up_per_client_round']:,.0f} "
                         f"| {np.mean([r['seconds_per_round'] for r in rs]):.0f} |")
        name = f"instruction_b{budget:g}" + ("" if (test, tokens, curve_tokens) == (TEST_SIZE, 128, 64)
                                             else f"_t{test}_n{tokens}_c{curve_tokens}") + ".png"
        plot_curves(by_row, f"Dolly/Alpaca, 9 clients, budget {budget:,.0f} passes (test subset of "
                    f"{min(CURVE_EXAMPLES, test)}, answers up to {curve_tokens} tokens)", out / name)
        runs = [r for name, rs in by_row.items() if name != ZERO_SHOT for r in rs]
        curve_seconds = [r["curve_eval_seconds"] for r in runs if r["curve_eval_seconds"] is not None]
        lines += ["", f"Seconds, means over the runs ({table['meta'].get('machine', '?')}, torch threads "
                  f"{sorted({r['torch_threads'] for r in runs})}): setup with the round-0 evaluation "
                  f"{np.mean([r['setup_seconds'] for r in runs]):.0f}, a curve evaluation "
                  f"{np.mean(curve_seconds) if curve_seconds else float('nan'):.0f}, the final test "
                  f"{np.mean([r['final_eval_seconds'] for r in runs]):.0f}.", "", *rising_lines(by_row), "",
                  *finals_scope_lines(rows, budget), *target_lines(by_row, expected),
                  "", f"![ROUGE-L curves]({name})", ""]
    write_atomic_text(out / "instruction.md", "\n".join(lines) + "\n")

