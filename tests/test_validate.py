"""``iotlake validate``: GX on a real Delta table agrees with the Spark-compiled suite."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from fleets import SENSOR
from pyspark.sql import functions as F

from lakehouse.settings import load_settings
from lakehouse.tables import silver_schema
from orchestration import cli
from silver.expectations import evaluate_set_level, failed_expectations, load_suite
from silver.validate import RESULT_FILE, validate_table
from tests.test_expectations import SENSOR_SUITE

SILVER = silver_schema(SENSOR)

TS = datetime(2026, 11, 21, 22, 30, tzinfo=UTC)


def row(i: int, **over) -> dict:
    r = {"event_id": f"{i:032x}", "device_id": f"dev-{i:05d}", "event_time": TS,
         "temperature": 20.0 + i, "humidity": 40.0, "battery": 90.0, "status": "ok",
         "schema_version": 1, "extra": None, "kafka_partition": 0, "kafka_offset": i,
         "ingest_time": TS}
    return {**r, **over}


VALID = [row(i) for i in range(1, 7)]
INVALID = [
    row(10, temperature=130.0), row(11, temperature=-50.0, humidity=101.0),
    row(12, battery=-1.0), row(13, status="meh"), row(14, device_id="dev-14"),
    row(15, event_id="XYZ"), row(16, event_id=None), row(17, device_id=None),
    row(18, event_time=None), row(19, temperature=None, status=None),
    row(1, temperature=21.0),  # duplicate event id of a valid row
]
EXPECTED = {  # the data above, counted by hand
    "event_id_not_null": 1, "device_id_not_null": 1, "event_time_not_null": 1,
    "event_id_format": 1, "device_id_format": 1, "temperature_in_range": 2,
    "humidity_in_range": 1, "battery_in_range": 1, "status_known": 1,
    "event_id_unique": 2, "row_count": None, "temperature_mean_in_range": None,
}


@pytest.fixture
def lake(tmp_path: Path):
    s = load_settings(environ={}, data_root=str(tmp_path / "lake"),
                      telemetry={**SENSOR.model_dump(mode="json"), "suite": str(SENSOR_SUITE)})
    path = s.table_path("silver")
    write_deltalake(path, pa.Table.from_pylist(VALID + INVALID, schema=SILVER))  # version 0
    write_deltalake(path, pa.Table.from_pylist(VALID, schema=SILVER), mode="overwrite")  # v1
    return s


def test_gx_counts_equal_spark_counts(lake, spark, tmp_path):
    summary = validate_table(lake, "silver", version=0, out_dir=tmp_path / "report")
    assert summary["success"] is False
    assert (summary["version"], summary["rows"]) == (0, len(VALID) + len(INVALID))
    assert summary["unexpected_counts"] == EXPECTED

    suite = load_suite(SENSOR_SUITE)
    df = spark.createDataFrame(DeltaTable(lake.table_path("silver"), version=0).to_pyarrow_table())
    spark_counts = dict(df.select(F.explode(failed_expectations(suite)).alias("name"))
                        .groupBy("name").count().collect())
    row_names = [c.name for c in suite.row_level]
    assert {n: spark_counts.get(n, 0) for n in row_names} == {
        n: summary["unexpected_counts"][n] for n in row_names}
    unique = next(r for r in evaluate_set_level(suite, df) if r["expectation"] == "event_id_unique")
    assert unique["failed"] == summary["unexpected_counts"]["event_id_unique"]

    result = json.loads((tmp_path / "report" / RESULT_FILE).read_text())
    assert result["success"] is False and len(result["results"]) == len(EXPECTED)
    assert (tmp_path / "report" / "index.html").is_file()
    assert list((tmp_path / "report" / "validations").rglob("*.html"))


def test_latest_version_and_default_location(lake):
    summary = validate_table(lake, "silver")
    assert summary["success"] is True and summary["version"] == 1
    assert set(summary["unexpected_counts"].values()) <= {0, None}
    out = Path(summary["out_dir"])
    assert out.parent == lake.root / "quality" / "silver"
    assert (out / RESULT_FILE).is_file() and (out / "index.html").is_file()


def sensor_config(tmp_path: Path) -> str:
    """A settings file of the example sensor fleet (its own suite: the CLI's default)."""
    cfg = tmp_path / "sensor.json"
    cfg.write_text(json.dumps({"telemetry": SENSOR.model_dump(mode="json")}))
    return str(cfg)


def test_cli_exit_codes(lake, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no iotlake.toml; the test-port variables are not settings
    for var in ("IOTLAKE_TEST_KAFKA_PORT", "IOTLAKE_TEST_MQTT_PORT", "IOTLAKE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    base = ["--config", sensor_config(tmp_path), "--data-root", lake.data_root, "validate"]
    assert cli.main([*base, "silver", "--version", "0", "--out", str(tmp_path / "r0")]) == 1
    out = capsys.readouterr().out
    assert "FAIL temperature_in_range" in out and "unexpected 2" in out
    assert cli.main([*base, "silver"]) == 0
    assert cli.main([*base, "nosuch"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main([*base, "bad-name!"]) == 2
    assert cli.main([*base, "silver", "--version", "7"]) == 2
    assert "cannot load version 7" in capsys.readouterr().err
    assert cli.main([*base, "silver", "--suite", str(tmp_path / "none.json")]) == 2


def test_one_day_of_rows(lake, tmp_path):
    """``--date``: only rows whose event time falls in that UTC day (what the daily DAG checks)."""
    path = lake.table_path("silver")
    next_day = [row(i, event_time=TS + timedelta(hours=2), temperature=200.0) for i in range(30, 33)]
    write_deltalake(path, pa.Table.from_pylist(next_day, schema=SILVER), mode="append")  # v2
    summary = validate_table(lake, "silver", day=date(2026, 11, 21), out_dir=tmp_path / "d21")
    assert (summary["success"], summary["rows"], summary["date"]) == (True, len(VALID), "2026-11-21")
    summary = validate_table(lake, "silver", day=date(2026, 11, 22), out_dir=tmp_path / "d22")
    assert (summary["success"], summary["rows"]) == (False, 3)
    assert summary["unexpected_counts"]["temperature_in_range"] == 3
    result = json.loads((tmp_path / "d22" / RESULT_FILE).read_text())
    assert {r["result"].get("element_count") for r in result["results"]} - {None} == {3}
    # version 0, the 20th: no rows; the CLI takes the day too
    assert validate_table(lake, "silver", version=0, day=date(2026, 11, 20))["rows"] == 0
    base = ["--config", sensor_config(tmp_path), "--data-root", lake.data_root, "validate", "silver",
            "--out", str(tmp_path / "c")]
    assert cli.main([*base, "--date", "2026-11-22"]) == 1
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--date", "yesterday"])
    assert e.value.code == 2
