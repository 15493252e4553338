"""docs/results/gradient_concentration.md and the figures docs/engine.md quotes from it follow the stored rows."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gradient_concentration  # noqa: E402

REPORT = json.loads((ROOT / "docs" / "results" / "gradient_concentration.json").read_text())


def test_the_report_is_written_from_the_rows():
    assert (ROOT / "docs" / "results" / "gradient_concentration.md").read_text() == \
        gradient_concentration.markdown(REPORT)


def test_engine_md_quotes_the_rows():
    text = " ".join((ROOT / "docs" / "engine.md").read_text().split())
    quoted = re.search(r"the 5 largest channels by this measurement held (\d+)-(\d+)% of the squared gradient in "
                       r"eight of the nine top-4 gain tensors \((\d+)% in layer 27's input norm\), and the 72 "
                       r"coordinates reading each tensor's 8 largest held ([\d.]+)% of the set's", text)
    assert quoted, "docs/engine.md no longer quotes the gradient concentration as this test reads it"
    rows = REPORT["rows"]
    lowest = min(rows, key=lambda r: r["largest5_features"])
    rest = [round(100 * r["largest5_features"]) for r in rows if r is not lowest]
    assert "layers.27.input_layernorm" in lowest["tensor"] and len(rows) == 9
    assert [int(quoted.group(i)) for i in (1, 2, 3)] == [min(rest), max(rest), round(100 * lowest["largest5_features"])]
    covered = sum(r["share_of_set"] * r["largest8_features"] for r in rows)
    assert float(quoted.group(4)) == round(100 * covered, 1)
