"""Appends and upserts through Delta's transaction API, without the log replay of Delta's commands.

Delta's DataFrame writer and MERGE rebuild a table's state from its log before they write: a
Spark job per commit, which on small tables is most of the write. Each commit here reads what
it needs from the version's checksum file instead (the table's app transactions, and for small
tables its data files: Delta lists them there up to 50 files), then writes and commits with
Delta's own ``OptimisticTransaction``: the same files, statistics, generated columns, conflict
checks and ``SetTransaction`` (exactly once per app id and batch) as Delta's commands. Arrow
tables the driver holds are written as Parquet by pyarrow instead (``lakehouse.delta.parquet_files``)
and committed the same way (``append_table``, ``replace_table``).

Each function raises ``SlowPath`` where it does not apply (the caller then uses Delta's own
command), and turns itself off for the process if Delta's API differs from delta-spark 4.4's.
Callers go through ``lakehouse.delta.tables``, the one module that writes tables.

This module is the only one that calls Delta's non-public classes, over py4j (each covered by
``tests/test_delta_tables.py`` against the pinned delta-spark): ``DeltaLog.forTable`` and
``startTransaction`` (an ``OptimisticTransaction``: ``metadata``, ``protocol``, ``snapshot``,
``txnVersion``, ``writeFiles``, ``readWholeTable``, ``registerSQLMetrics``, ``deltaLog``,
``commit``); a snapshot's ``checksumOpt`` (``allFiles``, ``setTransactions``,
``tableSizeBytes``) and ``version``; ``DeltaLog.createDataFrame``; ``actions.Action.fromJson``,
``actions.SetTransaction`` and an ``AddFile``'s ``remove``; ``DeltaOperations.Write``; Spark's
``SQLMetrics.createMetric``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from functools import reduce

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from lakehouse import storage
from lakehouse.delta import parquet_files
from lakehouse.spark import session_confs

log = logging.getLogger(__name__)

#: A table at most this large (bytes, per its checksum file) is rewritten whole by an upsert:
#: reading and writing it costs less than a MERGE's log replay and joins (measured up to
#: this size).
WHOLE_REWRITE_MAX_BYTES = 16 << 20


class SlowPath(Exception):
    """The fast write does not apply: use Delta's own command instead."""


enabled = True  # off for the process after Delta's API did not match (logged once)


def append_once(df: DataFrame, path: str, app_id: str, batch_id: int) -> None:
    """Delta's own write and commit (files, ``SetTransaction``, a WRITE in the history), minus
    the full log replay the DataFrame writer runs on every idempotent append to look the app id
    up: Delta 4.4 answers ``txnVersion`` from the snapshot's reconstructed state (a Spark job,
    about half a small append's cost), while the version's checksum file already lists the
    table's transactions. Only for data whose columns the table has with the same types."""
    with _api(df) as jvm:
        txn = _start(df, path)
        if not _fits(df.schema, txn.metadata()):
            raise SlowPath
        if _txn_version(jvm, txn, app_id) >= batch_id:
            return
        _commit(jvm, txn, txn.writeFiles(df._jdf), [], app_id, batch_id, _write(jvm, "Append"))


def append_table(spark: SparkSession, table: pa.Table, path: str, app_id: str, batch_id: int) -> None:
    """``append_once`` for an Arrow table the driver holds: its Parquet files written by pyarrow
    (``lakehouse.delta.parquet_files``, the statistics Delta would record), committed with Delta's
    transaction like Delta's own files. ``SlowPath`` for object storage (Spark's writer reaches
    it, with its credentials) and for tables whose writes need Delta's writer (``_file_plan``)."""
    if not local_table(path) or not table.num_rows:
        raise SlowPath
    with _api(spark) as jvm:
        txn = _start(spark, path)
        if not _fits(from_arrow_schema(table.schema), txn.metadata()):
            raise SlowPath
        if _txn_version(jvm, txn, app_id) >= batch_id:
            return
        _commit(jvm, txn, _file_actions(spark, txn, table, path), [], app_id, batch_id, _write(jvm, "Append"))


def replace_table(spark: SparkSession, table: pa.Table, path: str, app_id: str, batch_id: int,
                  version: int | None) -> int | None:
    """Replace every row of a small table with ``table`` (all its columns), written as
    ``append_table`` writes, in one overwriting commit, if the table is still at ``version``
    (the caller's rows being the table's then); returns the version committed, None if the
    batch is committed already. ``SlowPath`` for another version, object storage, a table
    whose checksum file does not list its files or that is larger than
    ``WHOLE_REWRITE_MAX_BYTES``, or that needs Delta's writer."""
    if not local_table(path) or not table.num_rows:
        raise SlowPath
    with _api(spark) as jvm:
        txn = _upsert_txn(spark, from_arrow_schema(table.schema), path, app_id, batch_id)
        if txn is None:
            return None
        if (txn.snapshot().version() != version
                or txn.snapshot().checksumOpt().get().tableSizeBytes() > WHOLE_REWRITE_MAX_BYTES):
            raise SlowPath
        files = _listed_files(jvm, txn)
        return _commit(jvm, txn, _file_actions(spark, txn, table, path), [f.remove() for f in files],
                       app_id, batch_id, _write(jvm, "Overwrite"))


def local_table(path: str) -> bool:
    """A table the driver writes files of as a plain path (not object storage, not ``file:``)."""
    return not storage.is_uri(path) and not path.startswith("file:")


def _file_actions(spark: SparkSession, txn, table: pa.Table, path: str) -> list:
    """``table`` written as the table's data files (``_file_plan``); their ``add`` actions, with
    the write's metrics registered for the history."""
    part, values, stats, plain = _file_plan(spark, txn, table)
    try:
        files = parquet_files.write_files(
            table, path, part, values, stats,
            spark.conf.get("spark.sql.parquet.compression.codec", "snappy").lower(), plain)
    except parquet_files.Unsupported as e:
        log.debug("write to %s through Delta's writer: %s", path, e)
        raise SlowPath from e
    _write_metrics(spark, txn, files)
    return [spark._jvm.org.apache.spark.sql.delta.actions.Action.fromJson(f.add_json()) for f in files]


#: writer features a commit of files written outside Delta's writer keeps intact; others
#: (column mapping, identity columns, row tracking, clustering, ...) need Delta's writer
_FILE_APPEND_FEATURES = frozenset({
    "appendOnly", "invariants", "checkConstraints", "generatedColumns", "changeDataFeed",
    "deletionVectors", "v2Checkpoint", "inCommitTimestamp", "domainMetadata",
    "vacuumProtocolCheck", "checkpointProtection", "timestampNtz"})
_PLAIN = "parquet.enable.dictionary#"


def _file_plan(spark: SparkSession, txn, table: pa.Table):
    """(partition column or None, its values per row, statistics columns, columns without
    dictionary) for writing ``table``'s files; ``SlowPath`` where only Delta's writer knows how:
    column mapping, constraints, identity or NOT NULL columns the data breaks, generated
    columns other than a time-bucket partition (``lakehouse.tables.bucket_sql``), table
    properties that change files or statistics, a session time zone other than UTC."""
    jvm = spark._jvm
    conv = jvm.scala.jdk.javaapi.CollectionConverters
    metadata, protocol = txn.metadata(), txn.protocol()
    config = dict(conv.asJava(metadata.configuration()))
    features = protocol.writerFeatures()
    if protocol.minWriterVersion() > 4 and not (
            features.isDefined() and set(conv.asJava(features.get())) <= _FILE_APPEND_FEATURES):
        raise SlowPath
    if spark.conf.get("spark.sql.session.timeZone") not in ("UTC", "Etc/UTC", "Z"):
        raise SlowPath
    for key, value in config.items():
        if key.startswith("delta.constraints.") or (key.startswith("parquet.") and not key.startswith(_PLAIN)):
            raise SlowPath
        if key in ("delta.columnMapping.mode",) and value != "none":
            raise SlowPath
        if key in ("delta.enableRowTracking", "delta.dataSkippingStringPrefixLength",
                   "delta.randomizeFilePrefixes") and value not in ("false", str(parquet_files.STRING_PREFIX)):
            raise SlowPath
    fields = list(_table_fields(metadata).values())
    partitions = list(_java_list(jvm, metadata.partitionColumns()))
    names = set(table.column_names)
    for f in fields:
        if any(k.startswith(("delta.identity.", "delta.invariants")) for k in f.metadata):
            raise SlowPath
        generated = "delta.generationExpression" in f.metadata
        if generated and f.name not in partitions:
            raise SlowPath
        if not f.nullable and not generated and (f.name not in names or table.column(f.name).null_count):
            raise SlowPath
    if len(partitions) > 1:
        raise SlowPath
    part, values = None, None
    if partitions:
        part = partitions[0]
        expr = next((f.metadata.get("delta.generationExpression") for f in fields if f.name == part), None)
        if expr is None or part in names:
            raise SlowPath
        try:
            values = parquet_files.bucket_values(table, expr)
        except parquet_files.Unsupported as e:
            log.debug("append through Delta's writer: %s", e)
            raise SlowPath from e
    data_columns = [f.name for f in fields if f.name not in partitions]
    listed = config.get("delta.dataSkippingStatsColumns")
    if listed is not None:
        stats = [c.strip().strip("`") for c in listed.split(",") if c.strip()]
    else:
        n = int(config.get("delta.dataSkippingNumIndexedCols", "32"))
        stats = data_columns if n < 0 else data_columns[:n]
    plain = [k[len(_PLAIN):] for k, v in config.items() if k.startswith(_PLAIN) and v == "false"]
    return part, values, stats, plain


def _write_metrics(spark: SparkSession, txn, files: list) -> None:
    """The WRITE's operation metrics in the table's history (files, rows, bytes), as Delta's
    writer records them; left out if Delta's API for them differs."""
    try:
        jvm = spark._jvm
        values = {"numFiles": len(files), "numOutputRows": sum(f.rows for f in files),
                  "numOutputBytes": sum(f.size for f in files)}
        metrics = jvm.java.util.HashMap()
        for name, value in values.items():
            m = jvm.org.apache.spark.sql.execution.metric.SQLMetrics.createMetric(spark._jsc.sc(), name)
            m.add(value)
            metrics.put(name, m)
        scala_map = jvm.scala.jdk.javaapi.CollectionConverters.asScala(metrics)
        to_map = getattr(getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$"), "from")
        txn.registerSQLMetrics(spark._jsparkSession, to_map(scala_map))
    except Exception as e:  # noqa: BLE001 - history metrics only
        log.debug("write metrics not recorded: %s", e)


def upsert_whole(df: DataFrame, path: str, keys: Sequence[str], app_id: str, batch_id: int) -> None:
    """Upsert ``df`` (one row per key, every column of the table) into a small table by
    rewriting it: its rows whose keys ``df`` lacks, plus ``df``, replace all its files in one
    commit (an overwriting WRITE in the history). Two Spark jobs where a MERGE runs six after a
    log replay. Only while the table totals at most ``WHOLE_REWRITE_MAX_BYTES``."""
    with _api(df) as jvm:
        txn = _upsert_txn(df.sparkSession, df.schema, path, app_id, batch_id)
        if txn is None:
            return
        if txn.snapshot().checksumOpt().get().tableSizeBytes() > WHOLE_REWRITE_MAX_BYTES:
            raise SlowPath
        files = _listed_files(jvm, txn)
        rows = _replaced(df, keys, _read(df, txn, files)).coalesce(1)
        _commit(jvm, txn, txn.writeFiles(rows._jdf), [f.remove() for f in files], app_id, batch_id,
                _write(jvm, "Overwrite"))


def replace_recent(df: DataFrame, path: str, keys: Sequence[str], column: str, since: datetime,
                   app_id: str, batch_id: int, rows_per_file: int) -> None:
    """Upsert ``df`` (one row per key, every column; every row's ``column`` >= ``since``) into a
    table whose rows change only at recent ``column`` values (``delta_tables.upsert_recent``):
    the files that may hold a row at or after ``since`` are rewritten with the batch's rows,
    sorted by ``column`` in files of at most ``rows_per_file`` rows; older files are left alone.
    Two Spark jobs where a MERGE runs six after a log replay. Only for files with statistics
    on ``column``."""
    with _api(df) as jvm:
        txn = _upsert_txn(df.sparkSession, df.schema, path, app_id, batch_id)
        if txn is None:
            return
        recent = [f for f in _listed_files(jvm, txn) if _reaches(f, column, since)]
        rows = _replaced(df, keys, _read(df, txn, recent)).coalesce(1).sortWithinPartitions(column)
        with session_confs(df.sparkSession, {"spark.sql.files.maxRecordsPerFile": str(rows_per_file)}):
            adds = txn.writeFiles(rows._jdf)
        _commit(jvm, txn, adds, [f.remove() for f in recent], app_id, batch_id, _write(jvm, "Overwrite"))


def _upsert_txn(spark: SparkSession, schema: StructType, path: str, app_id: str, batch_id: int):
    """A transaction for an upsert that rewrites files, None if the batch is committed already.

    ``SlowPath`` unless the checksum file lists the table's files (Delta does so for small
    tables) and ``schema`` (the new rows') has every column (a MERGE's update keeps the columns
    its source lacks). The whole table counts as read, so any commit another writer makes
    meanwhile (compaction, retention) conflicts, as it does with a MERGE."""
    txn = _start(spark, path)
    metadata = txn.metadata()
    if not (_fits(schema, metadata) and _covers(schema, metadata)):
        raise SlowPath
    if _txn_version(spark._jvm, txn, app_id) >= batch_id:
        return None
    checksum = txn.snapshot().checksumOpt()
    if not (checksum.isDefined() and checksum.get().allFiles().isDefined()):
        raise SlowPath
    txn.readWholeTable()
    return txn


def _listed_files(jvm, txn) -> list:
    return _java_list(jvm, txn.snapshot().checksumOpt().get().allFiles().get())


def _read(df: DataFrame, txn, files: list) -> DataFrame:
    """The rows of ``files`` (AddFiles of the transaction's snapshot), in ``df``'s session."""
    jvm = df.sparkSession._jvm
    seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(files).toSeq()
    return DataFrame(txn.deltaLog().createDataFrame(txn.snapshot(), seq, False, _none(jvm)), df.sparkSession)


def _replaced(df: DataFrame, keys: Sequence[str], old: DataFrame) -> DataFrame:
    """``old``'s rows whose keys ``df`` lacks (null-safe), then ``df``'s."""
    new_keys = df.select(*keys)
    same = reduce(lambda a, b: a & b, [old[k].eqNullSafe(new_keys[k]) for k in keys])
    return old.join(new_keys, same, "left_anti").select(*df.columns).unionByName(df)


def _reaches(add, column: str, since: datetime) -> bool:
    """Whether the file may hold a row with ``column`` >= ``since``, by its statistics (whose
    maximum Delta truncates to milliseconds); without them: ``SlowPath``."""
    stats = add.stats()
    top = json.loads(stats).get("maxValues", {}).get(column) if stats else None
    if top is None:
        raise SlowPath
    return datetime.fromisoformat(top) + timedelta(milliseconds=1) > since


def _write(jvm, mode: str):
    """The operation a commit records: a WRITE in the history, appending or (files replaced)
    overwriting."""
    return jvm.org.apache.spark.sql.delta.DeltaOperations.Write(
        getattr(jvm.org.apache.spark.sql.SaveMode, mode), *[_none(jvm)] * 8)


class _api:
    """Context: the session's JVM; Delta's errors (conflicts) pass through, an API that moved
    (another Delta release) turns the fast writes off for the process and raises ``SlowPath``."""

    def __init__(self, df: DataFrame | SparkSession) -> None:
        self.jvm = _session(df)._jvm

    def __enter__(self):
        if not enabled:
            raise SlowPath
        return self.jvm

    def __exit__(self, kind, e, tb) -> bool:
        global enabled
        from py4j.protocol import Py4JError, Py4JJavaError

        if e is None or isinstance(e, (Py4JJavaError, SlowPath)) or not isinstance(e, Py4JError):
            return False
        log.warning("Delta's transaction API differs from delta-spark 4.4's (%s); writes go "
                    "through Delta's commands", str(e).splitlines()[0][:200])
        enabled = False
        raise SlowPath from e


def _session(df: DataFrame | SparkSession) -> SparkSession:
    return df if isinstance(df, SparkSession) else df.sparkSession


def _start(df: DataFrame | SparkSession, path: str):
    spark = _session(df)
    return spark._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path).startTransaction()


def _none(jvm):
    return getattr(getattr(jvm.scala, "None$"), "MODULE$")


def _java_list(jvm, seq) -> list:
    return list(jvm.scala.jdk.javaapi.CollectionConverters.asJava(seq))


def _commit(jvm, txn, adds, removes: list, app_id: str, batch_id: int, op) -> int:
    """Commit ``adds`` (a Scala sequence, or a list), ``removes`` and the batch's
    ``SetTransaction``; returns the version committed."""
    actions = jvm.java.util.ArrayList()
    for a in [*(adds if isinstance(adds, list) else _java_list(jvm, adds)), *removes]:
        actions.add(a)
    now = jvm.scala.Some(jvm.java.lang.Long.valueOf(int(time.time() * 1000)))
    actions.add(jvm.org.apache.spark.sql.delta.actions.SetTransaction(app_id, batch_id, now))
    return txn.commit(jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toSeq(), op)


def _table_fields(metadata) -> dict:
    table = StructType.fromJson(json.loads(metadata.schema().json()))
    return {f.name.lower(): f for f in table.fields}


def _fits(schema: StructType, metadata) -> bool:
    """Every column of ``schema`` is in the table with the same type; the table's other columns
    are generated (Delta computes them while writing) or nullable (read as null, as in files
    written before a column was added)."""
    have = _table_fields(metadata)
    for f in schema.fields:
        t = have.pop(f.name.lower(), None)
        if t is None or t.dataType.simpleString() != f.dataType.simpleString():
            return False
    return all(f.nullable or "delta.generationExpression" in f.metadata for f in have.values())


def _covers(schema: StructType, metadata) -> bool:
    """``schema`` has every column of the table that Delta does not generate."""
    names = {f.name.lower() for f in schema.fields}
    return all(n in names or "delta.generationExpression" in f.metadata
               for n, f in _table_fields(metadata).items())


def _txn_version(jvm, txn, app_id: str) -> int:
    """The last version (app id) committed, from the checksum file when it lists the table's
    transactions, else Delta's lookup (log replay)."""
    checksum = txn.snapshot().checksumOpt()
    if checksum.isDefined() and checksum.get().setTransactions().isDefined():
        listed = jvm.scala.jdk.javaapi.CollectionConverters.asJava(checksum.get().setTransactions().get())
        return max((t.version() for t in listed if t.appId() == app_id), default=-1)
    return txn.txnVersion(app_id)
