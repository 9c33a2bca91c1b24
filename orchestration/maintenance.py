"""Table maintenance with delta-spark: compaction (OPTIMIZE / ZORDER BY), retention, vacuum,
restore, history.

Streaming sinks commit a few small files per micro-batch, and scan time grows with file count, so
``compact`` bin-packs them (and Z-orders tables queried by device and time). OPTIMIZE commits
carry ``dataChange=false``: Delta's streaming source skips them, so rewritten rows are never
delivered twice. Every operation plans from the latest snapshot and does nothing when there is
nothing to do, so a retried task is harmless; commit conflicts with the live streams are retried
(``delta_tables.retry_conflicts``).

Z-order, not liquid clustering: clustering raises every table to writer protocol 7 (the
``clustering`` and ``domainMetadata`` features; delta-rs still reads it) and did not beat
Z-order or plain bin-packing for the delta-rs + DuckDB readers in ``bench/compaction.py``. Cheap look-ups (does the table exist, its files, the version at a time)
go through delta-rs (``lakehouse.delta.read``), without a JVM.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lakehouse.delta.read import open_table, partition_minutes, table_exists
from lakehouse.delta.tables import retry_conflicts
from lakehouse.settings import MIN_RETENTION_HOURS, Settings
from lakehouse.spark import session_confs
from lakehouse.tables import (
    PARTITION_COLUMN,
    RETENTION_COLUMNS,
    TABLES,
    bucket_start,
    bucket_text,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable as RsTable
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Tables read by device over a time range: Z-ordering co-locates rows so file skipping works.
ZORDER_COLUMNS: dict[str, tuple[str, str]] = {
    "silver": ("device_id", "event_time"),
    "gold_metrics_1m": ("device_id", "window_start"),
    "gold_metrics_5m": ("device_id", "window_start"),
    "gold_metrics_1m_final": ("device_id", "window_start"),
    "gold_metrics_5m_final": ("device_id", "window_start"),
    "readings_scored": ("device_id", "event_time"),
    "anomalies": ("device_id", "event_time"),
}

#: Z-order rewrites the whole table, so it runs only when not-yet-compacted small files hold at
#: least this share of the bytes; otherwise plain bin-packing (which leaves big files alone).
ZORDER_MIN_FRACTION = 0.1


def session(settings: Settings) -> SparkSession:
    """The active Spark session, else a local one for this command (a CLI run, a DAG task)."""
    from pyspark.sql import SparkSession

    from lakehouse.spark import spark_session

    return SparkSession.getActiveSession() or spark_session(settings, app_name="iotlake-maintenance", batch=True)


def resolve_tables(settings: Settings, tables: Iterable[str] | None = None) -> list[str]:
    """Named tables (validated), or every known table that exists under ``settings``."""
    if not tables:
        return [t for t in TABLES if table_exists(settings.table_path(t))]
    names = list(dict.fromkeys(tables))
    unknown = [t for t in names if t not in TABLES]
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(map(repr, unknown))}; "
                         f"valid tables: {', '.join(TABLES)}")
    return names


def _existing(settings: Settings, table: str) -> str:
    resolve_tables(settings, [table])
    path = settings.table_path(table)
    if not table_exists(path):
        raise ValueError(f"table {table!r} does not exist yet at {path}")
    return path


def _retry(op: Callable[[], T], what: str) -> T:
    return retry_conflicts(op, what)


def _files(path: str) -> dict[str, int]:
    """Current data files -> size (delta-rs: no Spark job for it)."""
    adds = open_table(path).get_add_actions(flatten=True)
    return dict(zip(adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist(), strict=True))


def _compact_table(spark: SparkSession, path: str, table: str, target_size: int,
                   zorder: bool, small_size: int) -> dict[str, Any]:
    from delta.tables import DeltaTable

    rs = open_table(path)
    version_before, sizes = rs.version(), list(_files(path).values())
    cols = ZORDER_COLUMNS.get(table) if zorder else None
    if cols and not set(cols) <= set(rs.schema().to_arrow().names):
        cols = None
    small = [s for s in sizes if s < small_size]
    mode = "zorder" if cols and len(small) > 1 and sum(small) >= ZORDER_MIN_FRACTION * sum(sizes) \
        else "compact"
    # files below minFileSize are candidates; bins are filled up to maxFileSize
    with session_confs(spark, {"spark.databricks.delta.optimize.maxFileSize": str(target_size),
                               "spark.databricks.delta.optimize.minFileSize": str(max(1, small_size))}):
        opt = DeltaTable.forPath(spark, path).optimize()
        result = opt.executeZOrderBy(*cols) if mode == "zorder" and cols else opt.executeCompaction()
    row = result.collect()[0].asDict(recursive=True)
    metrics = row.get("metrics") or {}
    after = open_table(path).version()
    changed = after != version_before and bool(metrics.get("numFilesRemoved"))
    return {"table": table, "mode": mode if changed else "noop", "files_before": len(sizes),
            "files_after": len(_files(path)), "files_removed": metrics.get("numFilesRemoved", 0),
            "files_added": metrics.get("numFilesAdded", 0), "version": after}


def compact(settings: Settings, tables: list[str] | None = None, target_size: int | None = None,
            zorder: bool | None = None, small_size: int | None = None) -> list[dict[str, Any]]:
    """Bin-pack small files (Z-order where it pays) per table; returns per-table stats.

    Files under ``small_size`` (default half the target) are packed into files of up to
    ``target_size``; bigger ones stay. ``target_size`` and ``zorder`` default to
    ``settings.maintenance``.
    """
    size = target_size or settings.maintenance.target_file_size
    small = small_size or size // 2
    use_z = settings.maintenance.zorder if zorder is None else zorder
    out: list[dict[str, Any]] = []
    spark = None
    for table in resolve_tables(settings, tables):
        path = settings.table_path(table)
        if not table_exists(path):
            out.append({"table": table, "mode": "missing"})
            continue
        spark = spark or session(settings)
        stats = _retry(lambda p=path, t=table, sp=spark: _compact_table(sp, p, t, size, use_z, small),
                       f"compact {table}")
        log.info("compact %s: %s", table, stats)
        out.append(stats)
    return out


def effective_retention(settings: Settings, requested: float | None = None,
                        enforce_retention_duration: bool = True) -> float:
    """Requested retention, or the configured one; below ``MIN_RETENTION_HOURS`` only when not
    enforced or when ``maintenance.allow_short_retention`` says so."""
    m = settings.maintenance
    hours = m.vacuum_retention_hours if requested is None else requested
    if requested is None and m.allow_short_retention:
        return hours
    if hours < 0:
        raise ValueError(f"retention must be >= 0 hours, got {hours}")
    if hours < MIN_RETENTION_HOURS and enforce_retention_duration:
        raise ValueError(
            f"retention {hours} h is below the {MIN_RETENTION_HOURS} h minimum: a query or a "
            "backfill reading the table could lose files. Use a larger value, or force it "
            "(--force) only when nothing reads older versions.")
    return hours


_UNIT_HOURS = {"week": 168.0, "day": 24.0, "hour": 1.0, "minute": 1 / 60, "second": 1 / 3600,
               "millisecond": 1 / 3_600_000, "microsecond": 1 / 3_600_000_000}


def interval_hours(interval: str) -> float:
    """Hours of a Delta interval property (``interval 7 days``, ``interval 10080 minutes``)."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(week|day|hour|minute|second|millisecond|microsecond)s?",
                       interval.lower())
    if not parts:
        raise ValueError(f"not a Delta interval: {interval!r}")
    return sum(float(n) * _UNIT_HOURS[u] for n, u in parts)


#: Delta's retention properties and their defaults (hours) when a table does not set them
_RETENTION_DEFAULTS = {"delta.deletedFileRetentionDuration": 7 * 24.0,
                       "delta.logRetentionDuration": 30 * 24.0}


def _retention_hours(dt: RsTable, key: str) -> float:
    value = dt.metadata().configuration.get(key)
    return interval_hours(value) if value else _RETENTION_DEFAULTS[key]


def _quoted(path: str) -> str:
    return "delta.`" + path.replace("`", "``") + "`"


def vacuum(settings: Settings, tables: list[str] | None = None, retention_hours: float | None = None,
           dry_run: bool = False, enforce_retention_duration: bool = True,
           lite: bool = False) -> list[dict[str, Any]]:
    """Delete data files that no version within the table's retention references.

    Full (default): lists the table's directory, so files of writes that never committed go too,
    and reports what it deletes (a dry run first). ``lite``: only files the Delta log removed
    (compaction, retention deletes), found in the log without listing; no report (``deleted``
    None). The built-in upkeep runs lite, the DAG and the CLI full.

    Retention is the table's ``delta.deletedFileRetentionDuration`` (iotlake creates tables with
    ``maintenance.vacuum_retention_hours``): Delta 4 ignores ``RETAIN`` except 0 hours, and
    reads a fractional one as 0. So ``retention_hours`` may be 0 (forced: every unreferenced
    file) or the table's own value; any other value is refused with how to change it.
    """
    hours = effective_retention(settings, retention_hours, enforce_retention_duration)
    out: list[dict[str, Any]] = []
    spark = None
    for table in resolve_tables(settings, tables):
        path = settings.table_path(table)
        if not table_exists(path):
            out.append({"table": table, "deleted": [], "status": "missing"})
            continue
        dt = open_table(path)
        kept = _retention_hours(dt, "delta.deletedFileRetentionDuration")
        lagging = _lagging_reader(settings, table, dt, 0 if retention_hours == 0 else kept)
        if lagging is not None:  # it still reads files later commits removed
            log.info("vacuum %s: a stream has yet to read version %d, past the retention: "
                     "vacuumed once it catches up", table, lagging)
            out.append({"table": table, "deleted": [], "status": "stream_lagging",
                        "needed_version": lagging})
            continue
        if retention_hours not in (None, 0) and not math.isclose(hours, kept):
            raise ValueError(
                f"{table} keeps removed files {kept:g} h (delta.deletedFileRetentionDuration), "
                f"and Delta takes vacuum's retention from that property: to keep {hours:g} h, "
                f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.deletedFileRetentionDuration' "
                f"= 'interval {round(hours * 60)} minutes'), or leave --retention-hours out")
        spark = spark or session(settings)
        forced = retention_hours == 0
        # our own check above is the policy; Delta's duplicate check only when enforcing. The
        # file listing runs parallelPartitionDiscovery.parallelism tasks (10,000 by default:
        # minutes of task overhead for a small table); one per core is plenty.
        confs = {"spark.databricks.delta.retentionDurationCheck.enabled": str(not forced).lower(),
                 "spark.sql.sources.parallelPartitionDiscovery.parallelism":
                 str(max(2, spark.sparkContext.defaultParallelism))}
        sql = f"VACUUM {_quoted(path)}{' RETAIN 0 HOURS' if forced else ''}{' LITE' if lite else ''}"
        listed = None
        with session_confs(spark, confs):
            if dry_run or not lite:
                listed = _retry(lambda s=sql, sp=spark: [r[0] for r in sp.sql(s + " DRY RUN").collect()],
                                f"vacuum {table}")
            if not dry_run and (listed is None or listed):
                try:
                    _retry(lambda s=sql, sp=spark: sp.sql(s).collect(), f"vacuum {table}")
                except Exception as e:  # noqa: BLE001 - py4j: match Delta's error class by name
                    # LITE needs the log back to the last vacuum; log clean-up (clean_log)
                    # may have removed it: this once, the full vacuum lists the directory
                    if not lite or "DELTA_CANNOT_VACUUM_LITE" not in str(e):
                        raise
                    log.info("vacuum %s: the Delta log no longer reaches the last vacuum; full vacuum", table)
                    full = sql.removesuffix(" LITE")
                    _retry(lambda s=full, sp=spark: sp.sql(s).collect(), f"vacuum {table}")
        deleted = None if listed is None else sorted(_relative(path, f) for f in listed)
        effective = 0 if forced else kept
        log.info("vacuum %s (%s, %g h, dry_run=%s): %s files", table, "lite" if lite else "full",
                 effective, dry_run, "?" if deleted is None else len(deleted))
        out.append({"table": table, "retention_hours": effective, "dry_run": dry_run, "lite": lite,
                    "deleted": deleted, "version": open_table(path).version()})
    return out


def expiry(settings: Settings, table: str, now: datetime) -> tuple[datetime, str, bool]:
    """(boundary, predicate, whole partitions): retention deletes the rows before the boundary,
    with this DELETE predicate. A time-partitioned table loses whole partitions (the boundary is
    the start of the cutoff's bucket): the DELETE only removes files, and it does not conflict
    with streams appending to newer partitions. An unpartitioned table is deleted to the cutoff
    by its time column, which conflicts with every concurrent append (retried next pass)."""
    cutoff = now - timedelta(days=settings.maintenance.retention_days[table])
    minutes = partition_minutes(settings.table_path(table))
    if minutes:
        return bucket_start(cutoff, minutes), f"`{PARTITION_COLUMN}` < '{bucket_text(cutoff, minutes)}'", True
    literal = cutoff.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return cutoff, f"`{RETENTION_COLUMNS[table]}` < to_timestamp('{literal}')", False


def retain(settings: Settings, tables: list[str] | None = None,
           now: datetime | None = None) -> list[dict[str, Any]]:
    """Delete the rows past each table's ``maintenance.retention_days`` by its time column
    (``RETENTION_COLUMNS``; whole partitions where the table is time-partitioned, see
    ``expiry``); tables without a retention are left alone. The streams reading these tables
    skip the delete commits (``skipChangeCommits``); vacuum frees the bytes later."""
    days = settings.maintenance.retention_days
    now = now or datetime.now(UTC)
    out: list[dict[str, Any]] = []
    spark = None
    for table in resolve_tables(settings, tables):
        if table not in days:
            continue
        path = settings.table_path(table)
        if not table_exists(path):
            out.append({"table": table, "status": "missing"})
            continue
        spark = spark or session(settings)
        boundary, predicate, whole = expiry(settings, table, now)
        sql = f"DELETE FROM {_quoted(path)} WHERE {predicate}"
        rows = _retry(lambda s=sql, sp=spark: sp.sql(s).collect(), f"retain {table}")
        deleted = int(rows[0][0]) if rows and rows[0][0] is not None else 0
        log.info("retain %s: %d rows before %s deleted", table, deleted, boundary.isoformat())
        out.append({"table": table, "cutoff": boundary.isoformat(), "partitions": whole,
                    "deleted_rows": deleted, "version": open_table(path).version()})
    return out


_VERSION_FILE = re.compile(r"^\.?(\d{20})\.")


def clean_log(settings: Settings, tables: list[str] | None = None) -> dict[str, int]:
    """Delete each table's Delta log files older than its ``delta.logRetentionDuration`` that
    precede its latest checkpoint (delta-rs: to the minute; delta-spark's own clean-up at
    checkpoints only removes commits from before the day the cutoff falls in, so a busy table
    held a day of commits more than its retention). On a local data root, also the checksum
    files left beside them (Delta's ``N.crc``, Hadoop's hidden ``.N.json.crc``). Returns the
    number of files deleted per table.

    A table one of this lake's streams has yet to read from a commit past that retention (a
    run stopped for longer) keeps its whole log until the stream has caught up: a Delta source
    cannot skip a missing commit. Delta's own clean-up at log checkpoints, which knows nothing
    of the streams, is off on the tables iotlake creates (``lakehouse.spark``)."""
    out: dict[str, int] = {}
    for table in resolve_tables(settings, tables):
        path = settings.table_path(table)
        dt = open_table(path)
        lagging = _lagging_reader(settings, table, dt, _retention_hours(dt, "delta.logRetentionDuration"))
        if lagging is not None:
            log.info("%s: a stream has yet to read version %d, past the log retention: its Delta "
                     "log is kept until the stream catches up", table, lagging)
            out[table] = 0
            continue
        log_dir = Path(path, "_delta_log")
        before = None if settings.remote else sum(1 for _ in log_dir.iterdir())
        dt.cleanup_metadata()
        if before is None:
            continue
        names = [p.name for p in log_dir.iterdir()]
        kept = [int(m.group(1)) for n in names if n.endswith(".json") and (m := _VERSION_FILE.match(n))]
        first = min(kept, default=0)
        old = [n for n in names if (m := _VERSION_FILE.match(n)) and int(m.group(1)) < first]
        for n in old:  # Delta's version checksums
            if n.endswith(".crc") and not n.startswith("."):
                (log_dir / n).unlink(missing_ok=True)
        for n in old:  # Hadoop's checksum sidecars of files now gone
            if n.startswith(".") and not (log_dir / n[1:].removesuffix(".crc")).exists():
                (log_dir / n).unlink(missing_ok=True)
        out[table] = before - sum(1 for _ in log_dir.iterdir())
    return out


#: a commit this close to a retention's cutoff counts as past it (the clean-up runs later);
#: at most a tenth of the retention
_CUTOFF_MARGIN = timedelta(minutes=2)


def _lagging_reader(settings: Settings, table: str, dt: RsTable, retention_hours: float) -> int | None:
    """The version of ``table`` (open as ``dt``) a stream of this lake has yet to read when its
    commit is older than (or close to) ``retention_hours``, else None: log clean-up would delete
    that commit, vacuum the files it and later commits added."""
    from orchestration.backfill import unread_version

    path = settings.table_path(table)
    need = unread_version(settings, table)
    if need is None or need > dt.version():
        return None
    retention = timedelta(hours=retention_hours)
    cutoff = datetime.now(UTC) - retention + min(_CUTOFF_MARGIN, retention / 10)
    commit = Path(path, "_delta_log", f"{need:020d}.json")
    if not settings.remote:  # delta-rs's clean-up goes by the commit file's modification time
        try:
            committed = datetime.fromtimestamp(commit.stat().st_mtime, UTC)
        except FileNotFoundError:
            return None  # already gone: nothing left to keep for it
    else:
        try:
            committed = datetime.fromtimestamp(_load_at(path, table, need).history(1)[0]["timestamp"] / 1000, UTC)
        except ValueError:
            return None
    return need if committed < cutoff else None


def oldest(settings: Settings, table: str) -> datetime | None:
    """The oldest value of the table's retention column, from Delta's file statistics (no scan):
    None when the table has no rows, ``datetime.min`` when a file has no statistics on it."""
    adds = open_table(settings.table_path(table)).get_add_actions(flatten=True)
    if adds.num_rows == 0:
        return None
    col = f"min.{RETENTION_COLUMNS[table]}"
    values = adds.column(col).to_pylist() if col in adds.column_names else [None]
    if any(v is None for v in values):
        return datetime.min.replace(tzinfo=UTC)
    return min(v if v.tzinfo else v.replace(tzinfo=UTC) for v in values)


def small_files(settings: Settings, table: str, limit: int) -> int:
    """Data files under ``limit`` bytes (what compaction would bin-pack)."""
    return sum(1 for size in _files(settings.table_path(table)).values() if size < limit)


def _relative(table_path: str, file: str) -> str:
    """A file's path relative to the table (VACUUM lists absolute URIs)."""
    for prefix in (table_path.rstrip("/") + "/", "file:" + table_path.rstrip("/") + "/"):
        if file.startswith(prefix):
            return file[len(prefix):]
    return file


def _load_at(path: str, table: str, target: int | datetime) -> RsTable:
    """The table at a version, or at the version current at a time (an error before creation;
    delta-rs would silently pick version 0)."""
    dt = open_table(path)
    try:
        dt.load_as_version(target)
    except Exception as e:  # delta-rs raises several types for out-of-range targets
        raise ValueError(f"{table}: no version {target}: {e}") from e
    if isinstance(target, datetime):
        committed = datetime.fromtimestamp(dt.history(1)[0]["timestamp"] / 1000, UTC)
        if committed > target:
            raise ValueError(f"{table}: no version at {target.isoformat()}; the oldest "
                             f"readable version {dt.version()} is from {committed.isoformat()}")
    return dt


def parse_timestamp(value: str) -> datetime:
    """ISO 8601; a timestamp without zone is UTC."""
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"timestamp {value!r} is not ISO 8601 (e.g. 2024-05-01T12:00:00Z)") from None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def _paths(dt: RsTable) -> set[str]:
    return set(dt.get_add_actions(flatten=True).column("path").to_pylist())


def restore(settings: Settings, table: str, version: int | None = None,
            timestamp: str | None = None) -> dict[str, Any]:
    """Make the table's current state equal an older version (a new commit; history is kept).

    Restore is a data change: streams reading this table re-read the re-added files and do not
    see the removals, so reprocess downstream layers afterwards. A no-op when already equal. A
    timestamp resolves to the version current then (as ``version_at``), so a retry restores
    the same version.
    """
    from delta.tables import DeltaTable

    if (version is None) == (timestamp is None):
        raise ValueError("restore needs exactly one of version or timestamp")
    path = _existing(settings, table)
    target: int | datetime = version if version is not None else parse_timestamp(timestamp or "")
    spark = None

    def run() -> dict[str, Any]:
        nonlocal spark
        dt, old = open_table(path), _load_at(path, table, target)
        if _paths(dt) == _paths(old) and dt.schema().to_json() == old.schema().to_json():
            return {"table": table, "restored_to": old.version(), "version": dt.version(),
                    "noop": True}
        spark = spark or session(settings)
        try:
            row = DeltaTable.forPath(spark, path).restoreToVersion(old.version()).collect()[0]
        except Exception as e:  # noqa: BLE001 - py4j: match Delta's error class by name
            if "DELTA_CANNOT_RESTORE_FILES_MISSING" not in str(e) and "missing" not in str(e).lower():
                raise
            raise ValueError(f"{table}: version {old.version()} references files vacuum already "
                             f"deleted (older than the retention); pick a newer version") from None
        return {"table": table, "restored_to": old.version(), "version": open_table(path).version(),
                "noop": False, **row.asDict()}

    return _retry(run, f"restore {table}")


def version_at(settings: Settings, table: str, timestamp: datetime) -> int:
    """The table version current at ``timestamp``: pins a scheduled job to a reproducible state."""
    return _load_at(_existing(settings, table), table, timestamp).version()


def table_history(settings: Settings, table: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Commits, newest first (version, timestamp, operation, parameters, metrics...)."""
    from delta.tables import DeltaTable

    path = _existing(settings, table)
    spark = session(settings)
    dt = DeltaTable.forPath(spark, path)
    rows = (dt.history(limit) if limit else dt.history()).collect()
    return [{k: v for k, v in r.asDict(recursive=True).items() if v is not None} for r in rows]
