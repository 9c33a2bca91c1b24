"""Gold window aggregates per device and metric, on event time with a watermark.

Silver readings are unpivoted to (device_id, metric, event_time, value) and aggregated per
window: count, mean, min, max, stddev, last value. Update mode + an idempotent MERGE keyed by
(device_id, metric, window_start) keeps every window, open ones included, current in Delta.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta_io import MergeSpec, ensure_table, merge_arrow
from lakehouse.settings import Settings
from lakehouse.streams import query_id, trigger_kwargs
from lakehouse.tables import METRIC_WINDOWS, METRICS

TABLE = "gold_metrics_1m"
KEYS = ["device_id", "metric", "window_start"]


def readings_long(silver: DataFrame) -> DataFrame:
    """One row per (reading, metric) with a non-null value."""
    pairs = F.array(*[F.struct(F.lit(m).alias("metric"), F.col(m).cast("double").alias("value")) for m in METRICS])
    return (
        silver.select("device_id", "event_time", F.explode(pairs).alias("p"))
        .select("device_id", "event_time", "p.metric", "p.value")
        .where(F.col("value").isNotNull())
    )


def window_aggregates(silver: DataFrame, window_seconds: int, watermark_seconds: int,
                      slide_seconds: int | None = None) -> DataFrame:
    w = F.window("event_time", f"{window_seconds} seconds",
                 f"{slide_seconds} seconds" if slide_seconds else None)
    return (
        readings_long(silver)
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


def silver_stream(spark: SparkSession, settings: Settings, max_rows: int | None = None,
                  silver_path: str | None = None) -> DataFrame:
    return (
        spark.readStream.format("iotlake_delta_stream")
        .option("path", silver_path or settings.table_path("silver"))
        .option("max_rows_per_trigger", str(max_rows or settings.stream.max_rows_per_trigger))
        .load()
    )


class MergeBatch:
    """foreachBatch: MERGE the updated windows, exactly once per batch id."""

    def __init__(self, path: str, app_id: str) -> None:
        self.path, self.app_id = path, app_id

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        data = df.toArrow()
        if data.num_rows:
            merge_arrow(self.path, data.select(METRIC_WINDOWS.names).cast(METRIC_WINDOWS),
                        MergeSpec(KEYS), self.app_id, batch_id)


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          max_rows: int | None = None) -> StreamingQuery:
    path, ckpt = settings.table_path(TABLE), settings.checkpoint_path(TABLE)
    ensure_table(path, METRIC_WINDOWS)
    agg = window_aggregates(silver_stream(spark, settings, max_rows), settings.stream.window_seconds,
                            settings.stream.watermark_seconds)
    return (
        agg.writeStream.queryName(TABLE).outputMode("update")
        .foreachBatch(MergeBatch(path, query_id(ckpt)))
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
        .start()
    )
