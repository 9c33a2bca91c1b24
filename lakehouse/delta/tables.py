"""Creating and writing Delta tables with delta-spark, exactly once per streaming micro-batch.

The one place tables are written: ``append`` (a DataFrame), ``append_table`` (an Arrow table
the driver holds), ``upsert``, ``upsert_recent`` and ``replace_whole``. Each takes a fast path
where it applies (``lakehouse.delta.txn``: Delta's transaction API without the log replay of
its commands; the non-public Delta classes it calls are listed there) and Delta's own command
otherwise. A write that falls back is counted (``iotlake_delta_fallback_writes_total``, by
write) and logged once per table and write.

A ``foreachBatch`` function that writes several tables passes the streaming query's id and the
batch id to every write: writes through Delta's transaction API (``delta_txn``: appends, and
upserts of tables whose checksum lists their files) commit them as a ``SetTransaction``, the
DataFrame writer takes them as ``txnAppId`` / ``txnVersion`` options, MERGEs through the
session's ``spark.databricks.delta.write.txnAppId`` / ``txnVersion`` (the only form DML takes
them in). Delta records them in the commit and skips a
write whose (app id, version) the table already holds, so a batch Spark replays after a crash
writes nothing twice. The transaction state is per table: one id pair serves every table a
batch writes.

Tables are created with Delta features that delta-rs reads too (no deletion vectors, classic
checkpoints), so the dashboard, DuckDB and Polars read what the streams write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

import pyarrow as pa
from prometheus_client import Counter
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from lakehouse.delta import txn as delta_txn
from lakehouse.delta.read import open_table, table_exists
from lakehouse.settings import Settings
from lakehouse.spark import arrow_frame, session_confs
from lakehouse.tables import STATS_COLUMNS_PROPERTY, column_properties, time_partitioning

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A table at most this large is rewritten whole by ``replace_whole`` (from ``delta_txn``).
WHOLE_REWRITE_MAX_BYTES = delta_txn.WHOLE_REWRITE_MAX_BYTES
FALLBACKS = Counter("iotlake_delta_fallback_writes",
                    "writes that took Delta's own command because the fast path did not apply", ["write"])
_logged: set[tuple[str, str]] = set()  # (write, path) whose fallback was logged

#: Properties every iotlake table is created with (readers without a JVM read them all).
TABLE_PROPERTIES = {
    "delta.enableDeletionVectors": "false",
    "delta.checkpointPolicy": "classic",
}


def spark_schema(schema: pa.Schema | StructType) -> StructType:
    return schema if isinstance(schema, StructType) else from_arrow_schema(schema)


def ensure_table(spark: SparkSession, path: str, schema: pa.Schema | StructType,
                 partition_by: Sequence[str] = (), properties: dict[str, str] | None = None,
                 generated: dict[str, str] | None = None,
                 extra_columns: dict[str, str] | None = None) -> None:
    """Create the table at ``path`` if it does not exist, empty, with ``schema`` (idempotent,
    safe against a concurrent creator). ``generated``: string columns Delta computes from this
    SQL expression at every write; ``extra_columns``: name -> SQL type, filled by the writer
    (both from ``lakehouse.tables.time_partitioning``)."""
    from delta.tables import DeltaTable

    if DeltaTable.isDeltaTable(spark, path):
        return
    b = DeltaTable.createIfNotExists(spark).location(path).addColumns(spark_schema(schema))
    for name, expr in (generated or {}).items():
        b = b.addColumn(name, "STRING", generatedAlwaysAs=expr)
    for name, sql_type in (extra_columns or {}).items():
        b = b.addColumn(name, sql_type)
    if partition_by:
        b = b.partitionedBy(*partition_by)
    for k, v in {**TABLE_PROPERTIES, **(properties or {})}.items():
        b = b.property(k, v)
    retry_conflicts(b.execute, f"create {path}")


def ensure_named_table(spark: SparkSession, settings: Settings, table: str,
                       schema: pa.Schema | StructType, generated: bool = True) -> None:
    """``ensure_table`` for one of the lakehouse's tables at its place under ``settings``: a
    table retention can expire is partitioned by the time bucket of its retention column
    (``generated=False``: its writer computes the bucket), with the column properties of
    ``tables.column_properties``. A table created before iotlake chose one gets it once."""
    path = settings.table_path(table)
    props = column_properties(table, settings.telemetry)
    if table_exists(path):
        if props:
            _add_column_properties(spark, path, props)
        return
    part = time_partitioning(table, settings.maintenance.partition_minutes, generated)
    ensure_table(spark, path, schema, partition_by=part.get("partition_by", ()),
                 generated=part.get("generated"), extra_columns=part.get("extra_columns"),
                 properties={**part.get("properties", {}), **props})


def _add_column_properties(spark: SparkSession, path: str, props: dict[str, str]) -> None:
    """Set the column properties a table lacks, in one commit (files written before keep their
    statistics and encodings); statistics only on columns the table has, and never renamed once
    set (Delta's default was the first 32 columns)."""
    rs = open_table(path)
    have = rs.metadata().configuration
    missing = {k: v for k, v in props.items() if k not in have}
    if STATS_COLUMNS_PROPERTY in missing:
        cols = set(rs.schema().to_arrow().names)
        missing[STATS_COLUMNS_PROPERTY] = ",".join(
            c for c in missing[STATS_COLUMNS_PROPERTY].split(",") if c in cols)
    if not missing:
        return
    pairs = ", ".join(f"'{k}' = '{v}'" for k, v in missing.items())
    retry_conflicts(lambda: spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({pairs})"),
                    f"set the column properties of {path}")
    log.info("%s: %s from now on", path, pairs)


def add_missing_columns(spark: SparkSession, path: str, schema: pa.Schema | StructType) -> list[str]:
    """Add the columns of ``schema`` the table lacks (nullable: older rows read null); columns
    the table has beyond ``schema`` stay. Returns the table's columns afterwards."""
    columns = spark.read.format("delta").load(path).columns
    have = {c.lower() for c in columns}
    new = [f for f in spark_schema(schema).fields if f.name.lower() not in have]
    if new:
        cols = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in new)
        retry_conflicts(lambda: spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({cols})"),
                        f"add columns to {path}")
        log.info("%s: added columns %s", path, [f.name for f in new])
    return columns + [f.name for f in new]


def append(df: DataFrame, path: str, app_id: str, batch_id: int, schema_evolution: bool = False) -> None:
    """Append ``df`` once for (``app_id``, ``batch_id``); a replayed batch is skipped by Delta.

    A plain append (no schema change) commits through Delta's transaction API
    (``delta_txn.append_once``); anything else through the DataFrame writer."""
    if not schema_evolution and _committed(lambda: delta_txn.append_once(df, path, app_id, batch_id),
                                           "append", path):
        return
    w = (df.write.format("delta").mode("append")
         .option("txnAppId", app_id).option("txnVersion", str(batch_id)))
    if schema_evolution:
        w = w.option("mergeSchema", "true")
    retry_conflicts(lambda: w.save(path), f"append to {path}")


def append_table(spark: SparkSession, table: pa.Table, path: str, app_id: str, batch_id: int) -> None:
    """``append`` of an Arrow table the driver holds: written by pyarrow and committed by
    Delta's transaction where the table allows (``delta_txn.append_table``), else through
    ``append``."""
    if _committed(lambda: delta_txn.append_table(spark, table, path, app_id, batch_id),
                  "append_table", path):
        return
    append(arrow_frame(spark, table), path, app_id, batch_id)


def upsert(df: DataFrame, path: str, keys: Sequence[str], app_id: str, batch_id: int,
           when_newer: str | None = None, within: str | None = None) -> None:
    """MERGE ``df`` into ``path`` on ``keys``: matched rows updated (only where the condition
    ``when_newer`` holds, e.g. ``"s.updated_at >= t.updated_at"``), the others inserted. One
    row per key in ``df``. Exactly once per (``app_id``, ``batch_id``).

    ``within``: a condition on target columns only (``t.``) that every matching row meets, e.g.
    a time range with literal bounds: Delta then reads only the files whose statistics can hold
    such rows instead of the whole table.

    A small table that ``df`` replaces rows of whole (every column, no condition) is rewritten
    through Delta's transaction API instead (``delta_txn.upsert_whole``): the same rows,
    without the log replay and joins of a MERGE."""
    from delta.tables import DeltaTable

    if when_newer is None and within is None and _committed(
            lambda: delta_txn.upsert_whole(df, path, keys, app_id, batch_id), "upsert", path):
        return

    on = " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in keys)
    if within:
        on = f"({within}) AND {on}"
    spark = df.sparkSession

    # the source's columns by name, not UPDATE/INSERT *: Delta computes generated columns
    # (``time_bucket``) the source does not carry, and * would require them
    cols = {f"`{c}`": f"s.`{c}`" for c in df.columns}

    def run() -> None:
        m = DeltaTable.forPath(spark, path).alias("t").merge(df.alias("s"), on)
        m = m.whenMatchedUpdate(condition=when_newer, set=cols)
        m.whenNotMatchedInsert(values=cols).execute()

    with_txn(spark, app_id, batch_id, lambda: retry_conflicts(run, f"merge into {path}"))


def upsert_recent(df: DataFrame, path: str, keys: Sequence[str], column: str, since: datetime,
                  app_id: str, batch_id: int, rows_per_file: int) -> None:
    """Upsert ``df`` (one row per key, every row's ``column`` >= ``since``) into a table whose
    rows only change at recent ``column`` values, e.g. event-time windows. Exactly once per
    (``app_id``, ``batch_id``).

    A MERGE rewrites each file holding a changed row whole, so the file the newest windows
    live in carries along every older window written with it and grows with every batch (a
    whole day partition's windows by evening). So this MERGEs only while the files holding rows
    at or after ``since`` have at most ``rows_per_file`` rows; past that, the rows from the
    oldest of those files on are replaced in one commit (Delta's ``replaceWhere``), written
    back sorted by ``column`` in files of at most ``rows_per_file`` rows: closed windows end up
    in files no later batch touches. A table without file statistics on ``column`` is MERGEd.

    While the table's checksum file lists its files (``delta_txn.replace_recent``), the files
    that may hold rows at or after ``since`` are rewritten that way at once, in two Spark jobs:
    a small MERGE's log replay and joins cost more than rewriting a few small files."""
    if _committed(lambda: delta_txn.replace_recent(df, path, keys, column, _aware(since), app_id,
                                                   batch_id, rows_per_file), "upsert_recent", path):
        return
    table_rs = open_table(path)
    recent = _recent_files(table_rs, column, since)
    if recent is None or recent[1] <= rows_per_file:
        upsert(df, path, keys, app_id, batch_id, within=f"t.`{column}` >= {timestamp_literal(since)}")
        return
    spark = df.sparkSession
    where = f"`{column}` >= {timestamp_literal(recent[0])}"
    # Delta computes these (e.g. the time bucket) from the rows written back
    generated = {f.name for f in table_rs.schema().fields if "delta.generationExpression" in f.metadata}

    def run() -> None:
        table = spark.read.format("delta").load(path)
        kept = table.where(where).join(df.select(*keys), list(keys), "left_anti")
        cols = [c for c in table.columns if c not in generated]
        rows = (kept.select(*cols).unionByName(df.select(*cols)).coalesce(1)
                .sortWithinPartitions(column))
        (rows.write.format("delta").mode("overwrite").option("replaceWhere", where)
         .option("maxRecordsPerFile", str(rows_per_file))
         .option("txnAppId", app_id).option("txnVersion", str(batch_id)).save(path))

    retry_conflicts(run, f"upsert into {path}")


def _recent_files(table_rs, column: str, since: datetime) -> tuple[datetime, int] | None:
    """(smallest ``column`` value, rows) of the files holding any row at or after ``since``
    (``since`` and 0 when none do); None when a file lacks statistics on ``column``.
    ``table_rs``: the table in delta-rs (file statistics without a Spark job)."""
    adds = table_rs.get_add_actions(flatten=True)
    if not adds.num_rows:
        return since, 0
    lo_name, hi_name = f"min.{column}", f"max.{column}"
    if lo_name not in adds.column_names or hi_name not in adds.column_names:
        return None
    cut, rows = since, 0
    for lo, hi, n in zip(adds.column(lo_name).to_pylist(), adds.column(hi_name).to_pylist(),
                         adds.column("num_records").to_pylist(), strict=True):
        if lo is None or hi is None:
            return None
        if _aware(hi) >= since:
            cut, rows = min(cut, _aware(lo)), rows + (n or 0)
    return cut, rows


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def timestamp_literal(t: datetime) -> str:
    """A Spark SQL timestamp literal (in a condition, Delta skips files by their statistics)."""
    return f"TIMESTAMP'{_aware(t).astimezone(UTC).isoformat()}'"


def with_txn(spark: SparkSession, app_id: str, batch_id: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` (DML: MERGE, DELETE, UPDATE) as the idempotent write of (app id, batch id).

    ``spark`` must be the micro-batch's own session (``df.sparkSession`` in foreachBatch): each
    streaming query runs in a session clone, so queries in other threads never see these confs.
    A batch's writes that run at once (``lakehouse.delta.concurrent_writes``) may hold one such write:
    the others commit through Delta's transaction API or carry the ids as writer options, which
    Delta takes over these confs.
    """
    with session_confs(spark, {"spark.databricks.delta.write.txnAppId": app_id,
                               "spark.databricks.delta.write.txnVersion": str(batch_id)}):
        return fn()


def replace_whole(spark: SparkSession, table: pa.Table, path: str, app_id: str, batch_id: int,
                  version: int) -> int | None:
    """Replace every row of the table at ``path`` with ``table`` (an Arrow table the driver
    holds) in one commit, exactly once per (``app_id``, ``batch_id``), if the table is still at
    ``version``, local and at most ``WHOLE_REWRITE_MAX_BYTES``: the version written. None where
    that does not apply (or the batch is committed already), for the caller to ``upsert``."""
    try:
        return retry_conflicts(lambda: delta_txn.replace_table(spark, table, path, app_id, batch_id, version),
                               f"replace_whole {path}")
    except delta_txn.SlowPath:
        _fell_back("replace_whole", path)
        return None


def can_replace_whole(path: str) -> bool:
    """Whether ``replace_whole`` may apply to the table at ``path`` (a local one)."""
    return delta_txn.local_table(path)


def _committed(write: Callable[[], None], what: str, path: str) -> bool:
    """Run a ``delta_txn`` write (conflicts retried); False if it does not apply
    (``SlowPath``), for the caller to write through Delta's commands instead."""
    try:
        retry_conflicts(write, f"{what} {path}")
        return True
    except delta_txn.SlowPath:
        _fell_back(what, path)
        return False


def _fell_back(what: str, path: str) -> None:
    """A write that takes Delta's own command: counted, and logged once per table and write."""
    FALLBACKS.labels(what).inc()
    if (what, path) not in _logged:
        _logged.add((what, path))
        log.info("%s %s: through Delta's own command (the fast path does not apply)", what, path)


def retry_conflicts(fn: Callable[[], T], what: str, attempts: int = 20) -> T:
    """Run a Delta commit, retrying the conflicts optimistic concurrency reports when another
    writer (compaction, a concurrent MERGE) committed first; anything else raises at once."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - py4j / captured exceptions: match on the name
            text = f"{type(e).__name__}: {e}"
            if attempt + 1 == attempts or not any(n in text for n in _CONFLICTS):
                raise
            log.info("%s: commit conflict (%s), retrying", what, text.splitlines()[0][:200])
            time.sleep(min(0.05 * 2 ** attempt, 2.0))
    raise AssertionError("unreachable")


_CONFLICTS = ("ConcurrentAppendException", "ConcurrentDeleteReadException",
              "ConcurrentDeleteDeleteException", "ConcurrentTransactionException",
              "ProtocolChangedException", "MetadataChangedException",
              "ConcurrentWriteException", "DELTA_CONCURRENT")
