"""Idempotent appends through delta-spark (``lakehouse.delta_tables.append``) on real tables."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lakehouse import delta_tables

_groups = itertools.count()


@pytest.fixture
def table(spark, tmp_path: Path) -> str:
    path = str(tmp_path / "t")
    schema = spark.range(1).selectExpr("id", "cast(id as string) as s", "current_timestamp() as ts").schema
    delta_tables.ensure_table(spark, path, schema, partition_by=["time_bucket"],
                              generated={"time_bucket": "date_format(ts, 'yyyy-MM-dd')"})
    return path


def rows(spark, start: int, n: int = 5):
    return spark.range(start, start + n).selectExpr(
        "id", "cast(id as string) as s", "timestamp'2026-11-26 10:00:00' as ts")


def jobs_of(spark, fn) -> int:
    """Spark jobs ``fn`` ran."""
    sc = spark.sparkContext
    group = f"append-under-test-{next(_groups)}"
    sc.setJobGroup(group, group)
    try:
        fn()
        return len(sc.statusTracker().getJobIdsForGroup(group))
    finally:
        sc.setJobGroup("", "")


def test_append_once_per_batch_in_one_job_with_generated_columns(spark, table: str) -> None:
    assert jobs_of(spark, lambda: delta_tables.append(rows(spark, 0), table, "app", 0)) == 1
    # a replayed batch: no write, and the lookup needs no Spark job (the checksum lists it)
    assert jobs_of(spark, lambda: delta_tables.append(rows(spark, 0), table, "app", 0)) == 0
    assert jobs_of(spark, lambda: delta_tables.append(rows(spark, 100), table, "app", 1)) == 1
    delta_tables.append(rows(spark, 200), table, "other-app", 0)  # another query's own ids
    dt = DeltaTable(table)
    got = dt.to_pyarrow_table()
    assert sorted(got.column("id").to_pylist()) == [*range(5), *range(100, 105), *range(200, 205)]
    assert set(got.column("time_bucket").to_pylist()) == {"2026-11-26"}
    assert dt.transaction_version("app") == 1 and dt.transaction_version("other-app") == 0
    assert [h["operation"] for h in dt.history()][:3] == ["WRITE"] * 3
    assert delta_tables._append_fast_path


def test_replay_without_a_checksum_file_uses_deltas_own_lookup(spark, table: str) -> None:
    delta_tables.append(rows(spark, 0), table, "app", 7)
    version = DeltaTable(table).version()
    Path(table, "_delta_log", f"{version:020d}.crc").unlink()
    spark.sql(f"REFRESH TABLE delta.`{table}`")
    from delta.tables import DeltaTable as SparkDeltaTable
    SparkDeltaTable.forPath(spark, table).history(1).collect()  # a fresh snapshot, no checksum
    delta_tables.append(rows(spark, 0), table, "app", 7)
    delta_tables.append(rows(spark, 0), table, "app", 6)
    assert DeltaTable(table).version() == version
    assert spark.read.format("delta").load(table).count() == 5


def test_schema_changes_take_the_writer_path(spark, table: str) -> None:
    wider = rows(spark, 0).selectExpr("*", "1.5 as extra")
    with pytest.raises(Exception, match="(?i)schema mismatch"):
        delta_tables.append(wider, table, "app", 0)
    delta_tables.append(wider, table, "app", 0, schema_evolution=True)
    assert "extra" in spark.read.format("delta").load(table).columns
    narrower_type = rows(spark, 10).selectExpr("cast(id as int) as id", "s", "ts")
    assert not delta_tables._fits(narrower_type.schema, _metadata(spark, table))
    assert delta_tables._fits(rows(spark, 10).schema, _metadata(spark, table))  # extra: nullable
    delta_tables.append(rows(spark, 10), table, "app", 1)
    assert jobs_of(spark, lambda: delta_tables.append(rows(spark, 20), table, "app", 2)) == 1
    for got in (spark.read.format("delta").load(table).toArrow(), DeltaTable(table).to_pyarrow_table()):
        extra = dict(zip(got.column("id").to_pylist(), got.column("extra").to_pylist(), strict=True))
        assert extra == {**{i: 1.5 for i in range(5)}, **{i: None for i in [*range(10, 15), *range(20, 25)]}}


def _metadata(spark, path: str):
    jvm = spark._jvm
    return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path).update(
        False, getattr(getattr(jvm.scala, "None$"), "MODULE$"), getattr(getattr(jvm.scala, "None$"), "MODULE$")).metadata()
