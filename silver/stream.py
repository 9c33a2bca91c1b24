"""Silver: parsed, typed, deduplicated under an event-time watermark, validated.

bronze (Delta stream) -> parse -> validate (suite compiled to one Spark expression) ->
event-time watermark -> foreachBatch: drop late rows and duplicates (``silver.dedup``, the
driver's index; or with ``stream.dedup = "state_store"`` Spark's dropDuplicatesWithinWatermark
in the plan), valid rows to ``silver``, failing rows to ``quarantine`` with every reason, and
per-batch counts to ``quality_log``. Every bronze row is accounted for:

    bronze rows in batch = silver + quarantine + duplicates dropped + late

A row is late when its event time is <= the watermark of the *previous* batch (the watermark a
batch computes only applies to the next one), as Spark's own operators judge it. Only when a
batch has late rows are its bronze files re-read to recover them (the plan drops valid rows' raw
payload early), and they are quarantined with reason ``late``.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse import storage
from lakehouse.delta_io import append_arrow, ensure_table
from lakehouse.delta_source import commit_adds
from lakehouse.metrics import note_batch
from lakehouse.settings import Settings
from lakehouse.streams import pool, query_id, trigger_kwargs
from lakehouse.tables import QUALITY_LOG, QUARANTINE, SILVER
from silver.dedup import DedupIndex
from silver.expectations import Suite, arrow_quality, failure_counts, failure_names, load_suite
from silver.parse import PARSE_CHECKS, parse

log = logging.getLogger(__name__)

TABLE, QUARANTINE_TABLE, QUALITY_TABLE = "silver", "quarantine", "quality_log"
_DEDUP_OP = "StreamingDeduplicateWithinWatermark"


def validated(bronze: DataFrame, suite: Suite | None = None) -> DataFrame:
    """Parsed rows with ``reasons`` (comma-joined parse problems, then failed suite
    expectations; "" when valid; a payload that is not JSON gets only ``not_json``) and the
    dedup key and event time."""
    parsed = parse(bronze)
    checks = failure_names(suite) if suite is not None else F.lit("")
    found = F.col("parse_reasons")
    reasons = F.when(found == "not_json", found).otherwise(
        F.concat_ws(",", F.nullif(found, F.lit("")), F.nullif(checks, F.lit(""))))
    keyed = F.col("event_id").isNotNull() & F.col("event_time").isNotNull()
    return (
        parsed.withColumn("reasons", reasons)
        # rows without id/time cannot be deduplicated: a unique key per bronze row, no event time
        .withColumn("dedup_key", F.when(keyed, F.col("event_id")).otherwise(
            F.concat_ws(":", F.lit("bronze"), "kafka_topic", "kafka_partition", "kafka_offset")))
        .withColumn("dedup_time", F.when(keyed, F.col("event_time")))
        .drop("parse_reasons")
    )


def silver_frame(spark: SparkSession, settings: Settings, suite: Suite | None = None,
                 max_rows: int | None = None, bronze_path: str | None = None,
                 bronze_ending_version: int | None = None) -> DataFrame:
    """The stream with its watermark, deduplicated here with ``stream.dedup = "state_store"``
    (else it keeps ``dedup_key`` / ``dedup_time`` for the writer's index); the raw payload
    travels on only for rows bound to quarantine. ``bronze_ending_version`` stops reading bronze
    at that version (time-travel reprocessing)."""
    reader = (
        spark.readStream.format("iotlake_delta_stream")
        .option("path", bronze_path or settings.table_path("bronze"))
        .option("max_rows_per_trigger", str(max_rows or settings.stream.max_rows_per_trigger))
        .option("task_rows", str(settings.stream.task_rows))
    )
    if bronze_ending_version is not None:
        reader = reader.option("ending_version", str(bronze_ending_version))
    bronze = reader.load()
    wm = f"{settings.stream.watermark_seconds} seconds"
    framed = (
        validated(bronze, suite)
        .withColumn("value", F.when(F.col("reasons") != "", F.col("value")))
        .withWatermark("dedup_time", wm)
    )
    if settings.stream.dedup == "state_store":
        return framed.dropDuplicatesWithinWatermark(["dedup_key"]).drop("dedup_key", "dedup_time")
    return framed


# ---- per-batch bookkeeping from the checkpoint's offsets log ------------------------------

def _offset_entry(checkpoint: str, batch_id: int) -> tuple[dict, dict] | None:
    f = Path(checkpoint, "offsets", str(batch_id))
    if not f.exists():
        return None
    lines = f.read_text().splitlines()
    return json.loads(lines[1]), json.loads(lines[2])


def batch_input(checkpoint: str, batch_id: int, bronze_path: str) -> tuple[list[int], int, int]:
    """(bronze versions read, rows read, watermark ms Spark filtered late rows with).

    The late-row watermark is the previous batch's (0 for the first batch): Spark applies the
    watermark a batch computes only from the next batch on.
    """
    cur = _offset_entry(checkpoint, batch_id)
    if cur is None:
        raise RuntimeError(f"offsets log for batch {batch_id} missing in {checkpoint}")
    prev = _offset_entry(checkpoint, batch_id - 1) if batch_id > 0 else None
    if batch_id > 0 and prev is None:
        raise RuntimeError(f"offsets log for batch {batch_id - 1} missing in {checkpoint}")
    start = prev[1]["version"] if prev else -1
    versions = list(range(start + 1, cur[1]["version"] + 1))
    rows = sum(n for v in versions for _, n in commit_adds(bronze_path, v))
    return versions, rows, int(prev[0].get("batchWatermarkMs", 0)) if prev else 0


def dropped_by_spark(spark: SparkSession, query: str, batch_id: int) -> tuple[int, int] | None:
    """(late, duplicate) rows the dedup operator dropped in the running batch, from its metrics.

    Read from the query's current execution after the batch ran (classic PySpark, JVM
    internals): None when unavailable, and the caller then re-reads bronze to find out.
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
    except Exception as e:  # noqa: BLE001 - internals moved: fall back to the exact re-read
        log.debug("dedup metrics unavailable: %s", e)
        return None


def parse_quality(reasons: pa.ChunkedArray) -> list[dict]:
    """Quality-log rows (kind ``row``) for every parse check; ``not_json`` is checked on every row,
    the others on the rows that are JSON objects."""
    n = len(reasons)
    counts = failure_counts(reasons)
    n_json = n - counts.get("not_json", 0)
    rows = []
    for name, column in PARSE_CHECKS:
        evaluated, failed = (n if name == "not_json" else n_json), counts.get(name, 0)
        rows.append(dict(expectation=name, column=column, kind="row", evaluated=evaluated,
                         passed=evaluated - failed, failed=failed, success=failed == 0,
                         details=json.dumps({"type": "parse"})))
    return rows


class SilverBatchWriter:
    """foreachBatch function: route, write exactly once, log quality counts."""

    def __init__(self, spark: SparkSession, settings: Settings, checkpoint: str, app_id: str,
                 suite: Suite | None = None, bronze_path: str | None = None,
                 paths: dict[str, str] | None = None) -> None:
        self.spark, self.settings, self.checkpoint, self.app_id = spark, settings, checkpoint, app_id
        self.suite = suite
        self.bronze_path = bronze_path or settings.table_path("bronze")
        self.paths = paths or {t: settings.table_path(t) for t in (TABLE, QUARANTINE_TABLE, QUALITY_TABLE)}
        self.last_counts: dict[str, int] = {}
        self.index = (DedupIndex(checkpoint, settings.stream.watermark_seconds * 1000)
                      if settings.stream.dedup == "index" else None)

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        versions, rows_in, late_wm = batch_input(self.checkpoint, batch_id, self.bronze_path)
        out = df.toArrow()  # always run the batch: Spark checks every state store committed
        if rows_in == 0:  # no-data batch (watermark advance only): nothing to write
            self.last_counts = {}
            return
        now = datetime.now(UTC)
        added = None
        if self.index is not None:
            out, late_n, added = self._dedup(batch_id, out, late_wm)
            late = self._late_rows(versions, late_wm) if late_n else QUARANTINE.empty_table()
            if late.num_rows != late_n:
                raise RuntimeError(f"silver batch {batch_id}: {late_n} rows late in the stream, "
                                   f"bronze re-read found {late.num_rows}")
            self.index.log(batch_id, added)  # durable before anything of the batch commits
        else:
            late = self._late(batch_id, versions, late_wm, rows_in - out.num_rows)
        duplicates = rows_in - out.num_rows - late.num_rows
        if duplicates < 0:
            raise RuntimeError(f"silver batch {batch_id}: accounting broke ({rows_in} in, "
                               f"{out.num_rows} out, {late.num_rows} late)")
        reasons = out.column("reasons")
        bad = pc.not_equal(reasons, "")
        silver = out.filter(pc.invert(bad)).select(SILVER.names).cast(SILVER)
        quarantine = self._quarantine(out.filter(bad), now)
        if late.num_rows:
            quarantine = pa.concat_tables([quarantine, late])
        for name, data in ((TABLE, silver), (QUARANTINE_TABLE, quarantine)):
            if data.num_rows:
                append_arrow(self.paths[name], data, self.app_id, batch_id)
        self.last_counts = {"rows_in": rows_in, "silver": silver.num_rows,
                            "quarantine": quarantine.num_rows - late.num_rows,
                            "duplicates": duplicates, "late": late.num_rows}
        append_arrow(self.paths[QUALITY_TABLE], self._quality(batch_id, now, out, reasons),
                     self.app_id, batch_id)
        if added is not None:
            self.index.commit(batch_id, added)
            note_batch(self.app_id, batch_id, state_rows=len(self.index),
                       rows_dropped_by_watermark=late.num_rows, duplicates_dropped=duplicates)

    def _dedup(self, batch_id: int, out: pa.Table, late_wm: int) -> tuple[pa.Table, int, pa.Table]:
        """(on-time first occurrences, late rows' count, keys the batch adds to the index)."""
        t_us = pc.cast(out.column("dedup_time"), pa.int64())
        on_time = pc.or_kleene(pc.is_null(t_us), pc.greater(t_us, late_wm * 1000))
        kept = out.filter(on_time)
        late_n = out.num_rows - kept.num_rows
        t_ms = pc.divide(pc.cast(kept.column("dedup_time"), pa.int64()), 1000)
        first, added = self.index.first_seen(batch_id, kept.column("dedup_key"), t_ms, late_wm)
        return kept.filter(first), late_n, added

    def _late(self, batch_id: int, versions: list[int], late_wm: int, dropped: int) -> pa.Table:
        """The rows Spark dropped as late, recovered from bronze only when there are any."""
        if dropped == 0:
            return QUARANTINE.empty_table()
        spark_says = dropped_by_spark(self.spark, self.app_id, batch_id)
        if spark_says is not None and sum(spark_says) != dropped:  # e.g. a retried task
            log.warning("silver batch %s: dedup metrics %s do not add up to %s dropped rows; "
                        "re-reading bronze", batch_id, spark_says, dropped)
            spark_says = None
        if spark_says is not None and spark_says[0] == 0:
            return QUARANTINE.empty_table()
        late = self._late_rows(versions, late_wm)
        if spark_says is not None and late.num_rows != spark_says[0]:
            raise RuntimeError(f"silver batch {batch_id}: Spark dropped {spark_says[0]} rows as "
                               f"late, bronze re-read found {late.num_rows}")
        return late

    def _late_rows(self, versions: list[int], watermark_ms: int) -> pa.Table:
        """Re-read this batch's bronze files; keyed rows at or below the watermark were dropped."""
        files = [storage.join(self.bronze_path, p) for v in versions for p, _ in commit_adds(self.bronze_path, v)]
        if not files:
            return QUARANTINE.empty_table()
        # Read on the driver with pyarrow (local or s3://: Spark has no S3 file system here)
        opts = storage.options_for(self.bronze_path) or None
        rows = pa.concat_tables([pq.read_table(key, filesystem=fs) for fs, key in
                                 (storage.filesystem(f, opts) for f in files)])
        wm = F.timestamp_micros(F.lit(watermark_ms * 1000))
        late = (validated(self.spark.createDataFrame(rows))
                .where(F.col("dedup_time").isNotNull() & (F.col("dedup_time") <= wm))
                .withColumn("reasons", F.lit("late")))
        return self._quarantine(late.toArrow(), datetime.now(UTC))

    def _quarantine(self, rows: pa.Table, now: datetime) -> pa.Table:
        cols = {n: rows.column(n) for n in QUARANTINE.names if n in rows.column_names}
        cols["reason"] = rows.column("reasons")
        cols["quarantined_at"] = pa.array([now] * rows.num_rows, pa.timestamp("us", tz="UTC"))
        return pa.table({n: cols[n] for n in QUARANTINE.names}).cast(QUARANTINE)

    def _quality(self, batch_id: int, now: datetime, out: pa.Table,
                 reasons: pa.ChunkedArray) -> pa.Table:
        """Counters, every parse check, then every suite expectation (row and set level) on the
        batch's on-time, deduplicated rows that parsed as JSON (what the suite could judge)."""
        rows = [dict(expectation=k, column=None, kind="counter", evaluated=None, passed=None,
                     failed=None, success=True, details=json.dumps({"count": v}))
                for k, v in self.last_counts.items()]
        rows += parse_quality(reasons)
        if self.suite is not None:
            rows += arrow_quality(self.suite, out.filter(pc.not_equal(reasons, "not_json")), "reasons")
        for r in rows:
            r.update(query_id=self.app_id, batch_id=batch_id, logged_at=now)
        return pa.Table.from_pylist(rows, schema=QUALITY_LOG)


def pin_dedup_mode(checkpoint: str, mode: str) -> None:
    """A checkpoint keeps the dedup mode it started with: the index's changelog and Spark's
    state store do not carry over, so resuming in the other mode would forget seen ids."""
    f = Path(checkpoint, "iotlake_dedup_mode")
    if f.exists():
        was = f.read_text().strip()
        if was != mode:
            raise ValueError(
                f"silver checkpoint {checkpoint} was started with stream.dedup = {was!r}, not "
                f"{mode!r}: set stream.dedup = {was!r} again, or rebuild silver into a new "
                f"generation (iotlake reprocess) to switch")
        return
    f.parent.mkdir(parents=True, exist_ok=True)
    started = Path(checkpoint, "offsets").exists()  # a checkpoint from before the setting
    f.write_text(("state_store" if started and not Path(checkpoint, "dedup").exists() else mode) + "\n")
    if started:
        pin_dedup_mode(checkpoint, mode)


def start(spark: SparkSession, settings: Settings, trigger: str = "live", max_rows: int | None = None,
          suite_path: Path | None = None, validate: bool = True,
          bronze_path: str | None = None, bronze_ending_version: int | None = None) -> StreamingQuery:
    """Start the silver stream; ``validate=False`` skips the suite (parse and dedup only)."""
    suite = load_suite(suite_path) if validate else None  # a bad suite fails before the stream
    ckpt = settings.checkpoint_path(TABLE)
    for name, schema in ((TABLE, SILVER), (QUARANTINE_TABLE, QUARANTINE), (QUALITY_TABLE, QUALITY_LOG)):
        ensure_table(settings.table_path(name), schema)
    app_id = query_id(ckpt)
    pin_dedup_mode(ckpt, settings.stream.dedup)
    writer = SilverBatchWriter(spark, settings, ckpt, app_id, suite, bronze_path)
    stream = (
        silver_frame(spark, settings, suite, max_rows, bronze_path, bronze_ending_version).writeStream
        .queryName(TABLE)
        .foreachBatch(writer)
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
    )
    with pool(spark, "silver"):
        return stream.start()
