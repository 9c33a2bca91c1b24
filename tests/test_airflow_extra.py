"""Airflow is an extra (``iotlake[airflow]``) for the DAGs: the runtime path never imports it.

The bridge, the Spark processes (driver and Python workers) and ``iotlake run`` import their
modules in a fresh interpreter here, and Airflow must not be among what they loaded: an
install without the extra runs the pipeline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: What a running pipeline imports: the CLI with every subcommand, ``iotlake run``, the
#: bridge, each layer's stream and the modules Spark's Python workers unpickle functions from.
RUNTIME = ["orchestration.cli", "orchestration.run", "orchestration.pipeline", "ingest.bridge",
           "bronze.stream", "silver.stream", "gold.windows", "gold.health", "gold.state_store",
           "dashboard.app"]

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from orchestration.cli import build_parser
build_parser()  # imports every subcommand's module
print(json.dumps(sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))))
"""


def test_the_runtime_path_does_not_import_airflow() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, *RUNTIME], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_airflow_is_an_extra_without_spark_provider() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
             for d in project["dependencies"]]
    assert not [n for n in names if n.startswith("apache-airflow")]
    assert any(d.startswith("apache-airflow>") for d in project["optional-dependencies"]["airflow"])
    every = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    assert not [d for d in every if "providers-apache-spark" in d]
