"""`zofed report`: runs without per-client evaluation (no client test examples), the bytes axis's labels."""

import json

import pytest
from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.federated import run_federated
from zofed.run.report import RunSummary, bytes_text, figure


def test_report_of_a_run_without_client_test_examples(tiny_workspace, tmp_path):
    """test_fraction=0 leaves the clients no test split: results.json has no per-client accuracy, and the
    report says n/a for it instead of failing; a run that has one still gets its numbers."""
    bare, full = tmp_path / "no-client-test", tmp_path / "with-client-test"
    run_federated(tiny_federated_config(tiny_workspace, bare, "federation.partition.test_fraction=0",
                                        "federation.rounds=1"), show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, full, "federation.rounds=1"), show_progress=False)
    results = json.loads((bare / "results.json").read_text())
    assert results["client_accuracies"] == [] and results["client_accuracy_mean"] is None
    result = CliRunner().invoke(app, ["report", str(bare), str(full), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "![accuracy, bytes, client spread](report.png)" in result.output  # printed as written, not as markup
    assert (tmp_path / "report" / "report.png").read_bytes()[:4] == b"\x89PNG"
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in (tmp_path / "report" / "report.md").read_text().splitlines() if line.startswith("| ")}
    header = rows["run"]
    mean, worst = header.index("client mean"), header.index("client worst 10%")
    assert rows[bare.name][mean] == rows[bare.name][worst] == "n/a"
    assert rows[full.name][mean] == f"{json.loads((full / 'results.json').read_text())['client_accuracy_mean']:.4f}"


def _visible_labels(axes):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(axes.figure).draw()  # tick labels are set when the figure is drawn
    lo, hi = axes.get_xlim()
    ticks = axes.get_xticklabels(which="both")
    return [t.get_text() for t in ticks if t.get_text() and lo <= t.get_position()[0] <= hi]


@pytest.mark.parametrize("sent", [[120.0, 240.0, 360.0], [900e3, 1e6, 1.1e6], [300.0, 900.0, 2.5e3],
                                  [120.0, 5e5, 3e9]])
def test_the_bytes_axis_is_labelled_whatever_the_span(sent):
    """A short run's cumulative bytes span less than a decade: no power of ten falls in the view, and the bytes
    panel must still label its axis (it used to show none), in bytes; a wide span labels the powers of ten."""
    run = RunSummary("r", "zofed", "accuracy", [0, 1, 2, 3], [0.5, 0.6, 0.7, 0.8], [0.0, *sent], {})
    by_bytes = figure([run]).axes[1]
    assert by_bytes.get_title() == "accuracy against bytes sent"
    labels = _visible_labels(by_bytes)
    assert len(labels) >= 2 and all(label.endswith("B") for label in labels), labels
    assert len(labels) == len(set(labels)) <= 10


def test_bytes_text():
    assert [bytes_text(v) for v in (120, 1e3, 2.5e4, 1.5e6, 3e9)] == ["120 B", "1 kB", "25 kB", "1.5 MB", "3 GB"]
