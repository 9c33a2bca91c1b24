"""Bronze and silver in one query (``stream.topology`` "fused", and "auto", the default, for
JSON payloads): each Kafka micro-batch is appended to bronze and, parsed, validated and
deduplicated, to silver, quarantine and the quality log in the same ``foreachBatch``.

The layered topology runs two queries: bronze from Kafka, then silver from bronze through
Delta's streaming source, which pays per batch for a snapshot of bronze, a read of the files
bronze just wrote, its own checkpoint and its own planning; and a reading waits for both
queries' batches. Here the batch is read from Kafka once (persisted for both writes), and
bronze's append runs beside silver's writer (``lakehouse.delta.concurrent_writes``).

Exactly once as in the layered queries: every table's append carries this query's id and the
batch id as its Delta transaction, so a replayed batch skips what it already committed; the
dedup index and the late-row watermark come from this query's checkpoint as in
``silver.stream``. Tables, schemas and accounting do not change. A lake keeps the topology it
started with (the checkpoints of the other would re-read what this one wrote).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from bronze.stream import TABLE as BRONZE_TABLE
from bronze.stream import ensure_table as ensure_bronze
from bronze.stream import kafka_stream
from lakehouse.delta import tables as delta_tables
from lakehouse.delta.concurrent_writes import run_at_once
from lakehouse.delta.read import partition_minutes
from lakehouse.settings import Settings
from lakehouse.streams import foreach_batch, pool, query_id, trigger_kwargs
from silver.expectations import suite_for
from silver.stream import SilverBatchWriter, ensure_tables, pin_dedup_mode, validated, watermarked

QUERY = "bronze_silver"


def check_topology(settings: Settings, query: str) -> None:
    """Fail fast when the lake's bronze was written by the other topology: its checkpoints
    would read again, or write again, what the other wrote. (A layered silver checkpoint of a
    reprocessed generation is no conflict: the fused query continues that generation.)"""
    other = (BRONZE_TABLE,) if query == QUERY else (QUERY,)
    started = [q for q in other if Path(settings.checkpoint_path(q), "offsets").is_dir()]
    if started:
        mine, was = ("fused", "layered") if query == QUERY else ("layered", "fused")
        raise ValueError(
            f"this lake's bronze was built by the {was} topology (checkpoint {started[0]}), not "
            f"{mine}: set stream.topology = {was!r} again, or start a new data_root")


class FusedBatch:
    """foreachBatch: bronze's columns to bronze, the parsed rows to the silver writer."""

    def __init__(self, settings: Settings, silver: SilverBatchWriter, app_id: str,
                 bronze_columns: list[str], keep: tuple[str, ...], tasks: int) -> None:
        self.path, self.silver, self.app_id = settings.table_path(BRONZE_TABLE), silver, app_id
        self.bronze_columns, self.keep, self.tasks = bronze_columns, keep, tasks

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        df = df.persist()  # one read of Kafka and one parse for both writes
        try:
            run_at_once(df.sparkSession, [  # silver's writer first: it runs writes at once too
                partial(self.silver, df.drop(*self.keep), batch_id),
                partial(delta_tables.append, df.select(*self.bronze_columns).coalesce(self.tasks),
                        self.path, self.app_id, batch_id)])
        finally:
            df.unpersist()


#: bronze columns silver's parse outputs too, under the same name and with the same values
_SHARED = ("value", "ingest_time")


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          suite_path: Path | None = None, validate: bool = True,
          max_offsets: int | None = None) -> StreamingQuery:
    if not settings.fused:
        raise ValueError(f'stream.topology = "{settings.stream.topology}" does not run the fused '
                         'query here (it needs JSON payloads deduplicated by the index)')
    check_topology(settings, QUERY)
    suite = suite_for(settings.telemetry, suite_path) if validate else None
    bronze_path, ckpt = settings.table_path(BRONZE_TABLE), settings.checkpoint_path(QUERY)
    ensure_bronze(spark, settings)
    ensure_tables(spark, settings)
    app_id = query_id(ckpt)
    pin_dedup_mode(ckpt, settings.stream.dedup)
    kafka = kafka_stream(spark, settings, max_offsets, partition_minutes(bronze_path),
                         live=trigger == "live")
    bronze_columns = kafka.columns
    keep = tuple(c for c in bronze_columns if c not in _SHARED)
    framed = watermarked(validated(kafka, suite, settings.telemetry, keep), settings)
    batch = FusedBatch(settings, SilverBatchWriter(spark, settings, ckpt, app_id, suite), app_id,
                       bronze_columns, keep, spark.sparkContext.defaultParallelism)
    writer = (foreach_batch(framed, QUERY, batch)
              .option("checkpointLocation", ckpt)
              .trigger(**trigger_kwargs(settings, trigger)))
    with pool(spark, "silver"):
        return writer.start()
