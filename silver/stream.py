"""Silver: parsed, typed, deduplicated under an event-time watermark, validated.

bronze (Delta stream) -> parse -> validate (suite compiled to one Spark expression) ->
dropDuplicatesWithinWatermark(event_id) (RocksDB state in the checkpoint) -> foreachBatch:
valid rows to ``silver``, failing rows to ``quarantine`` with every reason, and per-batch
counts to ``quality_log``. Every bronze row is accounted for:

    bronze rows in batch = silver + quarantine + duplicates dropped + late

Rows the watermark drops are recovered from the batch's own bronze files (the offsets log
says which versions and which watermark the batch used) and quarantined with reason ``late``.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta_io import append_arrow, ensure_table
from lakehouse.delta_source import commit_adds
from lakehouse.settings import Settings
from lakehouse.streams import query_id, trigger_kwargs
from lakehouse.tables import QUALITY_LOG, QUARANTINE, SILVER
from silver.parse import parse

log = logging.getLogger(__name__)

TABLE, QUARANTINE_TABLE, QUALITY_TABLE = "silver", "quarantine", "quality_log"
DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "expectations" / "telemetry.json"


def _row_checks(suite_path: Path | None):
    """The suite's row-level expectations as one array<string> column (names of failures)."""
    path = suite_path or DEFAULT_SUITE
    if not path.exists():
        return F.array().cast("array<string>"), None
    from silver.expectations import failed_expectations, load_suite

    suite = load_suite(path)
    return failed_expectations(suite), suite


def validated(bronze: DataFrame, suite_path: Path | None = None, validate: bool = True) -> DataFrame:
    parsed = parse(bronze)
    checks, _ = _row_checks(suite_path) if validate else (F.array().cast("array<string>"), None)
    reasons = F.when(F.array_contains("parse_reasons", "not_json"), F.array(F.lit("not_json"))).otherwise(
        F.concat("parse_reasons", checks))
    keyed = F.col("event_id").isNotNull() & F.col("event_time").isNotNull()
    return (
        parsed.withColumn("reasons", reasons)
        # rows without id/time cannot be deduplicated: a unique key per bronze row, no event time
        .withColumn("dedup_key", F.when(keyed, F.col("event_id")).otherwise(
            F.concat_ws(":", F.lit("bronze"), "kafka_topic", "kafka_partition", "kafka_offset")))
        .withColumn("dedup_time", F.when(keyed, F.col("event_time")))
        .drop("parse_reasons")
    )


def silver_frame(spark: SparkSession, settings: Settings, suite_path: Path | None = None,
                 validate: bool = True, max_rows: int | None = None,
                 bronze_path: str | None = None) -> DataFrame:
    bronze = (
        spark.readStream.format("iotlake_delta_stream")
        .option("path", bronze_path or settings.table_path("bronze"))
        .option("max_rows_per_trigger", str(max_rows or settings.stream.max_rows_per_trigger))
        .load()
    )
    wm = f"{settings.stream.watermark_seconds} seconds"
    return (
        validated(bronze, suite_path, validate)
        .withWatermark("dedup_time", wm)
        .dropDuplicatesWithinWatermark(["dedup_key"])
    )


# ---- per-batch bookkeeping from the checkpoint's offsets log ------------------------------

def _offset_entry(checkpoint: str, batch_id: int) -> tuple[dict, dict] | None:
    f = Path(checkpoint, "offsets", str(batch_id))
    if not f.exists():
        return None
    lines = f.read_text().splitlines()
    return json.loads(lines[1]), json.loads(lines[2])


def batch_input(checkpoint: str, batch_id: int, bronze_path: str) -> tuple[list[int], int, int]:
    """(bronze versions read, rows read, watermark ms) of one micro-batch."""
    cur = _offset_entry(checkpoint, batch_id)
    if cur is None:
        raise RuntimeError(f"offsets log for batch {batch_id} missing in {checkpoint}")
    meta, end = cur
    prev = _offset_entry(checkpoint, batch_id - 1) if batch_id > 0 else None
    start = prev[1]["version"] if prev else -1
    versions = list(range(start + 1, end["version"] + 1))
    rows = sum(n for v in versions for _, n in commit_adds(bronze_path, v))
    return versions, rows, int(meta.get("batchWatermarkMs", 0))


class SilverBatchWriter:
    """foreachBatch function: route, write exactly once, log quality counts."""

    def __init__(self, spark: SparkSession, settings: Settings, checkpoint: str, app_id: str,
                 suite_path: Path | None = None, bronze_path: str | None = None,
                 paths: dict[str, str] | None = None) -> None:
        self.spark, self.settings, self.checkpoint, self.app_id = spark, settings, checkpoint, app_id
        self.suite_path = suite_path
        self.bronze_path = bronze_path or settings.table_path("bronze")
        self.paths = paths or {t: settings.table_path(t) for t in (TABLE, QUARANTINE_TABLE, QUALITY_TABLE)}
        self.last_counts: dict[str, int] = {}

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        versions, rows_in, watermark_ms = batch_input(self.checkpoint, batch_id, self.bronze_path)
        out = df.toArrow()  # always run the batch: Spark checks every state store committed
        if rows_in == 0:  # no-data batch (watermark advance only): nothing to write
            self.last_counts = {}
            return
        now = datetime.now(UTC)
        reasons = out.column("reasons")
        bad = pc.greater(pc.list_value_length(reasons), 0)
        good_rows = out.filter(pc.invert(bad))
        bad_rows = out.filter(bad)
        late = self._late_rows(versions, watermark_ms) if rows_in > out.num_rows else None
        n_late = late.num_rows if late is not None else 0
        duplicates = rows_in - out.num_rows - n_late
        if duplicates < 0:
            raise RuntimeError(f"silver batch {batch_id}: accounting broke ({rows_in} in, "
                               f"{out.num_rows} out, {n_late} late)")

        silver = good_rows.select(SILVER.names).cast(SILVER)
        quarantine = self._quarantine(bad_rows, now)
        if late is not None and late.num_rows:
            quarantine = pa.concat_tables([quarantine, late])
        for name, data in ((TABLE, silver), (QUARANTINE_TABLE, quarantine)):
            if data.num_rows:
                append_arrow(self.paths[name], data, self.app_id, batch_id)
        self.last_counts = {"rows_in": rows_in, "silver": silver.num_rows,
                            "quarantine": quarantine.num_rows - n_late, "duplicates": duplicates,
                            "late": n_late}
        append_arrow(self.paths[QUALITY_TABLE], self._quality(batch_id, now, reasons, out.num_rows),
                     self.app_id, batch_id)

    def _quarantine(self, rows: pa.Table, now: datetime) -> pa.Table:
        reason = pc.binary_join(rows.column("reasons").cast(pa.list_(pa.string())), ",")
        cols = {n: rows.column(n) for n in QUARANTINE.names if n in rows.column_names}
        cols["reason"] = reason
        cols["quarantined_at"] = pa.array([now] * rows.num_rows, pa.timestamp("us", tz="UTC"))
        return pa.table({n: cols[n] for n in QUARANTINE.names}).cast(QUARANTINE)

    def _late_rows(self, versions: list[int], watermark_ms: int) -> pa.Table:
        """Re-read this batch's bronze files; rows at or below the watermark were dropped."""
        files = [str(Path(self.bronze_path, p)) for v in versions for p, _ in commit_adds(self.bronze_path, v)]
        if not files or watermark_ms <= 0:
            return QUARANTINE.empty_table()
        wm = datetime.fromtimestamp(watermark_ms / 1000, UTC)
        raw = self.spark.read.parquet(*files)
        late = (validated(raw, self.suite_path)
                .where(F.col("dedup_time").isNotNull() & (F.col("dedup_time") <= F.lit(wm)))
                .withColumn("reasons", F.array(F.lit("late"))))
        return self._quarantine(late.toArrow(), datetime.now(UTC))

    def _quality(self, batch_id: int, now: datetime, reasons: pa.ChunkedArray, n: int) -> pa.Table:
        rows = [dict(expectation=k, column=None, kind="counter", evaluated=None, passed=None,
                     failed=None, success=True, details=json.dumps({"count": v}))
                for k, v in self.last_counts.items()]
        flat = pc.list_flatten(reasons)
        counts = {} if len(flat) == 0 else {
            d["values"]: d["counts"] for d in pc.value_counts(flat).to_pylist()}
        for name, failed in sorted(counts.items()):
            rows.append(dict(expectation=name, column=None, kind="row", evaluated=n,
                             passed=n - failed, failed=failed, success=failed == 0, details=None))
        for r in rows:
            r.update(query_id=self.app_id, batch_id=batch_id, logged_at=now)
        return pa.Table.from_pylist(rows, schema=QUALITY_LOG)


def start(spark: SparkSession, settings: Settings, trigger: str = "live", max_rows: int | None = None,
          suite_path: Path | None = None, validate: bool = True) -> StreamingQuery:
    ckpt = settings.checkpoint_path(TABLE)
    for name, schema in ((TABLE, SILVER), (QUARANTINE_TABLE, QUARANTINE), (QUALITY_TABLE, QUALITY_LOG)):
        ensure_table(settings.table_path(name), schema)
    writer = SilverBatchWriter(spark, settings, ckpt, query_id(ckpt), suite_path)
    return (
        silver_frame(spark, settings, suite_path, validate, max_rows).writeStream
        .queryName(TABLE)
        .foreachBatch(writer)
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
        .start()
    )
