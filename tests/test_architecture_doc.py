"""docs/architecture.md against the code: every module it names exists, every module is named in its package's
paragraph (fl/'s in import order, as it says), and its layer drawing is the import graph's.

Paths are read in three spellings: `src/zofed/fl/rounds.py`, the short `fl/rounds.py` (a zofed package first, as
the doc writes them) and `tests/test_x.py`; module names as `zofed.fl.rounds`. The layer drawing is the fenced
block under "## The layers": one layer a line, its members (paths) first, then after `imports` the layers it
imports directly, each named by one of its members (the leaves `streams.py` and `atomic_files.py` left out).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_import_cycles import import_graph

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "zofed"
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
LEAVES = ("streams.py", "atomic_files.py")

_PACKAGE = "(?:" + "|".join(PACKAGES) + ")"
_FULL_PATH = re.compile(r"src/zofed/[\w/]+\.py")
_SHORT_PATH = re.compile(rf"(?<![\w/.-]){_PACKAGE}/[\w/]*?\w+\.py")
_SHORT_DIR = re.compile(rf"(?<![\w/.-]){_PACKAGE}/(?:\w+/)*(?![\w.])")
_TEST_PATH = re.compile(r"(?<![\w/.-])tests/\w+\.py")
_MODULE = re.compile(r"(?<![\w./])zofed(?:\.(?!py\b)\w+)+")  # not the file fl/methods/zofed.py


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def named_paths(text: str) -> list[Path]:
    """Every file or folder the text names, as a path on disk (which may not exist)."""
    paths = [ROOT / p for p in _FULL_PATH.findall(text)]
    paths += [SRC / p for p in _SHORT_PATH.findall(text)]
    paths += [SRC / p for p in _SHORT_DIR.findall(text)]
    paths += [ROOT / p for p in _TEST_PATH.findall(text)]
    return paths


def module_exists(name: str) -> bool:
    """Whether `zofed.a.b` is a module or package, or a name a module defines (`zofed.fl.rounds.run_round`)."""
    parts = name.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:cut])
        file = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if file is None:
            continue
        if cut == len(parts):
            return True
        defined = rf"^(?:def|class)\s+{parts[cut]}\b|^{parts[cut]}\s*[:=]"
        return re.search(defined, file.read_text(encoding="utf-8"), re.M) is not None
    return False


def test_the_extractors_find_each_spelling():
    text = ("`src/zofed/fl/rounds.py` and `fl/roles.py`, `fl/methods/` and zo/, `tests/test_x.py`, zofed.fl.rounds; "
            "`methods/zofed.py`, `zofed.py`; "
            "not docs/architecture.md nor benchmarks/cost_model.py nor `zofed run`.")
    assert named_paths(text) == [ROOT / "src/zofed/fl/rounds.py", SRC / "fl/roles.py", SRC / "fl/methods/",
                                 SRC / "zo/", ROOT / "tests/test_x.py"]
    assert _MODULE.findall(text) == ["zofed.fl.rounds"]
    assert module_exists("zofed.fl.rounds") and module_exists("zofed.fl.rounds.run_round")
    assert not module_exists("zofed.fl.nowhere") and not module_exists("zofed.fl.rounds.no_such_function")


def test_every_path_the_doc_names_exists():
    paths = named_paths(doc_text())
    assert len(paths) > 80  # the doc names its modules by path: an extractor that finds none is broken
    missing = sorted({str(p.relative_to(ROOT)) for p in paths if not p.exists()})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_name_the_doc_uses_exists():
    missing = sorted({m for m in _MODULE.findall(doc_text()) if not module_exists(m)})
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


# --- every module in its package's paragraph --------------------------------------------------------------------


def package_paragraphs(text: str) -> dict[str, str]:
    """The paragraphs of "## The packages", keyed by their bold lead (`fl/`, or `top` for the top level)."""
    section = text.split("## The packages", 1)[1].split("\n## ", 1)[0]
    out = {}
    for paragraph in section.split("\n\n"):
        lead = re.match(r"\*\*(\w+/|Top level)", paragraph.strip())
        if lead:
            out["top" if lead[1] == "Top level" else lead[1].rstrip("/")] = paragraph
    return out


def modules_of(package: str) -> set[str]:
    """The module files of a package (its subpackages' too, by path inside it), without __init__ files; `top`:
    the top-level modules."""
    if package == "top":
        return {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    folder = SRC / package
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if p.name != "__init__.py"}


def names_in(paragraph: str) -> set[str]:
    """The module files a paragraph names as `x.py` in backticks; those in the parentheses after a folder it names
    (`methods/` (... `base.py`, ...)) are that folder's (`methods/base.py`)."""
    files = re.compile(r"`(\w+\.py)`")
    names = set()
    for folder, inside in re.findall(r"`(\w+)/`\s*\(([^)]*)\)", paragraph):
        names |= {f"{folder}/{n}" for n in files.findall(inside)}
        paragraph = paragraph.replace(inside, "")
    return names | set(files.findall(paragraph))


def test_each_package_has_a_paragraph():
    assert set(package_paragraphs(doc_text())) == {"top", *PACKAGES}


@pytest.mark.parametrize("package", ["top", *PACKAGES])
def test_each_paragraph_names_exactly_its_packages_modules(package):
    paragraph = package_paragraphs(doc_text())[package]
    named, real = names_in(paragraph), modules_of(package)
    assert not real - named, f"the {package} paragraph leaves out {sorted(real - named)}"
    assert not named - real, f"the {package} paragraph names {sorted(named - real)}, which {package} lacks"


def test_the_fl_paragraph_lists_its_modules_bottom_up():
    """It says so: no module of fl/ imports one the paragraph lists after it (methods/ counts as one place)."""
    paragraph = package_paragraphs(doc_text())["fl"]
    place: dict[str, int] = {}  # fl's module (or methods) -> where the paragraph first names it
    for name in re.findall(r"`(\w+)(?:\.py|/)`", paragraph):
        place.setdefault(name, len(place))
    fl = {m: ts for m, ts in import_graph().items() if m.startswith("zofed.fl.")}
    late = [f"{m} imports {t}" for m, ts in fl.items() for t in ts
            if t.startswith("zofed.fl.") and place.get(t.split(".")[2], -1) > place.get(m.split(".")[2], -1)]
    assert not late, "the fl paragraph lists a module before one it imports:\n" + "\n".join(late)


# --- the layer drawing ------------------------------------------------------------------------------------------


def drawn_layers(text: str) -> list[tuple[list[str], list[str]]]:
    """The drawing's layers top to bottom: (members, the layers it says it imports, by one member each)."""
    section = text.split("## The layers", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        line = line.strip(" │")
        if not line:
            continue
        members = line.split("  ", 1)[0].split()
        claimed = line.split(" imports ", 1)[1].split() if " imports " in line else None
        assert claimed is not None, f"layer line without `imports`: {line!r}"
        layers.append((members, [] if claimed == ["nothing"] else claimed))
    return layers


def layer_of(module: str, members: list[list[str]]) -> int:
    """The index of the layer holding a dotted module: its own file's entry, else its nearest package's."""
    parts = module.split(".")[1:]
    path = SRC.joinpath(*parts)
    is_package = (path / "__init__.py").is_file()
    candidates = [] if is_package else ["/".join(parts) + ".py"]
    candidates += ["/".join(parts[:cut]) + "/" for cut in range(len(parts) - (0 if is_package else 1), 0, -1)]
    for candidate in candidates:
        for index, layer in enumerate(members):
            if candidate in layer:
                return index
    raise AssertionError(f"{module} is in no layer of the drawing")


def layer_of_path(name: str, members: list[list[str]]) -> int:
    """The index of the layer the drawing lists `name` in."""
    for index, layer in enumerate(members):
        if name in layer:
            return index
    raise AssertionError(f"the drawing names {name}, a member of no layer")


def test_the_drawing_is_the_import_graph():
    layers = drawn_layers(doc_text())
    members = [m for m, _ in layers]
    assert all(Path(SRC, m).exists() for layer in members for m in layer)
    leaves = {layer_of("zofed." + leaf.removesuffix(".py"), members) for leaf in LEAVES}
    assert leaves == {len(layers) - 1}, "the leaves are the bottom layer"
    graph = import_graph()
    wrong, reached = [], [set() for _ in layers]
    for source, targets in graph.items():
        if source == "zofed":
            continue
        here = layer_of(source, members)
        for target in targets:
            there = layer_of(target, members)
            if there < here:
                wrong.append(f"{source} (layer {here}) imports {target} (layer {there}, above it)")
            elif there > here and there not in leaves:
                reached[here].add(there)
    assert not wrong, "the drawing puts importers below what they import:\n" + "\n".join(wrong)
    for index, (layer, claimed) in enumerate(layers):
        said = {layer_of_path(name, members) for name in claimed}
        actual = sorted(" ".join(members[i]) for i in reached[index])
        assert said == reached[index], f"{' '.join(layer)} imports {actual}, the drawing says {claimed}"

