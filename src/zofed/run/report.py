"""`zofed report`: compare federated runs as plots (PNG) and a markdown summary.

Three figures of the runs' headline metric (accuracy for classification, ROUGE-L for a causal LM that generates,
else its loss; the runs compared must share it): the metric on the fixed test subset against rounds, the same
against cumulative uplink bytes per client (log scale: seed-and-scalar methods and dense-upload methods differ by
orders of magnitude), and the spread of the final global model's metric over the clients' own held-out data. A
run whose clients hold no test examples (`federation.partition.test_fraction=0`) has no per-client values: it is
left out of the spread (the panel too, when no run has one) and its table cells say "n/a".
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from zofed.atomic_files import write_atomic_text
from zofed.run.config import ConfigError
from zofed.run.metrics import CLIENT_LISTS, MetricsLog

METRIC_NAMES = {"accuracy": "accuracy", "rougeL": "ROUGE-L", "loss": "loss"}  # each headline metric in a label


@dataclass
class RunSummary:
    name: str
    method: str
    metric: str  # the run's headline metric (results.json's client_metric)
    rounds: list[int]
    values: list[float]  # the metric on the test subset at the rounds that were evaluated
    cumulative_up: list[float]  # uplink bytes per client, summed up to each evaluated round
    results: dict

    @property
    def clients(self) -> list[float]:
        """The final model's metric on each client's own held-out examples (empty: none held out)."""
        return self.results.get(CLIENT_LISTS[self.metric]) or []


def load_run_summary(run_dir: Path) -> RunSummary:
    run_dir = Path(run_dir)
    needed = [run_dir / "metrics.jsonl", run_dir / "results.json", run_dir / "config.yaml"]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(f"{run_dir} is not a finished zofed run directory (missing {', '.join(missing)})")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if "federation" not in config:
        raise ConfigError(f"{run_dir} is a centralized run; zofed report compares federated runs")
    logged = MetricsLog(run_dir / "metrics.jsonl").read()
    records = [r for r in logged if r.get("event") == "round"]
    results = json.loads((run_dir / "results.json").read_text())
    metric = results.get("client_metric", "accuracy")  # runs from before it was recorded were classifications
    key = f"eval_{metric}"
    up = np.cumsum([r["bytes_up_per_client"] for r in records])
    # Round 0 is the starting model (runs from before it was recorded have none).
    evaluated = [(0, r[key], 0.0) for r in logged if r.get("event") == "eval" and r.get("round") == 0 and key in r]
    evaluated += [(r["round"], r[key], up[i]) for i, r in enumerate(records) if key in r]
    return RunSummary(run_dir.name, config["federation"]["method"], metric, [e[0] for e in evaluated],
                      [e[1] for e in evaluated], [float(e[2]) for e in evaluated], results)


def bytes_text(value: float) -> str:
    """A byte count as a tick label: 120 B, 2 kB, 1.5 MB (decimal units)."""
    for unit, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= unit:
            return f"{value / unit:.3g} {name}"
    return f"{value:.3g} B"


def _label_bytes(axis: Any) -> None:
    """Byte labels on a log axis: the powers of ten, and when the view holds fewer than two (a short run's bytes
    span less than a decade or two) the ticks between them too, 2x and 5x, or all of them on a view under 0.7 decades.
    Unlabelled minor ticks would leave such an axis with no label at all."""
    from matplotlib import rcParams
    from matplotlib.ticker import Formatter

    class BytesFormatter(Formatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            lo, hi = sorted(self.axis.get_view_interval())
            if x <= 0 or lo <= 0:
                return ""
            exponent = math.floor(math.log10(x) + 1e-9)
            coeff = round(x / 10.0 ** exponent)
            powers = math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) + 1  # powers of ten in view
            if coeff == 1 or (powers < 2 and (coeff in (2, 5) or math.log10(hi / lo) < 0.7)):
                return bytes_text(x)
            return ""

    axis.set_major_formatter(BytesFormatter())
    axis.set_minor_formatter(BytesFormatter())
    # minor ticks are shorter: pad their labels down to the major ones' line
    sizes = {which: rcParams[f"xtick.{which}.size"] + rcParams[f"xtick.{which}.pad"] for which in ("major", "minor")}
    axis.set_tick_params(which="minor", pad=rcParams["xtick.minor.pad"] + sizes["major"] - sizes["minor"])


def figure(runs: list[RunSummary]) -> Any:
    """The report's matplotlib Figure: the metric against rounds, against bytes sent, and its client spread."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    name = METRIC_NAMES[runs[0].metric]
    evaluated = [run for run in runs if run.clients]
    fig = Figure(figsize=(15 if evaluated else 10, 4.2))
    by_round, by_bytes, *spread_axes = fig.subplots(1, 3 if evaluated else 2)
    for run in runs:
        label = f"{run.name} ({run.method})"
        by_round.plot(run.rounds, run.values, marker="o", ms=3, label=label)
        sent = [(b, a) for b, a in zip(run.cumulative_up, run.values, strict=True) if b > 0]  # a log axis
        by_bytes.plot([b for b, _ in sent], [a for _, a in sent], marker="o", ms=3, label=label)
    by_round.set(xlabel="round (0: the starting model)", ylabel=f"test {name} (fixed subset)",
                 title=f"{name} against rounds")
    by_bytes.set(xscale="log", xlabel="cumulative uplink bytes per client", title=f"{name} against bytes sent")
    _label_bytes(by_bytes.xaxis)
    by_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    if evaluated:
        (spread,) = spread_axes
        spread.boxplot([run.clients for run in evaluated], tick_labels=[run.name for run in evaluated])
        spread.set(ylabel=f"{name} on each client's own test split", title=f"per-client {name} (final model)")
        spread.tick_params(axis="x", labelrotation=20)
        skipped = [run.name for run in runs if run not in evaluated]
        if skipped:  # say why a run is missing from this panel
            spread.set_xlabel(f"n/a (no client test examples): {', '.join(skipped)}", fontsize="small")
    by_round.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _or_na(value: float | None) -> str:
    """A per-client figure, or "n/a" for a run whose clients held no test examples (results.json has null)."""
    return "n/a" if value is None else f"{value:.4f}"


def _markdown(runs: list[RunSummary]) -> str:
    metric = runs[0].metric
    lines = [f"| run | method | rounds | test {METRIC_NAMES[metric]} | client mean | client worst 10% "
             "| bytes up / client / round | bytes down / client / round | forward passes | rejected uplinks |",
             "|" + "---|" * 10]
    for run in runs:
        r = run.results
        lines.append(f"| {run.name} | {run.method} | {r['rounds']} | {r['test'][metric]:.4f} "
                     f"| {_or_na(r.get(f'client_{metric}_mean'))} | {_or_na(r.get(f'client_{metric}_worst10'))} "
                     f"| {r['bytes_up_per_client_round']:,.0f} | {r['bytes_down_per_client_round']:,.0f} "
                     f"| {r['forward_passes']:,.1f} | {r['rejected_uplinks']} |")
    return "\n".join(lines) + "\n"


def write_report(run_dirs: list[Path], out_dir: Path) -> tuple[Path, Path]:
    """Write report.png and report.md for `run_dirs` into `out_dir`; returns both paths."""
    runs = [load_run_summary(Path(d)) for d in run_dirs]
    metrics = {run.metric for run in runs}
    if len(metrics) > 1:
        raise ConfigError("zofed report compares runs on one headline metric; these report "
                          + ", ".join(f"{run.name}: {run.metric}" for run in runs))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, md = out_dir / "report.png", out_dir / "report.md"
    image = io.BytesIO()
    figure(runs).savefig(image, format="png", dpi=110)
    write_atomic_text(png, image.getvalue())
    name = METRIC_NAMES[runs[0].metric]
    write_atomic_text(md, f"# zofed report\n\n![{name}, bytes, client spread]({png.name})\n\n{_markdown(runs)}")
    return png, md
