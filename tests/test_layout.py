"""The architecture in the folders holds: a package imports only packages below it.

``lakehouse`` (the foundation every stage uses) sits at the bottom; a record's path reads
``ingest`` → ``bronze`` → ``silver`` → ``gold``; ``dashboard`` reads the tables; ``orchestration``
(the CLI, run, backfill, maintenance...) drives all of them; Airflow's ``dags`` call it. Imports
inside functions count too: a lazy import is still a dependency. Inside the product packages no
module imports one that imports it back, however far round (an import circle): each module's
imports, lazy ones included, form a graph without cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORDER = ["lakehouse", "ingest", "bronze", "silver", "gold", "dashboard", "orchestration", "dags"]
#: The product packages whose modules the circle check reads (``expectations`` holds suites'
#: documentation, no module today).
PRODUCT = [*ORDER, "expectations"]
#: Circles left on purpose, each as its modules in sorted order; every entry names its fix.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ORDER)


def upward_imports(package: str) -> list[str]:
    allowed = set(ORDER[: ORDER.index(package) + 1])
    return [f"{path.relative_to(REPO)} imports {pkg}"
            for path in sorted((REPO / package).rglob("*.py"))
            for pkg in sorted(imported_packages(path) - allowed)]


@pytest.mark.parametrize("package", ORDER)
def test_no_package_imports_one_above_it(package: str) -> None:
    assert upward_imports(package) == []


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from orchestration.run import run\n    import gold.windows\n")
    assert imported_packages(f) == {"orchestration", "gold"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PRODUCT if (REPO / pkg).is_dir()
            for p in sorted((REPO / pkg).rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The product modules ``name`` (at ``path``) imports, lazily or not: ``from a.b import c``
    is module ``a.b.c`` when there is one, else ``a.b``; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    script = {id(n) for guard in tree.body if is_main_guard(guard) for n in ast.walk(guard)}
    for node in ast.walk(tree):
        if id(node) in script:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``. What it imports runs only when the module is the script
    (``python -m``), as module ``__main__``: importing the module never reaches it, so it joins
    no circle."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in node.test.comparators))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's), as ``a, b, ..., a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [circle_in(graph, g) for g in groups]


def circle_in(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest circle through the group's first module, by breadth-first search."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(group)


def test_no_import_circles() -> None:
    modules = product_modules()
    graph = {n: imported_modules(n, p, set(modules)) for n, p in modules.items()}
    circles = [c for c in import_cycles(graph) if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_circle_check_names_a_circle(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    paths = {n: tmp_path / "pkg" / f"{n.split('.')[-1]}.py" for n in ("pkg.a", "pkg.b", "pkg.c")}
    graph = {n: imported_modules(n, p, set(paths)) for n, p in paths.items()}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_a_script_guard_joins_no_circle(tmp_path: Path) -> None:
    """``python -m pkg.a`` handing over to ``pkg.b``, which imports ``pkg.a``: no circle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "import sys\n\nif __name__ == '__main__':\n    from pkg.b import main\n    sys.exit(main())\n")
    (tmp_path / "pkg" / "b.py").write_text("def main():\n    import pkg.a\n")
    paths = {n: tmp_path / "pkg" / f"{n.split('.')[-1]}.py" for n in ("pkg.a", "pkg.b")}
    graph = {n: imported_modules(n, p, set(paths)) for n, p in paths.items()}
    assert graph == {"pkg.a": set(), "pkg.b": {"pkg.a"}}
    assert import_cycles(graph) == []


def test_the_runtime_sits_below_the_spark_session() -> None:
    """``lakehouse.runtime`` (JVM and process tuning) is what ``lakehouse.spark`` applies: no
    module of it imports the session's module, lazily or not."""
    modules = product_modules()
    runtime = {n: p for n, p in modules.items() if n.startswith("lakehouse.runtime")}
    assert runtime
    assert {n: sorted(m) for n, p in runtime.items()
            if (m := imported_modules(n, p, set(modules)) & {"lakehouse.spark"})} == {}
