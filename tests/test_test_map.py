"""The map of the tests (tests/README.md) against the package and the test files (issue 43).

Read statically: every module of ``residency/`` has one row in the map; each file a row names
exists; the fast files it names have fast tests; no test is both fast and ``gpu``; the ``fast``
marker is registered.  The fast tier itself is ``python -m pytest -m fast``."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: A map row: | `residency/x.py` | what it holds | fast test files | more in the full run |
ROW = re.compile(r"^\| `(residency/[^`]+)` \|[^|]*\|([^|]*)\|([^|]*)\|$")


def map_rows(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """module -> (fast test files, more test files), from the map's table rows; a module listed
    twice is an error."""
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        module, fast, more = match.groups()
        assert module not in rows, f"{module} has two rows in tests/README.md's map"
        rows[module] = (re.findall(r"`([^`]+)`", fast), re.findall(r"`([^`]+)`", more))
    return rows


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.<name>`` names among `decorators` (called or not)."""
    names = set()
    for node in decorators:
        node = node.func if isinstance(node, ast.Call) else node
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "mark"):
            names.add(node.attr)
    return names


def marked_tests(path: Path) -> dict[str, set[str]]:
    """Each top-level test function of `path` -> the marks it carries, the module's
    ``pytestmark`` included."""
    tree = ast.parse(path.read_text())
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                                for t in node.targets):
            value = node.value
            module_marks |= _marks(value.elts if isinstance(value, ast.List) else [value])
    return {node.name: module_marks | _marks(node.decorator_list)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def test_every_module_of_the_package_has_one_row_in_the_map():
    rows = map_rows((TESTS / "README.md").read_text())
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "residency").rglob("*.py"))
    assert sorted(set(modules) - set(rows)) == [], "modules missing from tests/README.md's map"
    assert sorted(set(rows) - set(modules)) == [], "map rows for modules that do not exist"


def test_each_file_the_map_names_exists_and_the_fast_ones_have_fast_tests():
    for module, (fast, more) in map_rows((TESTS / "README.md").read_text()).items():
        assert fast, f"{module}: the map names no fast test file"
        for name in fast + more:
            assert (TESTS / name).is_file(), f"{module}: the map names {name}, not in tests/"
        for name in fast:
            marks = marked_tests(TESTS / name)
            assert any("fast" in m for m in marks.values()), (
                f"{module}: the map names {name} as fast, but none of its tests is marked fast")


def test_no_test_is_both_fast_and_for_the_accelerator():
    both = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_*.py"))
            for name, marks in marked_tests(path).items() if {"fast", "gpu"} <= marks]
    assert both == [], "a fast test may not need the accelerator child"


def test_the_fast_marker_is_registered():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(line.startswith("fast:") for line in options["markers"])


def test_the_checks_see_marks_and_map_rows(tmp_path):
    """The readers above on made-up input: a module mark, a decorator, a row, a repeated row."""
    path = tmp_path / "test_x.py"
    path.write_text("import pytest\npytestmark = [pytest.mark.usefixtures('a')]\n"
                    "@pytest.mark.fast\n@pytest.mark.parametrize('x', [1])\ndef test_a(x): pass\n"
                    "def test_b(): pass\n")
    assert marked_tests(path) == {"test_a": {"usefixtures", "fast", "parametrize"},
                                  "test_b": {"usefixtures"}}
    row = "| `residency/a.py` | what | `test_a.py`, `test_b.py` | `test_c.py` |"
    assert map_rows(row) == {"residency/a.py": (["test_a.py", "test_b.py"], ["test_c.py"])}
    with pytest.raises(AssertionError, match="two rows"):
        map_rows(row + "\n" + row)
