"""Idempotent appends and upserts through delta-spark (``lakehouse.delta.tables``) on real tables."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from lakehouse.delta import tables as delta_tables
from lakehouse.delta import txn as delta_txn

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
    assert delta_txn.enabled


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


def _fallbacks(write: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("iotlake_delta_fallback_writes_total", {"write": write}) or 0.0


def test_schema_changes_take_the_writer_path(spark, table: str) -> None:
    """A write the fast path does not take goes through Delta's own command, counted."""
    wider = rows(spark, 0).selectExpr("*", "1.5 as extra")
    before = _fallbacks("append")
    with pytest.raises(Exception, match="(?i)schema mismatch"):
        delta_tables.append(wider, table, "app", 0)
    assert _fallbacks("append") == before + 1
    delta_tables.append(wider, table, "app", 0, schema_evolution=True)
    assert "extra" in spark.read.format("delta").load(table).columns
    narrower_type = rows(spark, 10).selectExpr("cast(id as int) as id", "s", "ts")
    assert not delta_txn._fits(narrower_type.schema, _metadata(spark, table))
    assert delta_txn._fits(rows(spark, 10).schema, _metadata(spark, table))  # extra: nullable
    delta_tables.append(rows(spark, 10), table, "app", 1)
    assert jobs_of(spark, lambda: delta_tables.append(rows(spark, 20), table, "app", 2)) == 1
    for got in (spark.read.format("delta").load(table).toArrow(), DeltaTable(table).to_pyarrow_table()):
        extra = dict(zip(got.column("id").to_pylist(), got.column("extra").to_pylist(), strict=True))
        assert extra == {**{i: 1.5 for i in range(5)}, **{i: None for i in [*range(10, 15), *range(20, 25)]}}


def _metadata(spark, path: str):
    jvm = spark._jvm
    return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path).update(
        False, getattr(getattr(jvm.scala, "None$"), "MODULE$"), getattr(getattr(jvm.scala, "None$"), "MODULE$")).metadata()


def windows(spark, minutes: range, keys: str = "ab", value: int = 0):
    """One row per (key, minute) of 2026-11-26 10:xx: ``v`` = minute + ``value``."""
    data = [(k, m, m + value) for k in keys for m in minutes]
    return spark.createDataFrame(data, "k string, m int, v long").selectExpr(
        "k", "timestamp'2026-11-26 10:00:00' + make_interval(0, 0, 0, 0, 0, m, 0) as window_start", "v")


def test_upsert_recent_rewrites_only_the_files_of_recent_windows(spark, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Delta's MERGE and ``replaceWhere`` (the path of tables whose checksum does not list their
    files; turned on here by turning Delta's transaction API off)."""
    monkeypatch.setattr(delta_txn, "enabled", False)
    path = str(tmp_path / "w")
    delta_tables.ensure_table(spark, path, windows(spark, range(1)).schema, partition_by=["time_bucket"],
                              generated={"time_bucket": "date_format(window_start, 'yyyy-MM-dd')"})

    def since(minute: int):
        from datetime import UTC, datetime
        return datetime(2026, 11, 26, 10, minute, tzinfo=UTC)

    def upsert(df, minute: int, batch: int) -> None:
        delta_tables.upsert_recent(df, path, ["k", "window_start"], "window_start", since(minute),
                                   "app", batch, rows_per_file=4)

    def content() -> dict:
        t = DeltaTable(path).to_pyarrow_table()
        return {(k, ws.minute): v for k, ws, v in zip(*(t.column(c).to_pylist() for c in ("k", "window_start", "v")),
                                                      strict=True)}

    upsert(windows(spark, range(10)), 0, 0)  # 20 rows: a MERGE into the empty table, one file
    assert len(DeltaTable(path).file_uris()) == 1
    # minute 9 updated, minute 10 new: the recent files hold more than 4 rows, so the rows from
    # their oldest window on are replaced, sorted into files of at most 4 rows
    upsert(windows(spark, range(9, 11), value=100), 9, 1)
    want = {**{(k, m): m for k in "ab" for m in range(9)}, **{(k, m): m + 100 for k in "ab" for m in (9, 10)}}
    assert content() == want
    last = DeltaTable(path).history(1)[0]
    assert last["operation"] == "WRITE" and int(last["operationMetrics"]["numOutputRows"]) == 22
    files = set(DeltaTable(path).file_uris())
    assert len(files) == 6
    # now minute 10 updated, 11 new: only the newest file (minute 10's 2 rows) is rewritten
    upsert(windows(spark, range(10, 12), value=200), 10, 2)
    want |= {(k, m): m + 200 for k in "ab" for m in (10, 11)}
    assert content() == want
    now = set(DeltaTable(path).file_uris())
    assert len(files - now) == 1 and len(now - files) == 1
    last = DeltaTable(path).history(1)[0]
    assert last["operation"] == "MERGE" and int(last["operationMetrics"]["numTargetRowsCopied"]) == 0
    for batch in (1, 2):  # a replayed batch writes nothing
        upsert(windows(spark, range(9, 12), value=500), 9, batch)
    assert content() == want and DeltaTable(path).transaction_version("app") == 2
    # files keep disjoint, sorted ranges of windows
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True)).sort_by("min.window_start")
    lo, hi = adds.column("min.window_start").to_pylist(), adds.column("max.window_start").to_pylist()
    assert all(h <= nxt for h, nxt in zip(hi, lo[1:], strict=False))


def test_upsert_recent_rewrites_the_recent_files_through_the_transaction_api(spark, tmp_path: Path) -> None:
    """A table whose checksum lists its files: each upsert rewrites the files that may hold
    windows at or after ``since`` with the batch's rows, sorted into files of at most
    ``rows_per_file`` rows, in at most two Spark jobs; older files stay as they are."""
    path = str(tmp_path / "w")
    delta_tables.ensure_table(spark, path, windows(spark, range(1)).schema, partition_by=["time_bucket"],
                              generated={"time_bucket": "date_format(window_start, 'yyyy-MM-dd')"})

    def upsert(df, minute: int, batch: int) -> None:
        from datetime import UTC, datetime
        delta_tables.upsert_recent(df, path, ["k", "window_start"], "window_start",
                                   datetime(2026, 11, 26, 10, minute, tzinfo=UTC), "app", batch, rows_per_file=4)

    def content(t: pa.Table) -> dict:
        return {(k, ws.minute): v for k, ws, v in zip(*(t.column(c).to_pylist() for c in ("k", "window_start", "v")),
                                                      strict=True)}

    def adds() -> pa.Table:
        return pa.table(DeltaTable(path).get_add_actions(flatten=True)).sort_by("min.window_start")

    assert jobs_of(spark, lambda: upsert(windows(spark, range(10)), 0, 0)) == 1  # nothing to read
    assert adds().column("num_records").to_pylist() == [4, 4, 4, 4, 4]
    before = set(DeltaTable(path).file_uris())
    # minute 9 updated, 10 new: only the file of minutes 8-9 may hold minute 9 or later
    assert jobs_of(spark, lambda: upsert(windows(spark, range(9, 11), value=100), 9, 1)) <= 2
    want = {**{(k, m): m for k in "ab" for m in range(9)}, **{(k, m): m + 100 for k in "ab" for m in (9, 10)}}
    assert content(DeltaTable(path).to_pyarrow_table()) == want
    assert content(spark.read.format("delta").load(path).toArrow()) == want
    now = set(DeltaTable(path).file_uris())
    assert len(before - now) == 1 and len(now - before) == 2 and len(now) == 6
    a = adds()
    assert all(n <= 4 for n in a.column("num_records").to_pylist())
    lo, hi = a.column("min.window_start").to_pylist(), a.column("max.window_start").to_pylist()
    assert all(h <= nxt for h, nxt in zip(hi, lo[1:], strict=False))  # disjoint, sorted ranges
    version = DeltaTable(path).version()
    for batch in (0, 1):  # a replayed batch writes nothing
        assert jobs_of(spark, lambda b=batch: upsert(windows(spark, range(9, 12), value=500), 9, b)) == 0
    assert DeltaTable(path).version() == version
    assert [h["operation"] for h in DeltaTable(path).history(2)] == ["WRITE", "WRITE"]
    assert delta_txn.enabled


def metric_windows(spark, minutes: range):
    """``gold_metrics_*`` rows of device d1's metric m, one per minute of 2026-11-26 10:xx."""
    return spark.range(minutes.start, minutes.stop).selectExpr(
        "'d1' as device_id", "'m' as metric",
        "timestamp'2026-11-26 10:00:00' + make_interval(0, 0, 0, 0, 0, cast(id as int), 0) as window_start",
        "timestamp'2026-11-26 10:01:00' + make_interval(0, 0, 0, 0, 0, cast(id as int), 0) as window_end",
        "1L as count", "cast(id as double) as mean", "cast(id as double) as min",
        "cast(id as double) as max", "cast(null as double) as stddev", "cast(id as double) as last")


def test_statistics_only_on_the_columns_reads_filter_on(spark, tmp_path: Path) -> None:
    """Tables keep file statistics on their keys and times only (``tables.STATS_COLUMNS``); a
    table from before gets them named once, and a stream reading it reads across that commit."""
    from lakehouse.settings import load_settings
    from lakehouse.tables import METRIC_WINDOWS, STATS_COLUMNS_PROPERTY

    s = load_settings(environ={}, data_root=str(tmp_path))
    delta_tables.ensure_named_table(spark, s, "gold_metrics_1m", METRIC_WINDOWS)
    new = s.table_path("gold_metrics_1m")
    delta_tables.append(metric_windows(spark, range(3)), new, "app", 0)
    stats = {c.split(".", 1)[1] for c in DeltaTable(new).get_add_actions(flatten=True).column_names
             if c.startswith("min.")}
    assert stats == {"device_id", "metric", "window_start", "window_end"}

    old = s.table_path("gold_metrics_5m")  # as iotlake created tables before: Delta's default
    delta_tables.ensure_table(spark, old, METRIC_WINDOWS)
    delta_tables.append(metric_windows(spark, range(3)), old, "app", 0)
    delta_tables.ensure_named_table(spark, s, "gold_metrics_5m", METRIC_WINDOWS)
    delta_tables.ensure_named_table(spark, s, "gold_metrics_5m", METRIC_WINDOWS)  # once
    log = DeltaTable(old)
    assert log.metadata().configuration[STATS_COLUMNS_PROPERTY] == "device_id,metric,window_start,window_end"
    assert log.metadata().configuration["parquet.enable.dictionary#mean"] == "false"
    assert [h["operation"] for h in log.history()] == ["SET TBLPROPERTIES", "WRITE", "CREATE TABLE"]
    delta_tables.append(metric_windows(spark, range(3, 5)), old, "app", 1)
    q = (spark.readStream.format("delta").load(old).writeStream.format("memory")
         .queryName("stats_upgrade").trigger(availableNow=True).start())
    try:
        q.awaitTermination()
        assert q.exception() is None
        assert sorted(r.mean for r in spark.table("stats_upgrade").collect()) == [0, 1, 2, 3, 4]
    finally:
        q.stop()


def _encodings(files: list[Path]) -> dict[str, set[str]]:
    """Parquet encodings of each column over ``files``."""
    import pyarrow.parquet as pq

    out: dict[str, set[str]] = {}
    for f in files:
        rg = pq.ParquetFile(f).metadata.row_group(0)
        for i in range(rg.num_columns):
            out.setdefault(rg.column(i).path_in_schema, set()).update(rg.column(i).encodings)
    return out


def test_unique_and_computed_columns_are_written_without_a_dictionary(spark, tmp_path: Path) -> None:
    """Columns in ``tables.PLAIN_COLUMNS`` skip Parquet's dictionary, however few their values;
    the others keep it. A table created before gets the setting once, for the files after."""
    from lakehouse.settings import load_settings
    from lakehouse.tables import METRIC_WINDOWS

    s = load_settings(environ={}, data_root=str(tmp_path))
    path = s.table_path("gold_metrics_1m")
    # five values in 100 rows: a dictionary pays, unless the column is a plain one
    rows = metric_windows(spark, range(100)).withColumn("mean", F.col("min") % 5).withColumn("min", F.col("min") % 5)
    delta_tables.ensure_table(spark, path, METRIC_WINDOWS)  # as iotlake created tables before
    delta_tables.append(rows, path, "app", 0)
    before = list(Path(path).rglob("*.parquet"))
    assert "PLAIN_DICTIONARY" in _encodings(before)["mean"]
    delta_tables.ensure_named_table(spark, s, "gold_metrics_1m", METRIC_WINDOWS)
    delta_tables.ensure_named_table(spark, s, "gold_metrics_1m", METRIC_WINDOWS)  # once
    delta_tables.append(rows, path, "app", 1)
    enc = _encodings([f for f in Path(path).rglob("*.parquet") if f not in before])
    assert "PLAIN_DICTIONARY" not in enc["mean"], enc
    assert "PLAIN_DICTIONARY" in enc["min"] and "PLAIN_DICTIONARY" in enc["device_id"], enc
    log = DeltaTable(path)
    assert [h["operation"] for h in log.history()] == ["WRITE", "SET TBLPROPERTIES", "WRITE", "CREATE TABLE"]
    assert log.to_pyarrow_table().num_rows == 200  # delta-rs reads the table as before


def test_tables_take_the_log_checkpoint_interval_from_the_settings(spark, table: str) -> None:
    """A log checkpoint every ``maintenance.log_checkpoint_commits`` commits, not Delta's 10: a
    checkpoint costs a small table about ten commits, inside the batch that commits it."""
    from lakehouse.settings import load_settings

    interval = load_settings(environ={}).maintenance.log_checkpoint_commits
    assert interval == 100
    assert DeltaTable(table).metadata().configuration["delta.checkpointInterval"] == str(interval)
    for i in range(11):  # past Delta's own interval: no checkpoint yet
        delta_tables.append(rows(spark, 10 * i), table, "app", i)
    assert not list(Path(table, "_delta_log").glob("*.checkpoint.parquet"))


def devices(spark, ids: range, value: int, status: str = "ok"):
    """``device_current``-like rows: one per device, ``v`` = device number + ``value``."""
    return spark.range(ids.start, ids.stop).selectExpr(
        "concat('d', cast(id as string)) as device_id", f"'{status}' as status",
        f"cast(id + {value} as double) as v", "timestamp'2026-11-26 10:00:00' as ts")


@pytest.fixture
def current(spark, tmp_path: Path) -> str:
    path = str(tmp_path / "current")
    schema = spark.createDataFrame([], "device_id string, status string, v double, ts timestamp").schema
    delta_tables.ensure_table(spark, path, schema)  # nullable columns, as iotlake's tables
    return path


def test_a_small_table_is_upserted_whole_in_two_jobs(spark, current: str) -> None:
    """Rows of the batch's keys are replaced whole, other keys kept, new keys inserted, a
    replayed batch writes nothing; Spark and delta-rs read the same rows, and the history shows
    an overwriting WRITE. At most two Spark jobs (the keys' broadcast, the write), no log replay."""
    def content(t: pa.Table) -> dict:
        return dict(zip(t.column("device_id").to_pylist(), t.column("v").to_pylist(), strict=True))

    delta_tables.upsert(devices(spark, range(5), 0), current, ["device_id"], "app", 0)
    assert jobs_of(spark, lambda: delta_tables.upsert(devices(spark, range(3, 8), 100), current,
                                                      ["device_id"], "app", 1)) <= 2
    want = {**{f"d{i}": float(i) for i in range(3)}, **{f"d{i}": i + 100.0 for i in range(3, 8)}}
    version = DeltaTable(current).version()
    assert jobs_of(spark, lambda: delta_tables.upsert(devices(spark, range(8), 500), current,
                                                      ["device_id"], "app", 1)) == 0  # replayed
    dt = DeltaTable(current)
    assert dt.version() == version and dt.transaction_version("app") == 1
    assert content(dt.to_pyarrow_table()) == want
    assert content(spark.read.format("delta").load(current).toArrow()) == want
    assert len(dt.file_uris()) == 1
    assert [h["operation"] for h in dt.history(2)] == ["WRITE", "WRITE"]
    assert delta_txn.enabled


def test_upserts_that_cannot_rewrite_the_table_whole_merge(spark, current: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch without every column keeps the others (a MERGE's update), and a table past
    ``WHOLE_REWRITE_MAX_BYTES`` is MERGEd: both give a MERGE's result."""
    delta_tables.upsert(devices(spark, range(4), 0, status="ok"), current, ["device_id"], "app", 0)
    partial = devices(spark, range(2, 6), 100).drop("status")
    assert jobs_of(spark, lambda: delta_tables.upsert(partial, current, ["device_id"], "app", 1)) > 2
    got = DeltaTable(current).to_pyarrow_table().sort_by("device_id").to_pylist()
    assert [(r["device_id"], r["status"], r["v"]) for r in got] == [
        ("d0", "ok", 0.0), ("d1", "ok", 1.0), ("d2", "ok", 102.0), ("d3", "ok", 103.0),
        ("d4", None, 104.0), ("d5", None, 105.0)]
    monkeypatch.setattr(delta_txn, "WHOLE_REWRITE_MAX_BYTES", 0)
    assert jobs_of(spark, lambda: delta_tables.upsert(devices(spark, range(1), 7), current,
                                                      ["device_id"], "app", 2)) > 2
    assert DeltaTable(current).to_pyarrow_table().num_rows == 6


def test_a_compaction_during_a_whole_table_upsert_is_retried(spark, current: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction that commits between the upsert's read and its commit conflicts with it (the
    whole table was read): the upsert retries on the compacted table and loses nothing."""
    for batch in range(3):  # three files to compact
        delta_tables.append(devices(spark, range(batch, batch + 1), 0), current, "app", batch)
    start, compacted = delta_txn._start, []

    def start_then_compact(df, path):
        txn = start(df, path)
        if not compacted:
            spark.sql(f"OPTIMIZE delta.`{path}`").collect()
            compacted.append(DeltaTable(path).history(1)[0]["operation"])
        return txn

    monkeypatch.setattr(delta_txn, "_start", start_then_compact)
    delta_tables.upsert(devices(spark, range(2, 4), 10), current, ["device_id"], "app", 3)
    assert compacted == ["OPTIMIZE"]
    got = DeltaTable(current).to_pyarrow_table()
    assert got.num_rows == 4  # not the compacted file's rows beside the rewritten ones
    assert dict(zip(got.column("device_id").to_pylist(), got.column("v").to_pylist(), strict=True)) == {
        "d0": 0.0, "d1": 1.0, "d2": 12.0, "d3": 13.0}
    assert [h["operation"] for h in DeltaTable(current).history(2)] == ["WRITE", "OPTIMIZE"]


def test_a_large_arrow_table_is_converted_by_the_tasks_in_as_many_files(spark, tmp_path: Path) -> None:
    """``arrow_frame``: a small table becomes a local relation as pyspark makes it; a large one
    reaches the tasks as Arrow batches (not rows built by the driver), coalesced to the
    session's parallelism: the same rows, written in as many files as a local relation gives."""
    from lakehouse.spark import ARROW_RDD_ROWS, arrow_frame

    def plan(df) -> str:
        return df._jdf.queryExecution().optimizedPlan().toString()

    small = pa.table({"id": pa.array(range(100), pa.int64())})
    assert "LocalRelation" in plan(arrow_frame(spark, small))
    n = ARROW_RDD_ROWS + 30_001  # several of pyspark's Arrow batches (10,000 rows each)
    large = pa.table({"id": pa.array(range(n), pa.int64()),
                      "name": pa.array([f"d-{i % 97}" for i in range(n)])})
    df = arrow_frame(spark, large)
    assert "LocalRelation" not in plan(df)
    assert spark.conf.get("spark.sql.execution.arrow.localRelationThreshold") != "0"  # restored
    path = str(tmp_path / "t")
    delta_tables.append(df, path, "arrow-test", 0)
    dt = DeltaTable(path)
    assert len(dt.file_uris()) == spark.sparkContext.defaultParallelism
    got = dt.to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(n))
    assert got.column("name").to_pylist() == [f"d-{i % 97}" for i in range(n)]
