"""The Airflow DAGs: they parse, have the expected shape, and really run (``airflow dags test``).

Airflow runs with its own AIRFLOW_HOME (SQLite) under a temp dir, so the suite never touches
``~/airflow``; the compaction DAG runs against a temp lake with many small files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable
from test_maintenance import build_silver, content

from lakehouse.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "dags"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
EXPECTED = {
    "iotlake_compaction": {"list_tables", "maintain.compact", "maintain.vacuum"},
    "iotlake_backfill": {"backfill_bronze", "backfill_silver", "backfill_gold"},
    "iotlake_reprocess": {"reprocess"},
    "iotlake_data_quality": {"validate_silver"},
}


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment of an isolated Airflow (migrated SQLite DB); also applied to this process."""
    home = tmp_path_factory.mktemp("airflow")
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    full = {**os.environ, **env}
    subprocess.run([AIRFLOW, "db", "migrate"], env=full, check=True, capture_output=True,
                   timeout=120)
    yield full
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_dagbag(airflow_env: dict[str, str]) -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))  # Airflow 3.3's DagBag has no include_examples
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == set(EXPECTED)
    for dag_id, tasks in EXPECTED.items():
        assert set(bag.dags[dag_id].task_ids) == tasks, dag_id
    assert set(bag.dags["iotlake_backfill"].params) == {"layers", "max_rows_per_batch"}
    assert set(bag.dags["iotlake_reprocess"].params) == {"as_of_version", "as_of_timestamp",
                                                         "dry_run"}


def _dags_test(env: dict[str, str], dag_id: str, *extra: str) -> str:
    proc = subprocess.run([AIRFLOW, "dags", "test", dag_id, *extra], env=env, capture_output=True,
                          text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "state=success" in out, out[-4000:]
    return out


def test_compaction_dag_compacts(airflow_env: dict[str, str], tmp_path: Path) -> None:
    lake = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    path = build_silver(lake)
    before = content(DeltaTable(path).to_pyarrow_table())
    config = tmp_path / "iotlake.toml"
    config.write_text(f'data_root = "{lake.root}"\n')

    # IOTLAKE_BIN (and the suite's IOTLAKE_TEST_* ports) must not be read as settings.
    env = {**airflow_env, "IOTLAKE_CONFIG": str(config), "IOTLAKE_BIN": "/nonexistent/iotlake"}
    _dags_test(env, "iotlake_compaction")

    dt = DeltaTable(path)
    assert len(dt.file_uris()) <= 3 and dt.history(1)[0]["operation"] == "OPTIMIZE"
    assert content(dt.to_pyarrow_table()).equals(before)


def test_cli_dags_call_iotlake(airflow_env: dict[str, str], tmp_path: Path) -> None:
    """Backfill, reprocess and data quality call the CLI as designed (a stub records argv)."""
    calls = tmp_path / "calls.jsonl"
    stub = tmp_path / "iotlake"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(0o755)
    lake = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    build_silver(lake, appends=3)
    config = tmp_path / "iotlake.toml"
    config.write_text(f'data_root = "{lake.root}"\n')
    env = {**airflow_env, "IOTLAKE_BIN": str(stub), "IOTLAKE_CONFIG": str(config)}

    _dags_test(env, "iotlake_backfill", "-c", json.dumps({"layers": ["bronze", "gold"],
                                                          "max_rows_per_batch": 1000}))
    _dags_test(env, "iotlake_reprocess", "-c", json.dumps({"as_of_version": 7}))
    # A run for tomorrow validates silver as of tomorrow's midnight: today's latest version.
    tomorrow = datetime.now(UTC).date() + timedelta(days=1)
    _dags_test(env, "iotlake_data_quality", tomorrow.isoformat())
    argv = [json.loads(line) for line in calls.read_text().splitlines()]
    assert argv == [
        ["backfill", "--layer", "bronze", "--max-rows", "1000"],
        ["backfill", "--layer", "gold", "--max-rows", "1000"],
        ["reprocess", "--as-of-version", "7", "--dry-run"],
        ["validate", "silver", "--version", "2", "--out",
         f"{lake.root}/quality/silver/daily-{tomorrow - timedelta(days=1)}"],
    ]
