"""Maintenance on real Delta tables with delta-spark (tables created by delta-spark as the
streams create them; the many small appends written quickly with delta-rs)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from fleets import SENSOR

from lakehouse.delta.read import commit_adds, read_table
from lakehouse.delta.tables import ensure_table
from lakehouse.settings import Settings, SettingsError, load_settings
from lakehouse.tables import silver_schema
from orchestration.maintenance import compact, restore, table_history, vacuum, version_at
from orchestration.maintenance_cli import register

SILVER = silver_schema(SENSOR)

APPENDS, ROWS = 60, 50
T0 = datetime(2024, 5, 1, tzinfo=UTC)


def silver_batch(i: int, rows: int = ROWS, devices: int = 20) -> pa.Table:
    """A deterministic micro-batch shaped like the silver stream's output."""
    n = range(i * rows, (i + 1) * rows)
    return pa.table({
        "event_id": [f"e{k:08d}" for k in n],
        "device_id": [f"dev-{k % devices:04d}" for k in n],
        "event_time": [T0 + timedelta(seconds=k * 7 % 86_400) for k in n],
        "temperature": [20 + k % 13 * 0.5 for k in n],
        "humidity": [40 + k % 17 * 1.0 for k in n],
        "battery": [100 - k % 50 * 1.0 for k in n],
        "status": ["ok"] * rows,
        "schema_version": [1] * rows,
        "extra": [None] * rows,
        "kafka_partition": [k % 2 for k in n],
        "kafka_offset": list(n),
        "ingest_time": [T0] * rows,
    }, schema=SILVER)


def build_silver(settings: Settings, appends: int = APPENDS) -> str:
    from pyspark.sql import SparkSession

    path = settings.table_path("silver")
    spark = SparkSession.getActiveSession()
    if spark is not None:  # created as the streams create it; else by the first append
        ensure_table(spark, path, SILVER)
    for i in range(appends):
        write_deltalake(path, silver_batch(i), mode="append")
    return path


def content(table: pa.Table) -> pa.Table:
    return table.sort_by([("event_id", "ascending")]).combine_chunks()


@pytest.fixture
def lake(tmp_path: Path, spark) -> Settings:
    return load_settings(environ={}, data_root=str(tmp_path / "lake"))


def test_compact_vacuum_restore_cycle(lake: Settings) -> None:
    path = build_silver(lake)
    before = content(read_table(path))
    assert len(DeltaTable(path).file_uris()) == APPENDS and before.num_rows == APPENDS * ROWS

    [stats] = compact(lake)  # default: every existing table, i.e. silver only
    assert stats["table"] == "silver" and stats["mode"] == "zorder"
    assert stats["files_before"] == APPENDS and stats["files_after"] <= 3
    assert stats["version"] == APPENDS + 1  # version 0 created the table, 1..60 were appends
    assert len(DeltaTable(path).file_uris()) == stats["files_after"]
    assert content(read_table(path)).equals(before)
    # The streaming source must not re-deliver compacted rows.
    assert commit_adds(path, stats["version"]) == []
    assert commit_adds(path, APPENDS - 1) != []
    # Older versions stay readable (their files are still there).
    assert read_table(path, version=9).num_rows == 9 * ROWS

    # Idempotent: nothing left to do, no new commit.
    [again] = compact(lake, ["silver"])
    assert again["mode"] == "noop" and again["version"] == stats["version"]
    assert compact(lake, ["silver"], zorder=False)[0]["mode"] == "noop"

    # Default retention (an hour) keeps the freshly replaced files.
    [vac] = vacuum(lake)
    assert vac["deleted"] == [] and vac["retention_hours"] == 1
    assert read_table(path, version=9).num_rows == 9 * ROWS
    with pytest.raises(ValueError, match="below the 1 h minimum"):
        vacuum(lake, retention_hours=0)
    with pytest.raises(ValueError, match="deletedFileRetentionDuration"):  # Delta would ignore it
        vacuum(lake, retention_hours=200)
    dry = vacuum(lake, retention_hours=0, dry_run=True, enforce_retention_duration=False)[0]
    assert len(dry["deleted"]) == APPENDS  # would delete the compacted-away files, but did not
    assert read_table(path, version=9).num_rows == 9 * ROWS

    # Restore to version 9, then retry it: the retry is a no-op.
    r = restore(lake, "silver", version=9)
    assert r["restored_to"] == 9 and not r["noop"] and r["version"] == stats["version"] + 1
    assert content(read_table(path)).equals(content(read_table(path, version=9)))
    # delta-spark sees the same rows as delta-rs
    from pyspark.sql import SparkSession

    via_spark = SparkSession.getActiveSession().read.format("delta").load(path).toArrow()
    assert content(via_spark.select(before.column_names)).equals(content(read_table(path)))
    r2 = restore(lake, "silver", version=9)
    assert r2["noop"] and r2["version"] == r["version"]
    hist = table_history(lake, "silver", limit=3)
    assert [h["operation"] for h in hist[:2]] == ["RESTORE", "OPTIMIZE"]
    files = len(DeltaTable(path).file_uris())
    [lite] = vacuum(lake, lite=True)  # from the log only: nothing past the retention yet
    assert lite["deleted"] is None and lite["lite"] and len(DeltaTable(path).file_uris()) == files
    assert read_table(path, version=9).num_rows == 9 * ROWS


def test_restore_by_timestamp_and_bad_input(lake: Settings) -> None:
    path = build_silver(lake, appends=3)
    r = restore(lake, "silver", timestamp=datetime.now(UTC).isoformat())
    assert r["noop"] and r["restored_to"] == 3
    assert version_at(lake, "silver", datetime.now(UTC) + timedelta(days=1)) == 3
    with pytest.raises(ValueError, match="no version at"):
        version_at(lake, "silver", T0)
    with pytest.raises(ValueError, match="no version at"):
        restore(lake, "silver", timestamp="2000-01-01T00:00:00")
    with pytest.raises(ValueError, match="exactly one"):
        restore(lake, "silver")
    with pytest.raises(ValueError, match="not ISO 8601"):
        restore(lake, "silver", timestamp="yesterday")
    with pytest.raises(ValueError, match="no version 99"):
        restore(lake, "silver", version=99)
    with pytest.raises(ValueError, match="valid tables: bronze, silver"):
        compact(lake, ["silverr"])
    with pytest.raises(ValueError, match="does not exist yet"):
        table_history(lake, "gold_metrics_1m")
    assert compact(lake, ["gold_metrics_1m"]) == [{"table": "gold_metrics_1m", "mode": "missing"}]
    assert len(DeltaTable(path).file_uris()) == 3


def test_settings_reject_short_retention() -> None:
    with pytest.raises(SettingsError, match="maintenance.vacuum_retention_hours"):
        load_settings(environ={}, maintenance={"vacuum_retention_hours": 0.5})


def _cli(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="iotlake")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args, settings)


def test_cli(lake: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    build_silver(lake, appends=4)
    assert _cli(lake, "compact", "--table", "silver", "--no-zorder") == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["mode"], row["files_before"], row["files_after"]) == ("compact", 4, 1)
    assert _cli(lake, "vacuum", "--dry-run") == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == []
    assert _cli(lake, "restore", "silver", "--version", "2") == 0
    assert json.loads(capsys.readouterr().out)["restored_to"] == 2
    assert _cli(lake, "history", "silver", "--limit", "2") == 0
    ops = [json.loads(line)["operation"] for line in capsys.readouterr().out.splitlines()]
    assert ops == ["RESTORE", "OPTIMIZE"]
    with pytest.raises(SystemExit) as exc:
        _cli(lake, "restore", "silver")  # needs --version or --timestamp
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="valid tables"):  # iotlake's main turns this into exit 2
        _cli(lake, "history", "nope")


def _bronze(settings: Settings, first: int, n: int, ingested: datetime) -> None:
    """One bronze commit of ``n`` valid readings (event ids from ``first``) ingested at ``ingested``."""
    from lakehouse.tables import BRONZE

    ids = range(first, first + n)
    values = [json.dumps({"schema_version": 1, "event_id": f"{i:032x}", "device_id": "dev-00001",
                          "ts": (ingested + timedelta(seconds=i)).isoformat().replace("+00:00", "Z"),
                          "temperature": 21.0, "humidity": 40.0, "battery": 90.0, "status": "ok"}).encode()
              for i in ids]
    write_deltalake(settings.table_path("bronze"), pa.table({
        "key": [None] * n, "value": values, "topic": ["telemetry"] * n, "partition": [0] * n,
        "offset": list(ids), "timestamp": [ingested] * n, "headers": [[]] * n,
        "ingest_time": [ingested] * n}, schema=BRONZE), mode="append")


def test_upkeep_expires_compacts_and_the_streams_skip_its_deletes(tmp_path: Path, spark) -> None:
    """``iotlake run``'s built-in upkeep: rows past their table's retention are deleted, a table
    with many small files is bin-packed, and silver, reading bronze as a stream, goes on past the
    delete without re-reading or losing a row."""
    import silver.stream
    from orchestration.upkeep import Upkeep

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"), telemetry=SENSOR.model_dump(mode="json"),
                      maintenance={"compact_min_files": 3, "retention_days": {"bronze": 1}})
    now = datetime.now(UTC)
    old, recent = now - timedelta(days=3), now - timedelta(hours=1)
    for k in range(3):
        _bronze(s, k * 10, 10, old)  # 30 rows past bronze's 1-day retention
    for k in range(3, 7):
        _bronze(s, k * 10, 10, recent)  # 4 files: still crowded (>= 3) once the old ones are gone

    def silver_catch_up() -> None:
        q = silver.stream.start(spark, s, trigger="available_now")
        q.awaitTermination(300)
        assert q.exception() is None

    silver_catch_up()
    assert read_table(s.table_path("silver")).num_rows == 70

    upkeep = Upkeep(s)
    assert upkeep.last_vacuum >= now  # a fresh data root: the first vacuum is one interval away
    upkeep.last_vacuum = now - timedelta(hours=s.maintenance.vacuum_interval_hours)  # due now
    done = upkeep.tick(now)
    assert [(r["table"], r["deleted_rows"]) for r in done["retained"]] == [("bronze", 30)]
    compacted = {c["table"]: c for c in done["compacted"]}
    assert compacted["bronze"]["files_after"] == 1  # silver too: its 2 day partitions, a file per batch
    assert set(done["vacuumed"]) >= {"bronze", "silver"}  # due (lite, an hour: none deleted)
    bronze = DeltaTable(s.table_path("bronze"))
    ops = [r["operation"] for r in bronze.history(4)]
    # expired partitions go first: compaction never rewrites rows about to be dropped
    assert ops == ["VACUUM END", "VACUUM START", "OPTIMIZE", "DELETE"]
    assert sorted(bronze.to_pyarrow_table(columns=["offset"]).column("offset").to_pylist()) == list(range(30, 70))
    again = upkeep.tick(now + timedelta(minutes=5))  # nothing left to do; vacuum not due yet
    assert again == {"retained": [], "compacted": []}

    _bronze(s, 70, 5, now)
    silver_catch_up()  # past the DELETE and OPTIMIZE commits: only the new rows
    ids = read_table(s.table_path("silver")).column("event_id").to_pylist()
    assert sorted(ids) == [f"{i:032x}" for i in range(75)]

    # the thread runs the same pass on its own, and stops when asked
    s.maintenance.check_seconds = 0.2
    running = Upkeep(s).start()
    deadline = datetime.now(UTC) + timedelta(seconds=120)
    while running.passes < 1 and datetime.now(UTC) < deadline:
        running._stop.wait(0.2)
    running.stop()
    assert running.passes >= 1


def test_upkeep_publishes_free_disk_and_warns_when_low(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Every pass publishes the data root's free disk; under ``min_free_disk_gb`` it warns with
    what to do (a full disk stops the embedded Kafka and fails every commit)."""
    import logging
    import shutil

    from orchestration.upkeep import DISK_FREE, Upkeep

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    s.root.mkdir(parents=True)
    free_gb = shutil.disk_usage(s.root).free / 2**30
    upkeep = Upkeep(s)
    s.maintenance.min_free_disk_gb = 0.0
    with caplog.at_level(logging.WARNING, logger="orchestration.upkeep"):
        assert upkeep.watch_disk() is None
        assert not caplog.records
        assert abs(DISK_FREE._value.get() / 2**30 - free_gb) < 1.0  # the same disk, a moment apart
        s.maintenance.min_free_disk_gb = free_gb + 1_000
        low = upkeep.watch_disk()
    assert low is not None and abs(low - free_gb) < 1.0
    [record] = caplog.records
    assert "min_free_disk_gb" in record.getMessage() and "retention_days" in record.getMessage()
    with pytest.raises(SettingsError, match="min_free_disk_gb"):
        load_settings(environ={}, maintenance={"min_free_disk_gb": -1})


def test_retention_drops_whole_partitions_while_a_stream_appends(tmp_path: Path, spark,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Tables retention can expire are partitioned by a time bucket Delta generates from their
    time column, so a retention DELETE names only old partitions: it removes whole files and
    commits at its first try while a stream appends every 200 ms (on an unpartitioned table the
    same DELETE conflicted with every append)."""
    import logging

    from pyspark.sql import functions as F

    from lakehouse.delta.tables import ensure_named_table
    from lakehouse.tables import BRONZE, PARTITION_COLUMN
    from orchestration.maintenance import retain

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"),
                      maintenance={"retention_days": {"bronze": 1}, "partition_minutes": 60})
    path = s.table_path("bronze")
    ensure_named_table(spark, s, "bronze", BRONZE)
    now = datetime.now(UTC)
    old = now - timedelta(days=2)
    spark.createDataFrame([(i, old + timedelta(minutes=i)) for i in range(90)],  # 2-3 hourly partitions
                          "offset long, ingest_time timestamp").write.format("delta").mode("append").save(path)
    live = (spark.readStream.format("rate").option("rowsPerSecond", 50).load()
            .select(F.col("value").alias("offset"), F.current_timestamp().alias("ingest_time"))
            .writeStream.format("delta").option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(processingTime="200 milliseconds").start(path))
    try:
        while len(DeltaTable(path).history()) < 6:  # the stream is committing
            live.awaitTermination(0.2)
        with caplog.at_level(logging.INFO, logger="lakehouse.delta.tables"):
            [done] = retain(s, ["bronze"], now=now)
            assert live.isActive
    finally:
        live.stop()
    assert (done["deleted_rows"], done["partitions"]) == (90, True)
    assert "commit conflict" not in caplog.text
    delete = next(c for c in DeltaTable(path).history() if c["operation"] == "DELETE")
    assert int(delete["operationMetrics"]["numAddedFiles"]) == 0  # whole files removed, none rewritten
    table = DeltaTable(path)
    assert table.metadata().partition_columns == [PARTITION_COLUMN]
    got = table.to_pyarrow_table(columns=["offset", "ingest_time", PARTITION_COLUMN])
    assert got.num_rows > 0 and min(got.column("ingest_time").to_pylist()) > now - timedelta(days=1)
    first = got.sort_by("offset").to_pylist()[0]
    assert first[PARTITION_COLUMN] == first["ingest_time"].strftime("%Y-%m-%d-%H00")


def expire_log(spark, path: str) -> Path:
    """Retentions of a minute on the table, and every log file an hour old: all of it expired."""
    import os
    import time

    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.logRetentionDuration' = "
              "'interval 1 minutes', 'delta.deletedFileRetentionDuration' = 'interval 1 minutes')")
    log_dir = Path(path, "_delta_log")
    hour_ago = time.time() - 3600
    for f in log_dir.iterdir():
        os.utime(f, (hour_ago, hour_ago))
    return log_dir


@pytest.fixture
def checkpoint_every_10(spark):
    """Tables created meanwhile take Delta's own log checkpoint interval (iotlake's is
    ``maintenance.log_checkpoint_commits``): checkpoints at versions 10 and 20."""
    from lakehouse.spark import session_confs

    with session_confs(spark, {"spark.databricks.delta.properties.defaults.checkpointInterval": "10"}):
        yield


def test_clean_log_keeps_what_a_lagging_stream_has_yet_to_read(tmp_path: Path, spark,
                                                               checkpoint_every_10) -> None:
    """A stream (the silver query, reading bronze) stopped past the retentions: bronze keeps its
    whole log, and is not vacuumed, until the stream has read it; then the expired commits go.
    Tables iotlake creates leave the log to this clean-up (Delta's own does not know the streams)."""
    from orchestration.maintenance import clean_log

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    path = s.table_path("bronze")
    ensure_table(spark, path, spark.range(1).schema)
    assert DeltaTable(path).metadata().configuration["delta.enableExpiredLogCleanup"] == "false"

    def drain() -> None:  # the silver query's checkpoint, as a real stream leaves it
        q = (spark.readStream.format("delta").load(path).writeStream.format("noop")
             .option("checkpointLocation", s.checkpoint_path("silver")).trigger(availableNow=True).start())
        q.awaitTermination()

    for i in range(3):
        spark.range(i, i + 1).write.format("delta").mode("append").save(path)
    drain()
    for i in range(3, 23):  # log checkpoints at 10 and 20, none of it read
        spark.range(i, i + 1).write.format("delta").mode("append").save(path)
    log_dir = expire_log(spark, path)
    before = sorted(p.name for p in log_dir.iterdir())
    assert clean_log(s, ["bronze"]) == {"bronze": 0}
    [vac] = vacuum(s, ["bronze"], lite=True)
    assert (vac["status"], vac["needed_version"]) == ("stream_lagging", 4)
    assert sorted(p.name for p in log_dir.iterdir()) == before
    drain()  # caught up: the stream needs nothing older
    assert clean_log(s, ["bronze"])["bronze"] > 0
    assert f"{5:020d}.json" not in {p.name for p in log_dir.iterdir()}
    assert spark.read.format("delta").load(path).count() == DeltaTable(path).to_pyarrow_table().num_rows == 23
    assert "status" not in vacuum(s, ["bronze"], lite=True)[0]


def test_clean_log_removes_expired_commits_and_their_checksums(tmp_path: Path, spark,
                                                              checkpoint_every_10) -> None:
    """Commits past the table's log retention that precede its latest checkpoint go, with the
    checksum files beside them; the table reads the same through delta-spark and delta-rs, and
    takes new commits. (Delta's own clean-up would keep them until the next calendar day.)"""
    from orchestration.maintenance import clean_log

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    path = s.table_path("quality_log")
    for i in range(23):  # log checkpoints at versions 10 and 20
        spark.range(i, i + 1).write.format("delta").mode("append").save(path)
    log_dir = expire_log(spark, path)
    assert clean_log(s, ["quality_log"])["quality_log"] > 0
    names = sorted(p.name for p in log_dir.iterdir() if p.is_file())
    versions = {int(n.lstrip(".")[:20]) for n in names if n.lstrip(".")[:20].isdigit()}
    assert min(versions) == 20 and f"{20:020d}.checkpoint.parquet" in names and f"{19:020d}.json" not in names
    assert spark.read.format("delta").load(path).count() == DeltaTable(path).to_pyarrow_table().num_rows == 23
    spark.range(99, 100).write.format("delta").mode("append").save(path)
    assert DeltaTable(path).to_pyarrow_table().num_rows == 24
    # LITE vacuum needs the log back to the last vacuum: without it, a full one runs instead
    [vac] = vacuum(s, ["quality_log"], lite=True)
    assert vac["lite"] and DeltaTable(path).history(2)[0]["operation"] == "VACUUM END"
