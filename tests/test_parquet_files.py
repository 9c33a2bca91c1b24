"""Appends of driver-held Arrow tables: Parquet written by pyarrow, committed by Delta's
transaction (``delta_tables.append_table``), against what Delta's own writer writes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from lakehouse.delta import parquet_files
from lakehouse.delta import tables as delta_tables

DAY = "from_unixtime(unix_timestamp(`ts`) DIV 86400 * 86400, 'yyyy-MM-dd')"
HOUR = "from_unixtime(unix_timestamp(`ts`) DIV 3600 * 3600, 'yyyy-MM-dd-HHmm')"
SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string()), ("u", pa.string()), ("x", pa.float64()),
                    ("ts", pa.timestamp("us", tz="UTC")), ("flag", pa.bool_())])
LONG = "a reading id longer than the 32-character prefix of Delta"


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def readings() -> pa.Table:
    """Rows across day and hour buckets, before 1970 (Spark's DIV truncates toward zero),
    sub-millisecond times, unicode and long strings, a NaN, nulls."""
    rows = [
        (1, "dev-ü", "short", 1.5, _ts("2026-11-26 23:59:59.999999"), True),
        (2, "日本-7", LONG, float("nan"), _ts("2026-11-26 10:00:00.000500"), None),
        (3, None, None, None, _ts("2026-11-27 00:00:00"), False),
        (4, "sensor.a/1", "x" * 40, -2.25, _ts("2026-11-27 00:30:00.123456"), True),
        (5, "z", "b", 0.0, _ts("1969-12-31 12:00:00.5"), False),
        (6, "a", "c", 7.0, _ts("2026-11-27 00:59:59.9995"), None),
    ]
    return pa.Table.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows], schema=SCHEMA)


def adds(path: str) -> dict[str, dict]:
    """Statistics of the table's files by partition value (one file each here)."""
    out = {}
    for f in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            add = json.loads(line).get("add")
            if add:
                key = add["partitionValues"]["time_bucket"]
                assert key not in out, "one file per partition value"
                out[key] = json.loads(add["stats"])
    return out


@pytest.mark.parametrize("expression", [DAY, HOUR])
def test_files_written_on_the_driver_match_deltas_own(spark, tmp_path: Path, expression: str) -> None:
    data = readings()
    paths = {}
    for name in ("delta", "driver"):
        paths[name] = str(tmp_path / name)
        delta_tables.ensure_table(spark, paths[name], SCHEMA, partition_by=["time_bucket"],
                                  generated={"time_bucket": expression})
    # Delta's writer, one task (one file per partition value)
    delta_tables.append(spark.createDataFrame(data).coalesce(1), paths["delta"], "app", 0)
    delta_tables.append_table(spark, data, paths["driver"], "app", 0)

    theirs, ours = adds(paths["delta"]), adds(paths["driver"])
    assert ours.keys() == theirs.keys()
    # 1969-12-31 12:00:00.5: Spark's divisions truncate toward zero, so the bucket after
    assert ("1970-01-01" if expression == DAY else "1969-12-31-1300") in ours
    for key, want in theirs.items():
        got = ours[key]
        # left out here, where Delta truncates (long strings) or orders NaN: only skipping is lost
        for bound in ("minValues", "maxValues"):
            for col in ("u", "x"):
                if col not in got[bound]:
                    want[bound].pop(col, None)
        assert got == want, key
    assert "u" not in ours["2026-11-26" if expression == DAY else "2026-11-26-1000"]["minValues"]

    read = {n: spark.read.format("delta").load(p).orderBy("id").toArrow() for n, p in paths.items()}
    assert repr(read["driver"].to_pylist()) == repr(read["delta"].to_pylist())  # NaN == NaN
    assert DeltaTable(paths["driver"]).to_pyarrow_table().num_rows == 6
    # statistics left out still let a filtered read find the rows
    assert spark.read.format("delta").load(paths["driver"]).where(F.col("u") == LONG).count() == 1
    assert spark.read.format("delta").load(paths["driver"]).where(
        "ts >= timestamp'2026-11-27 00:59:59.9995'").count() == 1

    history = DeltaTable(paths["driver"]).history()
    assert history[0]["operation"] == "WRITE"
    assert int(history[0]["operationMetrics"]["numOutputRows"]) == 6
    delta_tables.append_table(spark, data, paths["driver"], "app", 0)  # a replayed batch
    assert DeltaTable(paths["driver"]).version() == 1


def test_tables_that_need_deltas_writer_get_it(spark, tmp_path: Path) -> None:
    data = readings()
    other = str(tmp_path / "other")  # a generated column of another shape: Delta computes it
    delta_tables.ensure_table(spark, other, SCHEMA, partition_by=["time_bucket"],
                              generated={"time_bucket": "date_format(ts, 'yyyy-MM')"})
    delta_tables.append_table(spark, data, other, "app", 0)
    assert set(DeltaTable(other).to_pyarrow_table().column("time_bucket").to_pylist()) == {
        "2026-11", "1969-12"}

    checked = str(tmp_path / "checked")  # a CHECK constraint: Delta's writer enforces it
    delta_tables.ensure_table(spark, checked, SCHEMA)
    spark.sql(f"ALTER TABLE delta.`{checked}` ADD CONSTRAINT positive CHECK (id > 1)")
    with pytest.raises(Exception, match="(?i)constraint"):
        delta_tables.append_table(spark, data, checked, "app", 0)
    assert DeltaTable(checked).to_pyarrow_table().num_rows == 0


def test_bucket_values_and_statistics_without_spark() -> None:
    data = readings()
    assert parquet_files.bucket_values(data, DAY).to_pylist() == [
        "2026-11-26", "2026-11-26", "2026-11-27", "2026-11-27", "1970-01-01", "2026-11-27"]
    with pytest.raises(parquet_files.Unsupported):
        parquet_files.bucket_values(data, "date_format(ts, 'yyyy-MM')")
    stats = json.loads(parquet_files.stats_json(data, ["s", "ts", "missing"]))
    assert stats == {"numRecords": 6, "minValues": {"s": "a", "ts": "1969-12-31T12:00:00.500Z"},
                     "maxValues": {"s": "日本-7", "ts": "2026-11-27T00:59:59.999Z"},
                     "nullCount": {"s": 1, "ts": 0, "missing": 6}}
