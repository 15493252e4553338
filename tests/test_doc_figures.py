"""The docs state no benchmark figure that the rows do not hold.

README.md's Benchmarks section and docs/method.md may quote a figure only if it is computed from
docs/results/ranking.json: a row's mean final accuracy on a dataset (3 or 4 places, or as a percentage), its
standard deviation, or a paired difference between two rows over their common seeds, in points (1 or 2 places).
The README's ranking summary between the markers is generated, and must be exactly what
benchmarks/ranking_report.py's `benchmarks_section` writes from the same JSON.

A number that is not a benchmark figure passes only through ALLOWED, each with its reason, and each recomputed here
from the code where it is a computed constant. The docs' one claim about the head recipe that is a fact of the code
(zofed's components are inactive there) is run here too.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from toy_federation import tiny_federated_config
from transformers import LlamaConfig, LlamaForCausalLM

from zofed.run.federated import run_federated
from zofed.zo.prefix import PrefixCache

ROOT = Path(__file__).resolve().parents[1]
RANKING = ROOT / "docs" / "results" / "ranking.json"
README = ROOT / "README.md"
METHOD = ROOT / "docs" / "method.md"
FEDERATED = ROOT / "docs" / "federated.md"
BEGIN, END = "<!-- ranking:begin -->", "<!-- ranking:end -->"

# accuracy-like figures (0.847, 0.8408), point margins (10.9 points, +1.86, -0.09), percentages (84.7%)
FIGURE = re.compile(
    r"(?<![\w.])0\.\d{3,4}(?![\d])"
    r"|(?<![\w.])[+\-−]?\d+(?:\.\d+)?(?=\s*(?:percentage\s+)?points?\b)"
    r"|(?<![\w.])[+\-−]\d+\.\d+(?![\d])"
    r"|(?<![\w.\-])\d+(?:\.\d+)?(?=\s*%)")  # not a name such as worst-10%

# SmolLM2-135M's shape (its config.json): what the cost figures below are computed on
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def _smollm2_share(start: int) -> float:
    """The share of a full pass that a cached pass from SmolLM2's block `start` up, vocabulary projection included,
    runs (the cost rule's `PrefixCache.fraction`; built on the meta device, so no weights are made)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    return PrefixCache(model, start, output_layer=True).fraction


# figure -> (why it is not a benchmark figure, what it must equal, recomputed from the code)
ALLOWED: dict[str, tuple[str, float]] = {
    "0.263": ("a cost-rule share: a cached pass over SmolLM2's top 2 blocks and its vocabulary projection",
              round(_smollm2_share(28), 3)),
    "21": ("the vocabulary projection's share of the weights of SmolLM2's full pass, in percent",
           round(100 * _smollm2_share(30))),
}


def load_rows(path: Path) -> list[dict]:
    """The JSON's rows (a dict keyed by row id, or a list), those with a final accuracy."""
    table = json.loads(path.read_text())
    rows = table["rows"]
    rows = list(rows.values()) if isinstance(rows, dict) else list(rows)
    return [r for r in rows if "final_accuracy" in r]


def held_figures(rows: list[dict]) -> set[str]:
    """Every figure the rows hold, as the docs would write it."""
    groups: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        key = (r.get("phase"), r.get("table", r.get("trainable")), r.get("dataset"), r.get("alpha"), r.get("budget"),
               r.get("lr") if r.get("phase") == "tune" else None)
        groups.setdefault(key, {}).setdefault(r["row"], {})[r.get("seed", 0)] = float(r["final_accuracy"])
    held: set[str] = set()
    for by_row in groups.values():
        for seeds in by_row.values():
            acc = np.array(list(seeds.values()))
            values = [acc.mean()] + ([acc.std(ddof=1)] if len(acc) > 1 else [])
            for v in values:
                held |= {f"{v:.3f}", f"{v:.4f}", f"{100 * v:.1f}", f"{100 * v:.2f}"}
        for sa, sb in itertools.permutations(by_row.values(), 2):
            common = sorted(set(sa) & set(sb))
            if not common:
                continue
            diff = 100 * np.array([sa[s] - sb[s] for s in common])
            values = [diff.mean()] + ([diff.std(ddof=1) / np.sqrt(len(diff))] if len(diff) > 1 else [])
            for v in values:
                held |= {f"{v:.1f}", f"{v:.2f}", f"{abs(v):.1f}", f"{abs(v):.2f}", f"{v:+.1f}", f"{v:+.2f}"}
    return held


def benchmarks_section_of(readme: str) -> str:
    """README's Benchmarks section, up to the next section."""
    if "\n## Benchmarks\n" not in readme:
        raise AssertionError("README.md has no '## Benchmarks' section")
    return readme.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]


def generated_block(section: str) -> tuple[str, str]:
    """The text between the ranking markers, and the section without it."""
    start, end = section.find(BEGIN), section.find(END)
    if start < 0 or end < start:
        raise AssertionError(f"the Benchmarks section needs the markers {BEGIN} and {END}")
    return section[start + len(BEGIN):end], section[:start] + section[end + len(END):]


def stated_figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(text)]


def unheld(text: str, held: set[str]) -> list[str]:
    """The figures of `text` that are neither held by the rows nor allowed."""
    out = []
    for figure in stated_figures(text):
        bare = figure.replace("−", "-")
        if bare in held or bare.lstrip("+-") in held or bare in ALLOWED:
            continue
        out.append(figure)
    return out


def checked_texts() -> dict[str, str]:
    _, outside = generated_block(benchmarks_section_of(README.read_text()))
    return {"README.md Benchmarks": outside, "docs/method.md": METHOD.read_text(),
            "docs/federated.md": FEDERATED.read_text()}


def test_the_docs_state_only_figures_the_rows_hold():
    held = held_figures(load_rows(RANKING))
    problems = {name: bad for name, text in checked_texts().items() if (bad := unheld(text, held))}
    assert not problems, f"figures that docs/results/ranking.json does not hold: {problems}"


def test_a_planted_figure_fails_the_check(tmp_path):
    """The check reads real figures: a false accuracy, margin or percentage planted in a copy of method.md is caught,
    and a figure the rows hold (or no row at all) is told apart."""
    held = held_figures(load_rows(RANKING))

    def false(template: str, values: np.ndarray) -> str:
        """The first of `values` that the rows do not hold, written into `template`."""
        return next(template.format(v) for v in values if template.format(v).split()[-1] not in held)

    plants = [false("zofed's row ends at {:.4f}", np.arange(0.8123, 0.9, 0.0011)),
              false("zofed leads HiSo by {:.1f}", np.arange(13.7, 40, 0.3)) + " points.",
              false("a margin of {:+.2f}", np.arange(11.23, 40, 0.37)) + " over FedKSeed",
              false("FedAvg reached {:.1f}", np.arange(91.5, 99, 0.3)) + "% on SST-2."]
    copy = tmp_path / "method.md"
    for planted in plants:
        copy.write_text(METHOD.read_text() + "\n" + planted + "\n")
        assert unheld(copy.read_text(), held) == unheld(planted, held) != [], planted
    rows = [{"row": "zofed", "dataset": "sst2", "seed": s, "final_accuracy": a, "phase": "final"}
            for s, a in enumerate((0.84, 0.85))] + [
            {"row": "hiso", "dataset": "sst2", "seed": s, "final_accuracy": a, "phase": "final"}
            for s, a in enumerate((0.82, 0.82))]
    fake = tmp_path / "ranking.json"
    fake.write_text(json.dumps({"rows": {str(i): r for i, r in enumerate(rows)}}))
    mine = held_figures(load_rows(fake))
    assert unheld("zofed 0.845, hiso 0.8200, zofed leads by +2.5 points (84.5%)", mine) == []
    assert unheld("zofed leads by 2.6 points", mine) == ["2.6"]


def test_allowed_numbers_are_what_the_code_computes():
    for figure, (reason, value) in ALLOWED.items():
        assert float(figure) == pytest.approx(value), (figure, reason)
    stated = {f for text in checked_texts().values() for f in stated_figures(text)}
    assert set(ALLOWED) <= stated, f"allowed but no longer stated (drop them): {set(ALLOWED) - stated}"


def test_the_readme_ranking_summary_is_the_report_of_the_rows():
    section = benchmarks_section_of(README.read_text())
    assert len(section.strip().splitlines()) <= 27, "the README's Benchmarks section should stay about 25 lines"
    block, _ = generated_block(section)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ranking_report  # noqa: PLC0415 - benchmarks/ is not a package: its path is added just above

    if not hasattr(ranking_report, "benchmarks_section"):
        pytest.skip("benchmarks/ranking_report.py has no benchmarks_section yet: the block cannot be regenerated")
    expected = ranking_report.benchmarks_section(json.loads(RANKING.read_text()))
    assert block == "\n" + expected + "\n", "README's ranking summary is stale: rerun the ranking report"


def test_the_head_recipe_runs_zofed_with_both_components_inactive(tiny_workspace, tmp_path):
    """What docs/method.md and the README say of the head recipe: one block and plain averaging, so a zofed run is
    zo-seeds with one-sided queries, bit for bit; naming an adaptive server makes it differ."""
    head = ("trainable.mode=none", "trainable.label_head=true", "federation.recipe=head", "federation.local_steps=6")
    runs = {"zofed": ("federation.method=zofed",),
            "zo-seeds": ("federation.method=zo-seeds", "zo.estimator=forward"),
            "zofed-adam": ("federation.method=zofed", "federation.server_optimizer.name=adam")}
    final = {}
    for name, extra in runs.items():
        config = tiny_federated_config(tiny_workspace, tmp_path / name, *head, *extra)
        if name == "zofed":
            fed = config.federation
            assert (fed.server_optimizer.name, fed.server_optimizer.lr, config.zo.queries) == ("sgd", 1.0, 8)
            assert config.zo.resolved_estimator("zofed") == "forward"
        run_federated(config, show_progress=False)
        final[name] = load_file(tmp_path / name / "final" / "trainable.safetensors")
    assert len(final["zofed"]) == 1  # the label head is one tensor: block sampling has one block to draw
    for key, tensor in final["zofed"].items():
        assert torch.equal(tensor, final["zo-seeds"][key]), key
    assert any(not torch.equal(t, final["zofed-adam"][k]) for k, t in final["zofed"].items())
