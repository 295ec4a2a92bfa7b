"""benchmarks/ is tools/ and studies/ on top of lib/: a tool or study imports only lib (and src), never another
tool or study, and lib imports neither; every tool and study runs as ``python -m benchmarks.<kind>.<name>``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for kind in ("tools", "studies") for p in (BENCH / kind).glob("*.py") if p.name != "__init__.py")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (anywhere in the file, inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", [p for p in BENCH.rglob("*.py") if "results" not in p.parts],
                         ids=lambda p: p.relative_to(BENCH).as_posix())
def test_no_script_imports_another_script(path):
    kind = path.relative_to(BENCH).parts[0]
    others = {m for m in imported(path) if m.startswith(("benchmarks.tools", "benchmarks.studies"))}
    assert not others, f"{path.name} imports {sorted(others)}: move what they share to benchmarks/lib"
    legacy = {m for m in imported(path) if m.split(".")[0] in {p.stem for p in SCRIPTS} | {"_common"}}
    assert not legacy, f"{path.name} imports a script by its bare name: {sorted(legacy)}"
    if kind == "lib":
        assert "__main__" not in path.read_text(), f"lib/{path.name} is a library, not a command"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(BENCH).as_posix())
def test_every_tool_and_study_is_a_command(path):
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text and "def main(" in text
    assert text.startswith('"""'), f"{path.name}: no docstring saying what it measures and how to run it"
    assert f"python -m benchmarks.{path.parent.name}.{path.stem}" in text, f"{path.name}: its command is not shown"
