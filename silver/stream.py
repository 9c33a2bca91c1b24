"""Silver: parsed, typed, deduplicated under an event-time watermark, validated.

The layered topology's silver query (the default fused one, ``silver.from_kafka``, runs the
same parse, validation and writer on each Kafka batch):
bronze (Delta's streaming source) -> parse -> validate (suite compiled to one Spark expression)
-> event-time watermark -> foreachBatch: drop late rows and duplicates (``silver.dedup``, the
driver's index; or with ``stream.dedup = "state_store"`` Spark's dropDuplicatesWithinWatermark
in the plan), valid rows to ``silver``, failing rows to ``quarantine`` with every reason, and
per-batch counts to ``quality_log``, each written with Delta's idempotent append (query id,
batch id), the three at once (``lakehouse.delta.concurrent_writes``). Every bronze row is accounted for:

    bronze rows in batch = silver + quarantine + duplicates dropped + late

A row is late when its event time is <= the watermark of the *previous* batch (the watermark a
batch computes only applies to the next one), as Spark's own operators judge it. With the index
nothing is dropped before foreachBatch: the batch's rows are its input, and late rows keep their
raw payload there (where the previous watermark is known) to be quarantined with reason
``late``.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta import tables as delta_tables
from lakehouse.delta.concurrent_writes import run_at_once
from lakehouse.delta.read import open_table
from lakehouse.delta.tables import spark_schema
from lakehouse.device_registry import Registered
from lakehouse.monitoring import observers
from lakehouse.monitoring.metrics import note_batch
from lakehouse.settings import Settings
from lakehouse.streams import (
    at_or_before,
    batch_watermark_ms,
    foreach_batch,
    pin_mode,
    pool,
    query_id,
    trigger_kwargs,
)
from lakehouse.tables import QUALITY_LOG, QUARANTINE, silver_schema
from lakehouse.telemetry import TelemetryModel
from silver.dedup import DedupIndex, fingerprint_columns, from_spark
from silver.expectations import (
    Suite,
    arrow_quality,
    failure_counts,
    failure_names,
    quality_summary,
    suite_for,
)
from silver.parse import mqtt_topic, parse, parse_checks
from silver.sparkplug import is_sparkplug, sparkplug_rows

log = logging.getLogger(__name__)

TABLE, QUARANTINE_TABLE, QUALITY_TABLE = "silver", "quarantine", "quality_log"
_DEDUP_OP = "StreamingDeduplicateWithinWatermark"
_PRINTS = ("_print_hi", "_print_lo")  # the dedup index's fingerprints of dedup_key


def validated(bronze: DataFrame, suite: Suite | None, model: TelemetryModel,
              keep: tuple[str, ...] = ()) -> DataFrame:
    """Parsed rows with ``reasons`` (comma-joined parse problems, then failed suite
    expectations; "" when valid; a payload that is not JSON gets only ``not_json``) and the
    dedup key and event time; ``keep``: bronze columns passed through (not with Sparkplug)."""
    if model.sparkplug:  # Sparkplug B topics take their own (stateful) decoder
        if keep:
            raise ValueError("Sparkplug rows cannot carry bronze columns through their decoder")
        sp = F.coalesce(is_sparkplug(mqtt_topic()), F.lit(False))
        parsed = parse(bronze.where(~sp), model)
        parsed = parsed.unionByName(sparkplug_rows(bronze, model, parsed.schema))
    else:
        parsed = parse(bronze, model, keep)
    missing = [c for c in (suite.columns if suite is not None else []) if c not in parsed.columns]
    if missing:  # e.g. a metric removed from the model: its column stays, null from now on
        log.warning("the suite %s checks columns the telemetry model does not parse: %s (null in "
                    "new rows)", suite.path, missing)
        parsed = parsed.withColumns({c: F.lit(None) for c in missing})
    # the suite's failures in a column of their own: used twice below, inside a CASE WHEN,
    # Spark would evaluate the whole suite twice per row
    parsed = parsed.withColumn("_checks", failure_names(suite) if suite is not None else F.lit(""))
    found, checks = F.col("parse_reasons"), F.col("_checks")
    reasons = F.when(found == "not_json", found).otherwise(
        F.concat_ws(",", F.nullif(found, F.lit("")), F.nullif(checks, F.lit(""))))
    keyed = F.col("event_id").isNotNull() & F.col("event_time").isNotNull()
    return (
        parsed.withColumn("reasons", reasons)
        # rows without id/time cannot be deduplicated: a unique key per bronze row, no event time
        .withColumn("dedup_key", F.when(keyed, F.col("event_id")).otherwise(
            F.concat_ws(":", F.lit("bronze"), "kafka_topic", "kafka_partition", "kafka_offset")))
        .withColumn("dedup_time", F.when(keyed, F.col("event_time")))
        .drop("parse_reasons", "_checks")
    )


def bronze_stream(spark: SparkSession, settings: Settings, bronze_path: str | None = None,
                  bronze_ending_version: int | None = None) -> DataFrame:
    """Bronze as Delta's streaming source reads it. Bronze is appended to; compaction commits are
    dataChange=false (the source skips them) and retention deletes old rows
    (``maintenance.retention_days``): ``skipChangeCommits`` skips those, rows already read
    stay read. A batch reads at most
    ``stream.silver_max_files_per_trigger`` files / ``silver_max_bytes_per_trigger`` bytes.

    ``bronze_ending_version`` (time-travel reprocessing) keeps the rows bronze held at that
    version: a bronze batch stamps ``ingest_time`` when it starts, after the previous version
    committed, so they are the rows ingested no later than that version's commit timestamp."""
    st = settings.stream
    path = bronze_path or settings.table_path("bronze")
    reader = (spark.readStream.format("delta").option("skipChangeCommits", "true")
              .option("maxFilesPerTrigger", str(st.silver_max_files_per_trigger)))
    if st.silver_max_bytes_per_trigger:
        reader = reader.option("maxBytesPerTrigger", str(st.silver_max_bytes_per_trigger))
    bronze = reader.load(path)
    if bronze_ending_version is not None:
        ts = commit_time_us(path, bronze_ending_version)
        bronze = bronze.where(F.col("ingest_time") <= F.timestamp_micros(F.lit(ts)))
    return bronze


def commit_time_us(path: str, version: int) -> int:
    """Commit timestamp (epoch µs) of ``version`` of the table at ``path``."""
    hist = [h for h in open_table(path).history() if h.get("version") == version]
    if not hist:
        raise ValueError(f"{path} has no version {version} in its history")
    return int(hist[0]["timestamp"]) * 1000


def silver_frame(spark: SparkSession, settings: Settings, suite: Suite | None = None,
                 bronze_path: str | None = None,
                 bronze_ending_version: int | None = None) -> DataFrame:
    """The stream with its watermark, deduplicated here with ``stream.dedup = "state_store"``
    (else it keeps ``dedup_key`` / ``dedup_time`` for the writer's index, and every row's raw
    payload until the writer knows which rows are late)."""
    bronze = bronze_stream(spark, settings, bronze_path, bronze_ending_version)
    framed = validated(bronze, suite, settings.telemetry)
    if settings.stream.dedup == "state_store":
        return (watermarked(framed.withColumn("value", F.when(F.col("reasons") != "", F.col("value"))),
                            settings)
                .dropDuplicatesWithinWatermark(["dedup_key"]).drop("dedup_key", "dedup_time"))
    return watermarked(framed, settings)


def watermarked(framed: DataFrame, settings: Settings) -> DataFrame:
    """``validated`` rows with the event-time watermark late rows and dedup expiry go by."""
    return framed.withWatermark("dedup_time", f"{settings.stream.watermark_seconds} seconds")


def late_watermark_ms(checkpoint: str, batch_id: int) -> int:
    """The watermark (epoch ms) batch ``batch_id`` judges late rows by: the one in the previous
    batch's offsets log entry (0 for the first batch), as Spark's stateful operators do."""
    return batch_watermark_ms(checkpoint, batch_id - 1) if batch_id > 0 else 0


def dropped_by_spark(spark: SparkSession, query: str, batch_id: int) -> tuple[int, int] | None:
    """(late, duplicate) rows the dedup operator dropped in the running batch, from its metrics.

    Read from the query's current execution after the batch ran (classic PySpark, JVM
    internals): None when unavailable.
    """
    try:
        execution = spark.streams.get(query)._jsq.streamingQuery().lastExecution()
        if execution is None or execution.currentBatchId() != batch_id:
            return None
        late = dup = found = 0
        nodes = [execution.executedPlan()]
        while nodes:
            node = nodes.pop()
            if node.nodeName() == _DEDUP_OP:
                m = node.metrics()
                late += m.apply("numRowsDroppedByWatermark").value()
                dup += m.apply("numDroppedDuplicateRows").value()
                found += 1
            children = node.children().iterator()
            while children.hasNext():
                nodes.append(children.next())
        return (late, dup) if found == 1 else None
    except Exception as e:  # noqa: BLE001 - internals moved
        log.debug("dedup metrics unavailable: %s", e)
        return None


def parse_quality(reasons: pa.ChunkedArray, checks: tuple[tuple[str, str], ...]) -> list[dict]:
    """Quality-log rows (kind ``row``) for every parse check; ``not_json`` is checked on every row,
    the others on the rows that are JSON objects."""
    return parse_quality_counts(len(reasons), failure_counts(reasons), checks)


def reason_counts(groups: dict[str, int]) -> dict[str, int]:
    """Rows per reason from rows per comma-joined ``reasons`` string."""
    out: dict[str, int] = {}
    for joined, n in groups.items():
        for name in filter(None, (joined or "").split(",")):
            out[name] = out.get(name, 0) + n
    return out


def parse_quality_counts(n: int, counts: dict[str, int],
                         checks: tuple[tuple[str, str], ...]) -> list[dict]:
    """``parse_quality`` from the batch's row count and its rows per reason."""
    n_json = n - counts.get("not_json", 0)
    rows = []
    for name, column in checks:
        evaluated, failed = (n if name == "not_json" else n_json), counts.get(name, 0)
        rows.append(dict(expectation=name, column=column, kind="row", evaluated=evaluated,
                         passed=evaluated - failed, failed=failed, success=failed == 0,
                         details=json.dumps({"type": "parse"})))
    return rows


def registered_devices(registered: frozenset[str], sparkplug: bool) -> Column:
    """True where the registry holds the row's device (a Sparkplug device by its edge node,
    ``group/node``), as one SQL IN list (a hash set once optimized). For the distributed
    writer: its cost per batch grows with the registry (about a second with 10,000 ids,
    docs/guarantees.md), where the driver's check of an Arrow batch (``unknown_reasons``) is a
    hash look-up per row."""
    if not registered:
        return F.lit(False)
    device = "substring_index(device_id, '/', 2)" if sparkplug else "device_id"
    quoted = ", ".join("'" + i.replace("\\", "\\\\").replace("'", "\\'") + "'" for i in sorted(registered))
    return F.coalesce(F.expr(f"{device} IN ({quoted})"), F.lit(False))


def unknown_devices(df: DataFrame, known: Column) -> DataFrame:
    """``unknown_device`` added to the reasons of rows not ``known``; a payload that is not
    JSON keeps ``not_json`` alone."""
    r = F.col("reasons")
    return df.withColumn("reasons", F.when(known | (r == "not_json"), r)
                         .when(r == "", F.lit("unknown_device"))
                         .otherwise(F.concat(r, F.lit(",unknown_device"))))


def unknown_reasons(out: pa.Table, registered: pa.Array, sparkplug: bool) -> pa.Table:
    """``unknown_devices`` on a batch the driver holds."""
    device = out.column("device_id")
    if sparkplug:
        device = pc.binary_join(pc.list_slice(pc.split_pattern(device, "/", max_splits=2), 0, 2), "/")
    known = pc.fill_null(pc.is_in(device, value_set=registered), False)
    r = out.column("reasons")
    marked = pc.if_else(pc.equal(r, ""), pa.scalar("unknown_device"),
                        pc.binary_join_element_wise(r, pa.scalar(",unknown_device"), pa.scalar("")))
    reasons = pc.if_else(pc.or_(known, pc.equal(r, "not_json")), r, marked)
    return out.set_column(out.column_names.index("reasons"), "reasons", reasons)


class SilverBatchWriter:
    """foreachBatch function: route, write exactly once, log quality counts."""

    def __init__(self, spark: SparkSession, settings: Settings, checkpoint: str, app_id: str,
                 suite: Suite | None = None, paths: dict[str, str] | None = None) -> None:
        self.spark, self.settings, self.checkpoint, self.app_id = spark, settings, checkpoint, app_id
        self.suite = suite
        self.schema = silver_schema(settings.telemetry)
        self.checks = parse_checks(settings.telemetry)
        self.paths = paths or {t: settings.table_path(t) for t in (TABLE, QUARANTINE_TABLE, QUALITY_TABLE)}
        self.last_counts: dict[str, int] = {}
        # delay 0: late copies are quarantined before the index is asked (silver/dedup.py)
        self.index = DedupIndex(checkpoint, delay_ms=0) if settings.stream.dedup == "index" else None
        self.registry = Registered(settings) if settings.telemetry.require_registered else None
        self._registered: tuple[frozenset[str], pa.Array | Column] | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        registered = self._registered_now()
        late_wm = late_watermark_ms(self.checkpoint, batch_id)
        now = datetime.now(UTC)
        added = None
        if self.index is not None:
            # one pass to the driver; the raw payload rides along only for rows bound to quarantine
            # (every row's when the registry judges them: here, on the driver)
            late_cond = F.col("dedup_time").isNotNull() & at_or_before(F.col("dedup_time"), late_wm * 1000)
            keep = (F.col("reasons") != "") | late_cond if registered is None else F.lit(True)
            # the dedup keys' fingerprints hashed by the executors, not the driver's one core
            prints = dict(zip(_PRINTS, fingerprint_columns("dedup_key"), strict=True))
            out = df.withColumns({"value": F.when(keep, F.col("value")), **prints}).toArrow()
            rows_in = out.num_rows
            if rows_in == 0:
                self.last_counts = {}
                return
            if registered is not None:
                out = unknown_reasons(out, registered, self.settings.telemetry.sparkplug)
            out, late_rows, added = self._dedup(batch_id, out, late_wm)
            late = self._quarantine(late_rows, now, reason="late")
            self.index.log(batch_id, added)  # durable before anything of the batch commits
            duplicates = rows_in - out.num_rows - late.num_rows
        else:
            if registered is not None:
                df = unknown_devices(df, registered)
            self._write_distributed(df.persist(), batch_id, now)
            return
        reasons = out.column("reasons")
        bad = pc.not_equal(reasons, "")
        silver = out.select(self.schema.names).filter(pc.invert(bad)).cast(self.schema)
        observers.publish("silver", silver)  # e.g. the alert engine's threshold rules
        quarantine = self._quarantine(
            out.select([n for n in (*QUARANTINE.names, "reasons") if n in out.column_names]).filter(bad), now)
        if late.num_rows:
            quarantine = pa.concat_tables([quarantine, late])
        self.last_counts = {"rows_in": rows_in, "silver": silver.num_rows,
                            "quarantine": quarantine.num_rows - late.num_rows,
                            "duplicates": duplicates, "late": late.num_rows}
        spark = df.sparkSession
        quality = self._quality(batch_id, now, out, reasons)
        run_at_once(spark, [
            partial(delta_tables.append_table, spark, data, self.paths[name], self.app_id, batch_id)
            for name, data in ((TABLE, silver), (QUARANTINE_TABLE, quarantine), (QUALITY_TABLE, quality))
            if data.num_rows])
        if added is not None:
            self.index.commit(batch_id, added)
            note_batch(self.app_id, batch_id, state_rows=len(self.index),
                       rows_dropped_by_watermark=late.num_rows, duplicates_dropped=duplicates)

    def _registered_now(self) -> pa.Array | Column | None:
        """The registry's ids (the index mode's Arrow array, the distributed mode's Spark
        test), made again only when the table has a new version; None: not asked for."""
        if self.registry is None:
            return None
        ids = self.registry.current()
        if self._registered is None or self._registered[0] is not ids:
            sparkplug = self.settings.telemetry.sparkplug
            made = (pa.array(sorted(ids), pa.string()) if self.index is not None
                    else registered_devices(ids, sparkplug))
            self._registered = ids, made
        return self._registered[1]

    def _write_distributed(self, df: DataFrame, batch_id: int, now: datetime) -> None:
        """``stream.dedup = "state_store"``: the rows never reach the driver, only their counts by
        reasons do, so on a cluster the executors parse, validate and write the batch (the index
        mode collects every batch to the driver's Python). ``df`` is persisted: its one run
        feeds the counts, the writes and the quality aggregation, and the dedup operator's
        metrics count each row once."""
        try:
            groups = {r["reasons"]: r["n"] for r in
                      df.groupBy("reasons").agg(F.count(F.lit(1)).alias("n")).collect()}
            dropped = dropped_by_spark(self.spark, self.app_id, batch_id)
            if dropped is None:
                raise RuntimeError(f"silver batch {batch_id}: the dedup operator's metrics are "
                                   "unavailable; the batch cannot be accounted for")
            late_n, duplicates = dropped
            if late_n:
                raise RuntimeError(f"silver batch {batch_id}: {late_n} late rows dropped by the "
                                   "state store cannot be quarantined")
            rows_out = sum(groups.values())
            if rows_out + duplicates == 0:  # no-data batch (watermark advance only)
                self.last_counts = {}
                return
            valid = groups.get("", 0)
            self.last_counts = {"rows_in": rows_out + duplicates, "silver": valid,
                                "quarantine": rows_out - valid, "duplicates": duplicates, "late": 0}
            bad = F.col("reasons") != ""
            silver = df.where(~bad).select([F.col(f.name).cast(f.dataType)
                                            for f in spark_schema(self.schema).fields])
            if observers.wanted("silver"):
                observers.publish("silver", silver.toArrow())
            source = {"reason": F.col("reasons"), "quarantined_at": F.lit(now)}
            quarantine = df.where(bad).select([source.get(f.name, F.col(f.name)).cast(f.dataType).alias(f.name)
                                               for f in spark_schema(QUARANTINE).fields])
            rows = [dict(expectation=k, column=None, kind="counter", evaluated=None, passed=None,
                         failed=None, success=True, details=json.dumps({"count": v}))
                    for k, v in self.last_counts.items()]
            rows += parse_quality_counts(rows_out, reason_counts(groups), self.checks)
            if self.suite is not None:
                judged = df.where(F.col("reasons") != "not_json").withColumn(
                    "_failures", F.split("reasons", ","))
                rows += quality_summary(judged, self.suite, "_failures")
            for r in rows:
                r.update(query_id=self.app_id, batch_id=batch_id, logged_at=now)
            quality = self.spark.createDataFrame(pa.Table.from_pylist(rows, schema=QUALITY_LOG))
            run_at_once(df.sparkSession, [
                partial(delta_tables.append, data, self.paths[name], self.app_id, batch_id)
                for name, data, n in ((TABLE, silver, valid), (QUARANTINE_TABLE, quarantine, rows_out - valid),
                                      (QUALITY_TABLE, quality, len(rows))) if n])
        finally:
            df.unpersist()

    def _dedup(self, batch_id: int, out: pa.Table, late_wm: int) -> tuple[pa.Table, pa.Table, pa.Table]:
        """(on-time first occurrences, late rows, keys the batch adds to the index)."""
        t_us = pc.cast(out.column("dedup_time"), pa.int64())
        on_time = pc.or_kleene(pc.is_null(t_us), pc.greater(t_us, late_wm * 1000))
        # the few columns the index reads, then one filter of the whole table
        cols = pa.table({"key": out.column("dedup_key"), "t_ms": pc.divide(t_us, 1000),
                         **{c: out.column(c) for c in _PRINTS}})
        on = on_time.to_numpy(zero_copy_only=False)
        late = out.slice(0, 0)
        if not on.all():
            cols, late = cols.filter(on_time), out.filter(pc.invert(on_time))
        prints = from_spark(*(cols.column(c) for c in _PRINTS))
        first, added = self.index.first_seen(batch_id, cols.column("key"), cols.column("t_ms"),
                                             late_wm, prints)
        keep = np.zeros(len(on), bool)
        keep[np.flatnonzero(on)] = first.to_numpy(zero_copy_only=False)
        return out.filter(pa.array(keep)), late, added

    def _quarantine(self, rows: pa.Table, now: datetime, reason: str | None = None) -> pa.Table:
        cols = {n: rows.column(n) for n in QUARANTINE.names if n in rows.column_names}
        cols["reason"] = (pa.array([reason] * rows.num_rows, pa.string()) if reason
                          else rows.column("reasons"))
        cols["quarantined_at"] = pa.array([now] * rows.num_rows, pa.timestamp("us", tz="UTC"))
        return pa.table({n: cols[n] for n in QUARANTINE.names}).cast(QUARANTINE)

    def _quality(self, batch_id: int, now: datetime, out: pa.Table,
                 reasons: pa.ChunkedArray) -> pa.Table:
        """Counters, every parse check, then every suite expectation (row and set level) on the
        batch's on-time, deduplicated rows that parsed as JSON (what the suite could judge)."""
        rows = [dict(expectation=k, column=None, kind="counter", evaluated=None, passed=None,
                     failed=None, success=True, details=json.dumps({"count": v}))
                for k, v in self.last_counts.items()]
        rows += parse_quality(reasons, self.checks)
        if self.suite is not None:
            rows += arrow_quality(self.suite, out.filter(pc.not_equal(reasons, "not_json")), "reasons")
        for r in rows:
            r.update(query_id=self.app_id, batch_id=batch_id, logged_at=now)
        return pa.Table.from_pylist(rows, schema=QUALITY_LOG)


def pin_dedup_mode(checkpoint: str, mode: str) -> None:
    """A checkpoint keeps the dedup mode it started with: the index's changelog and Spark's
    state store do not carry over, so resuming in the other mode would forget seen ids."""
    started = Path(checkpoint, "offsets").exists()  # a checkpoint from before the setting
    pin_mode(checkpoint, "stream.dedup", mode,
             "state_store" if started and not Path(checkpoint, "dedup").exists() else None,
             "rebuild silver into a new generation (iotlake reprocess)")


def ensure_tables(spark: SparkSession, settings: Settings) -> None:
    """Silver, quarantine and the quality log exist, silver with a column per model metric."""
    schema = silver_schema(settings.telemetry)
    for name, table_schema in ((TABLE, schema), (QUARANTINE_TABLE, QUARANTINE), (QUALITY_TABLE, QUALITY_LOG)):
        delta_tables.ensure_named_table(spark, settings, name, table_schema)
    # a metric or topic part added to the model: its column, before any reader starts
    delta_tables.add_missing_columns(spark, settings.table_path(TABLE), schema)


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          suite_path: Path | None = None, validate: bool = True,
          bronze_path: str | None = None, bronze_ending_version: int | None = None) -> StreamingQuery:
    """Start the silver stream; ``validate=False`` skips the suite (parse and dedup only)."""
    suite = suite_for(settings.telemetry, suite_path) if validate else None
    ckpt = settings.checkpoint_path(TABLE)
    ensure_tables(spark, settings)
    app_id = query_id(ckpt)
    pin_dedup_mode(ckpt, settings.stream.dedup)
    writer = SilverBatchWriter(spark, settings, ckpt, app_id, suite)
    stream = (
        foreach_batch(silver_frame(spark, settings, suite, bronze_path, bronze_ending_version),
                      TABLE, writer)
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
    )
    with pool(spark, "silver"):
        return stream.start()
