"""The architecture in the folders holds: a package imports only packages below it.

``lakehouse`` (the foundation every stage uses) sits at the bottom; a record's path reads
``ingest`` → ``bronze`` → ``silver`` → ``gold``; ``dashboard`` reads the tables; ``orchestration``
(the CLI, run, backfill, maintenance...) drives all of them; Airflow's ``dags`` call it. Imports
inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORDER = ["lakehouse", "ingest", "bronze", "silver", "gold", "dashboard", "orchestration", "dags"]


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
