"""The house's layout (issue #39): no import circle in src/, entry points imported by nobody, and the top of
src/ holds only the entry points and packages."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ENTRY_POINTS = {"src.train", "src.evaluate", "src.sample", "src.report"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every src module ``path`` imports, at module level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif node.module in modules:
                    out.add(node.module)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_src():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_outside_the_entry_points_imports_one():
    """Neither src/ nor benchmarks/ nor the tests import src.train / evaluate / sample / report: they call the
    libraries behind them (src.runs.*); a test runs an entry point as a command."""
    graph = _graph()
    offenders = {m: sorted(deps & ENTRY_POINTS) for m, deps in graph.items()
                 if m not in ENTRY_POINTS and deps & ENTRY_POINTS}
    for path in [*sorted((ROOT / "benchmarks").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]:
        deps = _imports(path, ENTRY_POINTS)
        if deps:
            offenders[str(path.relative_to(ROOT))] = sorted(deps)
    assert offenders == {}


def test_the_top_of_src_holds_only_entry_points_and_packages():
    files = sorted(p.name for p in SRC.glob("*.py"))
    assert files == ["__init__.py", "evaluate.py", "report.py", "sample.py", "train.py"]
