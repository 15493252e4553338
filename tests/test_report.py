"""`zofed report` on runs without per-client evaluation (no client test examples)."""

import json

from toy_federation import tiny_federated_config
from typer.testing import CliRunner

from zofed.cli import app
from zofed.run.federated import run_federated


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
