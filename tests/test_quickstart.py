"""A newcomer's first steps work in a fresh clone: the tracked files alone, no ``../shared``
beside them, no ``./iotlake.toml``, no ``data/``. The copy runs its own code (``PYTHONPATH``)
with this checkout's installed venv and jars linked in (installing them takes many minutes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestration.services import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked files (as in this working tree), with ``.venv`` and ``.jars`` linked, and
    the Hadoop shim ``lakehouse/runtime/jvm`` compiles on first use copied (a build product, as .jars)."""
    dest = tmp_path_factory.mktemp("fresh") / "iotlake"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the working tree is not in a clone of it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for built in (".venv", ".jars"):
        (dest / built).symlink_to(REPO / built)
    for jar in (REPO / "lakehouse" / "jvm").glob("*.jar"):
        shutil.copy2(jar, dest / "lakehouse" / "jvm" / jar.name)
    assert not (dest.parent / "shared").exists() and not (dest / "iotlake.toml").exists()
    return dest


def run(clone: Path, *cmd: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """``cmd`` in the clone as a newcomer types it; its last line's JSON object."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    # the suite's processes interpret Spark expressions (tests/conftest.py)
    base["IOTLAKE_SPARK__EXPRESSION_CODEGEN"] = os.environ.get("IOTLAKE_SPARK__EXPRESSION_CODEGEN", "off")
    proc = subprocess.run(cmd, cwd=clone, env={**base, "PYTHONPATH": str(clone), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_demo_of_the_example_fleet(clone: Path) -> None:
    """``iotlake --config examples/sensor.toml demo``: embedded brokers (on free ports here),
    every event accounted for, the data under the clone's ``data/``."""
    ports = {"IOTLAKE_KAFKA__EMBEDDED_PORT": str(free_port(pair=True)),
             "IOTLAKE_MQTT__EMBEDDED_PORT": str(free_port()), "IOTLAKE_OBSERVABILITY__METRICS_PORT": "0"}
    out = run(clone, ".venv/bin/iotlake", "--config", "examples/sensor.toml", "demo", "--events", "300",
              "--devices", "5", env=ports)
    assert out["ok"] is True and out["published"] == out["bronze_rows"] == 300, out
    assert Path(out["data_root"]).parent == clone / "data" / "demo", out


def test_anomaly_bench_smoke_without_nab_data(clone: Path) -> None:
    """The anomaly bench's smoke run needs no ``../shared/data/nab``: its corpus is synthetic."""
    out = run(clone, ".venv/bin/python", "bench/anomaly_quality.py", "--smoke")
    assert out["via"] == "direct" and out["readings_per_s"] > 0, out
    assert all(name.startswith("synthetic_") for name in out["per_series"]), out
