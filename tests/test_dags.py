"""The Airflow DAGs: they parse, have the expected shape, and really run (``airflow dags test``).

Airflow runs with its own AIRFLOW_HOME (SQLite) under a temp dir, so the suite never touches
``~/airflow``; the compaction DAG runs against a temp lake with many small files, the backfill,
reprocess and data-quality DAGs call the real ``iotlake`` CLI on a small lakehouse built here.
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
from fleets import SENSOR, toml_text
from test_maintenance import build_silver, content

from lakehouse.settings import load_settings
from tests.lakehouse_fixture import write_bronze

EXTENDED = bool(os.environ.get("IOTLAKE_EXTENDED_TESTS"))

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "dags"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
EXPECTED = {
    "iotlake_compaction": {"list_tables", "maintain.retain", "maintain.compact", "maintain.vacuum"},
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
    # a stray click on "trigger" only reports what a reprocess would do
    assert bag.dags["iotlake_reprocess"].params.get_param("dry_run").value is True


def _dags_test(env: dict[str, str], dag_id: str, conf: dict | None = None,
               logical_date: datetime | None = None) -> None:
    """Run one DAG as ``airflow dags test`` does, in this process (Airflow's ``DAG.test``: the
    real scheduler-less run, without a new Airflow process per DAG); each task still spawns
    the ``iotlake`` CLI and its own Spark."""
    from airflow.dag_processing.dagbag import DagBag

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dag = DagBag(dag_folder=str(DAGS)).dags[dag_id]
        run = dag.test(run_conf=conf, **({"logical_date": logical_date} if logical_date else {}))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert str(run.state) in ("success", "DagRunState.SUCCESS"), f"{dag_id}: {run.state}"


def test_compaction_dag_compacts(airflow_env: dict[str, str], tmp_path: Path, spark) -> None:
    # ``spark``: the compaction tasks run delta-spark in this process (DAG.test); the worker's
    # session must exist first, or they would start it with the subprocess JVMs' C1-only flags
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


def assert_same_rows(path: str, other: str, keys: list[str]) -> None:
    """Equal tables up to row order and float rounding (aggregation order differs per run)."""
    import pandas as pd

    a, b = (DeltaTable(p).to_pandas().sort_values(keys, ignore_index=True) for p in (path, other))
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12)


def test_cli_dags_on_a_real_lakehouse(airflow_env: dict[str, str], tmp_path: Path, spark) -> None:
    """Backfill, reprocess and data quality, run by Airflow with the real ``iotlake`` CLI (each
    task spawns its own Spark) on a lakehouse built here: two bronze commits, nothing processed."""
    import gold.windows
    import silver.stream
    from ingest.simulator import generate
    from lakehouse.streams import release_checkpoints
    from orchestration.backfill import rows_to_do
    spark_conf = {"master": "local[2]", "shuffle_partitions": 2}
    lake = load_settings(environ={}, data_root=str(tmp_path / "lake"), spark=spark_conf,
                         telemetry=SENSOR.model_dump(mode="json"))
    config = tmp_path / "iotlake.toml"
    # bronze written here, not from Kafka: silver reads it (the layered topology)
    config.write_text(f'data_root = "{lake.root}"\n[spark]\nmaster = "local[2]"\n'
                      'shuffle_partitions = 2\n[stream]\ntopology = "layered"\n' + toml_text("sensor"))
    env = {**airflow_env, "IOTLAKE_CONFIG": str(config),
           "IOTLAKE_BIN": str(Path(sys.executable).with_name("iotlake"))}
    # Events from 2 s before today's midnight (UTC): yesterday's and today's rows for the
    # daily check.
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    msgs = generate(lake, 500, devices=5, duplicates=12, malformed=8, rate=100.0,
                    start=today - timedelta(seconds=2))
    write_bronze(lake, msgs[:300])  # bronze v0
    write_bronze(lake, msgs[300:], first_offset=300)  # bronze v1
    assert rows_to_do(lake, "silver") == 500

    # ---- backfill: every row, once -------------------------------------------------------------
    # (that it takes exactly the missing rows and a rerun changes nothing is test_backfill's:
    # the same CLI, without Airflow and a Spark process per task)
    _dags_test(env, "iotlake_backfill", {"layers": ["silver", "gold"]})  # bronze reads Kafka: not here
    valid = {m.event_id for m in msgs if m.kind in ("valid", "late")}
    ids = DeltaTable(lake.table_path("silver")).to_pandas().event_id
    assert set(ids) == valid and ids.is_unique
    assert DeltaTable(lake.table_path("quarantine")).to_pyarrow_dataset().count_rows() == 8
    windows = DeltaTable(lake.table_path("gold_metrics_1m")).to_pandas()
    assert windows["count"].sum() == 3 * len(valid)
    quality = DeltaTable(lake.table_path("quality_log")).to_pandas()
    rows_in = quality[quality.expectation == "rows_in"].details.map(lambda d: json.loads(d)["count"])
    assert rows_in.sum() == 500  # every bronze row read once
    assert (rows_to_do(lake, "silver"), rows_to_do(lake, "gold")) == (0, 0)

    # ---- reprocess as of bronze v0 = a fresh computation over v0 (rerun: test_backfill) -------
    # The short version leaves it to test_backfill (in-process) and test_dagbag (the DAG's
    # params); IOTLAKE_EXTENDED_TESTS=1 runs the dry run and the rebuild through Airflow.
    if not EXTENDED:
        return _data_quality(env, lake, today)
    _dags_test(env, "iotlake_reprocess", {"as_of_version": 0})
    assert lake.generation() == ""  # a dry run switches nothing
    _dags_test(env, "iotlake_reprocess", {"as_of_version": 0, "dry_run": False})
    assert lake.generation() == "v0"
    fresh = load_settings(environ={}, data_root=str(tmp_path / "fresh"), spark=spark_conf,
                          telemetry=SENSOR.model_dump(mode="json"))
    try:  # the fresh computation: the layers' own code, on the session's Spark
        for start in (lambda: silver.stream.start(spark, fresh, trigger="available_now",
                                                  bronze_path=lake.table_path("bronze"),
                                                  bronze_ending_version=0),
                      lambda: gold.windows.start(spark, fresh, trigger="available_now")):
            q = start()
            q.awaitTermination()
            assert q.exception() is None
    finally:
        release_checkpoints()
    fresh_ids = set(DeltaTable(fresh.table_path("silver")).to_pandas().event_id)
    assert fresh_ids == {m.event_id for m in msgs[:300] if m.kind in ("valid", "late")}
    assert_same_rows(lake.table_path("silver"), fresh.table_path("silver"), ["event_id"])
    assert_same_rows(lake.table_path("gold_metrics_1m"), fresh.table_path("gold_metrics_1m"),
                     ["device_id", "metric", "window_start"])

    _data_quality(env, lake, today)


def _data_quality(env: dict[str, str], lake, today: datetime) -> None:
    """A data-quality run for tomorrow checks today's rows (its "yesterday")."""
    from silver.validate import RESULT_FILE

    tomorrow = today + timedelta(days=1)
    _dags_test(env, "iotlake_data_quality", logical_date=tomorrow)
    out = lake.root / "quality" / "silver" / f"daily-{today.date()}"
    result = json.loads((out / RESULT_FILE).read_text())
    times = DeltaTable(lake.table_path("silver")).to_pandas().event_time
    of_today = int(((times >= today) & (times < tomorrow)).sum())
    assert 0 < of_today < len(times)  # yesterday's rows exist and are not checked
    by_type = {r["expectation_config"]["type"]: r for r in result["results"]}
    assert by_type["expect_table_row_count_to_be_between"]["result"]["observed_value"] == of_today
    assert {r["result"].get("element_count") for r in result["results"]} - {None} == {of_today}
    assert result["success"] is True
    assert (out / "index.html").is_file() and list((out / "validations").rglob("*.html"))
