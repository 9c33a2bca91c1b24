"""Gold window aggregates per device and metric, on event time with a watermark.

Silver readings are unpivoted to (device_id, metric, event_time, value) and aggregated per
window: count, mean, min, max, stddev, last value. Update mode + an idempotent upsert keyed by
(device_id, metric, window_start) keeps every window, open ones included, current in Delta
(``gold_metrics_1m``; the sliding ``gold_metrics_5m`` is rolled up from it where
``gold.slide_window_seconds`` turns it on, off by default). The upsert
(``delta_tables.upsert_recent``) MERGEs while the files of recent windows are small and
otherwise replaces the recent rows in sorted, bounded files, so a batch rewrites about its own
windows however long the day's partition has grown.

Final windows are also appended once to ``gold_metrics_1m_final`` / ``gold_metrics_5m_final``,
from the same foreachBatch rather than a second append-mode query (which would keep a second
state store for identical aggregates). A window is final once its end is <= the batch's
watermark (``offsets/<batch>`` in the checkpoint, the watermark Spark evicts state with):
Spark drops rows at or below the previous batch's watermark, so after this batch's upsert no
row can reach such a window again. Batch k appends, read back from the merged tables, the
windows ending in (watermark of batch k-1, watermark of batch k] (until a new checkpoint's
watermark leaves zero, the lower bound is the final table's latest window_end): watermarks only grow, so
every window lands exactly once, with the merged values. A replayed batch reuses its offsets
file, so the same range, and its append is skipped by the Delta app transaction (query id,
batch id). Final rows lag the merged ones by the watermark; no-data batches, which Spark runs
when the watermark advances (also at the end of an ``available_now`` run), append them too.

Every write is delta-spark's (``lakehouse.delta.tables``), exactly once per (query id, batch id);
the batch's rows stay in Spark. Reads of the merged tables go through Spark with literal time
bounds, so Delta skips the files whose statistics lie outside them.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta.read import table_exists
from lakehouse.delta.tables import append, ensure_named_table, timestamp_literal, upsert_recent
from lakehouse.settings import Settings
from lakehouse.streams import batch_watermark_ms, foreach_batch, pool, query_id, trigger_kwargs
from lakehouse.tables import METRIC_WINDOWS

log = logging.getLogger(__name__)

TABLE = "gold_metrics_1m"
SLIDING_TABLE = "gold_metrics_5m"
FINAL_TABLE = "gold_metrics_1m_final"
SLIDING_FINAL_TABLE = "gold_metrics_5m_final"
KEYS = ["device_id", "metric", "window_start"]
COLUMNS = METRIC_WINDOWS.names
#: Rows per file of the merged tables, at least (``delta_tables.upsert_recent``: a batch rewrites
#: the files holding its windows; four times the batch's windows per file, or this).
MIN_ROWS_PER_FILE = 10_000


def readings_long(silver: DataFrame, metrics: tuple[str, ...]) -> DataFrame:
    """One row per (reading, metric) with a non-null value; the state is keyed by metric, so a
    metric added to the model needs no new checkpoint."""
    pairs = F.array(*[F.struct(F.lit(m).alias("metric"), F.col(m).cast("double").alias("value")) for m in metrics])
    return (
        silver.select("device_id", "event_time", F.explode(pairs).alias("p"))
        .select("device_id", "event_time", "p.metric", "p.value")
        .where(F.col("value").isNotNull())
    )


def tables(settings: Settings) -> tuple[str, ...]:
    """The tables the window stream writes: the sliding pair only while it is on."""
    sliding = (SLIDING_TABLE, SLIDING_FINAL_TABLE) if settings.gold.slide_window_seconds else ()
    return (TABLE, FINAL_TABLE, *sliding)


def stale_tables(settings: Settings) -> list[str]:
    """Sliding tables on disk that the window stream no longer writes (turned off, or a
    deployment from before they were off by default): they keep their rows but stop growing."""
    written = tables(settings)
    return [t for t in (SLIDING_TABLE, SLIDING_FINAL_TABLE)
            if t not in written and table_exists(settings.table_path(t))]


def window_aggregates(silver: DataFrame, metrics: tuple[str, ...], window_seconds: int,
                      watermark_seconds: int, slide_seconds: int | None = None) -> DataFrame:
    w = F.window("event_time", f"{window_seconds} seconds",
                 f"{slide_seconds} seconds" if slide_seconds else None)
    return (
        readings_long(silver, metrics)
        .withWatermark("event_time", f"{watermark_seconds} seconds")
        .groupBy("device_id", "metric", w.alias("w"))
        .agg(
            F.count("value").alias("count"), F.avg("value").alias("mean"),
            F.min("value").alias("min"), F.max("value").alias("max"),
            F.stddev_samp("value").alias("stddev"), F.max_by("value", "event_time").alias("last"),
        )
        .select("device_id", "metric", F.col("w.start").alias("window_start"),
                F.col("w.end").alias("window_end"), "count", "mean", "min", "max", "stddev", "last")
    )


def silver_stream(spark: SparkSession, settings: Settings, columns: list[str] | None = None,
                  silver_path: str | None = None) -> DataFrame:
    """Silver through Delta's streaming source. Silver is appended to; compaction commits are
    ``dataChange=false`` and retention deletes are skipped (``skipChangeCommits``). ``columns``
    limits what is read from Parquet."""
    g = settings.gold
    reader = (spark.readStream.format("delta").option("skipChangeCommits", "true")
              .option("maxFilesPerTrigger", str(g.max_files_per_trigger)))
    if g.max_bytes_per_trigger:
        reader = reader.option("maxBytesPerTrigger", str(g.max_bytes_per_trigger))
    df = reader.load(silver_path or settings.table_path("silver"))
    return df.select(*columns) if columns else df


def _utc(epoch_s: int) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)


def ts(epoch_s: int) -> str:
    """A SQL timestamp literal (a literal lets Delta skip files by their statistics)."""
    return timestamp_literal(_utc(epoch_s))


def between(column: str, after_s: int | None, upto_s: int, lower_inclusive: bool = False) -> str:
    """``after_s < column <= upto_s`` (``>=`` with ``lower_inclusive``; no lower bound for None)."""
    cond = f"{column} <= {ts(upto_s)}"
    if after_s is not None:
        cond = f"{column} {'>=' if lower_inclusive else '>'} {ts(after_s)} AND {cond}"
    return cond


class MergeBatch:
    """foreachBatch: upsert the updated windows and their sliding windows, then append final ones.

    Sliding windows (e.g. 5 minutes every minute) are rolled up from the tumbling ones instead of
    being a second stateful aggregation: count, mean, min, max, stddev and last combine exactly.
    """

    def __init__(self, settings: Settings, app_id: str, checkpoint: str) -> None:
        self.path = settings.table_path(TABLE)
        self.slide_path = settings.table_path(SLIDING_TABLE)
        self.finals = {self.path: settings.table_path(FINAL_TABLE)}
        self.app_id, self.checkpoint = app_id, checkpoint
        g = settings.gold
        self.base, self.size, self.every = settings.stream.window_seconds, g.slide_window_seconds, g.slide_every_seconds
        if self.size:
            self.finals[self.slide_path] = settings.table_path(SLIDING_FINAL_TABLE)
        if self.size % self.base or self.every % self.base:
            raise ValueError(f"gold.slide_window_seconds ({self.size}) and gold.slide_every_seconds "
                             f"({self.every}) must be multiples of stream.window_seconds ({self.base})")

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        spark = df.sparkSession
        df = df.persist()  # read by the upsert and by the sliding roll-up
        try:
            n, lo, hi = df.agg(F.count(F.lit(1)), F.min(F.unix_seconds("window_start")),
                               F.max(F.unix_seconds("window_start"))).first()
            if n:
                per_file = max(4 * n, MIN_ROWS_PER_FILE)
                upsert_recent(df.select(*COLUMNS), self.path, KEYS, "window_start", _utc(lo),
                              self.app_id, batch_id, per_file)
                if self.size:  # sliding windows on
                    sliding = sliding_windows(spark, self.path, df, lo, hi, self.base, self.size, self.every)
                    upsert_recent(sliding, self.slide_path, KEYS, "window_start", _utc(lo - self.size),
                                  self.app_id, batch_id, per_file)
            # also on empty (no-data) batches: they exist to advance the watermark
            self.append_final(spark, batch_id)
        finally:
            df.unpersist()

    def append_final(self, spark: SparkSession, batch_id: int) -> None:
        """Append the windows this batch's watermark made final (see the module docstring)."""
        upto = final_upto_s(self.checkpoint, batch_id, self.base)
        if not upto:  # unknown batch, or no watermark yet
            return
        before = final_upto_s(self.checkpoint, batch_id - 1, self.base)
        for merged, final in self.finals.items():
            # the previous batch's bound; none yet (a new checkpoint): what the table holds
            done = before or last_window_end_s(spark, final)
            if done is not None and upto <= done:
                continue
            rows = (spark.read.format("delta").load(merged)
                    .where(between("window_end", done, upto)).select(*COLUMNS))
            if not rows.isEmpty():  # a small read (file statistics) is cheaper than an empty commit
                append(rows, final, self.app_id, batch_id)


def final_upto_s(checkpoint: str, batch_id: int, base: int) -> int | None:
    """Windows ending at or before this (epoch s) are final in ``batch_id``: its watermark on the
    base window's grid (window ends lie on it: sliding sizes and slides are multiples of it).
    None: the checkpoint's offsets log has no such batch."""
    if batch_id < 0 or not Path(checkpoint, "offsets", str(batch_id)).exists():
        return None
    return batch_watermark_ms(checkpoint, batch_id) // (base * 1000) * base


def last_window_end_s(spark: SparkSession, path: str) -> int | None:
    """Latest window_end in a table (a read of one column: only until a checkpoint's watermark
    first leaves zero, e.g. a new checkpoint on tables an earlier one wrote)."""
    return (spark.read.format("delta").load(path)
            .agg(F.max(F.unix_seconds("window_end"))).first()[0])


def slide_starts(epoch_s: Column, base: int, size: int, every: int) -> Column:
    """Starts (epoch s) of the sliding windows that contain the base window starting at ``epoch_s``."""
    first = F.ceil((epoch_s + (base - size)) / F.lit(every)).cast("long") * every
    starts = F.transform(F.sequence(F.lit(0), F.lit(size // every - 1)), lambda k: first + k * every)
    return F.filter(starts, lambda s: s <= epoch_s)


def sliding_windows(spark: SparkSession, tumbling_path: str, changed: DataFrame, lo: int, hi: int,
                    base: int, size: int, every: int) -> DataFrame:
    """Recompute the sliding windows that contain any changed tumbling window (their starts in
    epoch s lie in [``lo``, ``hi``]), from the merged tumbling table."""
    def starts(c: DataFrame) -> Column:
        return F.explode(slide_starts(F.unix_seconds(c["window_start"]), base, size, every)).alias("slide_start")

    touched = changed.select("device_id", "metric", starts(changed)).distinct()
    t = (spark.read.format("delta").load(tumbling_path)
         .where(between("window_start", lo - size, hi + size, lower_inclusive=True)))
    x = (t.select("device_id", "metric", "window_start", "count", "mean", "min", "max", "stddev",
                  "last", starts(t))
         .join(touched, ["device_id", "metric", "slide_start"], "left_semi"))
    c = F.col("count")
    sumsq = F.greatest(c - 1, F.lit(0)) * F.pow(F.coalesce("stddev", F.lit(0.0)), 2) + c * F.col("mean") ** 2
    g = x.groupBy("device_id", "metric", "slide_start").agg(
        F.sum(c).alias("count"), F.sum(c * F.col("mean")).alias("wsum"), F.sum(sumsq).alias("sumsq"),
        F.min("min").alias("min"), F.max("max").alias("max"),
        F.max_by("last", "window_start").alias("last"))
    mean = F.col("wsum") / F.col("count")
    var = (F.col("sumsq") - F.col("count") * mean ** 2) / (F.col("count") - 1)
    return g.select(
        "device_id", "metric", F.timestamp_seconds("slide_start").alias("window_start"),
        F.timestamp_seconds(F.col("slide_start") + size).alias("window_end"), "count",
        mean.alias("mean"), "min", "max",
        F.when(F.col("count") > 1, F.sqrt(F.greatest(var, F.lit(0.0)))).alias("stddev"), "last")


def start(spark: SparkSession, settings: Settings, trigger: str = "live") -> StreamingQuery:
    metrics = settings.telemetry.require_metrics().gold_metrics
    ckpt = settings.checkpoint_path(TABLE)
    stale = stale_tables(settings)
    if stale:
        log.warning("%s: kept as they are but no longer updated, as gold.slide_window_seconds is 0 "
                    "(off by default); set it to e.g. 300 to keep them current", ", ".join(stale))
    for name in tables(settings):
        ensure_named_table(spark, settings, name, METRIC_WINDOWS)
    batch = MergeBatch(settings, query_id(ckpt), ckpt)
    agg = window_aggregates(silver_stream(spark, settings, columns=["device_id", "event_time", *metrics]),
                            metrics, settings.stream.window_seconds, settings.stream.watermark_seconds)
    writer = (
        foreach_batch(agg, TABLE, batch).outputMode("update")
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger, layer="windows"))
    )
    with pool(spark, "gold"):
        return writer.start()
