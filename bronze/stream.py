"""Bronze: every Kafka record exactly as received, with its Kafka coordinates.

Nothing is parsed away: raw key and value bytes, topic / partition / offset / Kafka timestamp,
headers, and the time bronze ingested it. Malformed payloads are kept byte for byte.
"""

from __future__ import annotations

import json

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta_io import ensure_table
from lakehouse.kafka_source import ARROW_SCHEMA as KAFKA_ARROW
from lakehouse.settings import Settings
from lakehouse.streams import pool, query_id, trigger_kwargs

TABLE = "bronze"
SCHEMA = pa.schema(list(KAFKA_ARROW) + [pa.field("ingest_time", pa.timestamp("us", tz="UTC"))])


def kafka_stream(spark: SparkSession, settings: Settings, max_offsets: int | None = None) -> DataFrame:
    return (
        spark.readStream.format("iotlake_kafka")
        .option("bootstrap", settings.kafka_bootstrap)
        .option("topic", settings.kafka.topic)
        .option("max_offsets_per_trigger", str(max_offsets or settings.stream.max_offsets_per_trigger))
        .option("client_config", json.dumps(settings.kafka.client_config))
        .option("split_records", str(settings.stream.kafka_split_records))
        .option("task_rows", str(settings.stream.task_rows))
        .option("fail_on_data_loss", str(settings.stream.kafka_fail_on_data_loss).lower())
        # no bootstrap = the embedded Tansu, which keeps records in memory only
        .option("ephemeral_broker", str(not settings.kafka.bootstrap).lower())
        .load()
    )


#: Stamped by the Delta sink as it writes (``ingest_time_column``), not ``current_timestamp()`` in
#: the plan: Spark inlines that literal into generated code, a new class to compile every batch.
INGEST_TIME = "ingest_time"


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          max_offsets: int | None = None) -> StreamingQuery:
    path, ckpt = settings.table_path(TABLE), settings.checkpoint_path(TABLE)
    ensure_table(path, SCHEMA)
    writer = (
        kafka_stream(spark, settings, max_offsets).writeStream.format("iotlake_delta")
        .queryName(TABLE)
        .option("path", path)
        .option("ingest_time_column", INGEST_TIME)
        .option("app_id", query_id(ckpt))
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
    )
    with pool(spark, "bronze"):
        return writer.start()
