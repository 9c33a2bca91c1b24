"""Bronze: every Kafka record exactly as received, with its Kafka coordinates.

Nothing is parsed away: raw key and value bytes, topic / partition / offset / Kafka timestamp,
headers, and the time bronze ingested it. Malformed payloads are kept byte for byte.

Spark's Kafka source keeps the offsets in the checkpoint, and each micro-batch is appended with
the query id and batch id as its Delta transaction (``lakehouse.delta_tables.append``, as
Delta's own streaming sink does, without the sink's log replay per batch), so a batch replayed
after a crash is written once.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse import delta_tables
from lakehouse.delta_read import partition_minutes
from lakehouse.kafka_topics import ensure_topics
from lakehouse.settings import Settings
from lakehouse.streams import foreach_batch, pool, query_id, trigger_kwargs
from lakehouse.tables import BRONZE, PARTITION_COLUMN, bucket_sql

TABLE = "bronze"
SCHEMA = BRONZE

#: librdkafka keys the Java client reads under the same name (``kafka.`` prefixed for Spark).
_SHARED_KEYS = ("security.protocol", "sasl.mechanism", "ssl.endpoint.identification.algorithm",
                "client.id", "request.timeout.ms")
_JAAS = {"PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
         "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
         "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule"}


def java_client_options(client_config: dict[str, str]) -> dict[str, str]:
    """Spark ``kafka.*`` options from the librdkafka-style ``kafka.client_config`` the bridge
    uses: the keys both clients share, ``ssl.ca.location`` as a PEM truststore, and a JAAS line
    for PLAIN / SCRAM built from ``sasl.username`` / ``sasl.password``."""
    c = dict(client_config)
    out = {f"kafka.{k}": str(c[k]) for k in _SHARED_KEYS if k in c}
    if "ssl.ca.location" in c:
        out["kafka.ssl.truststore.location"] = str(c["ssl.ca.location"])
        out["kafka.ssl.truststore.type"] = "PEM"
    user = c.get("sasl.username")
    if user is not None:
        mech = str(c.get("sasl.mechanism", "PLAIN")).upper()
        if mech not in _JAAS:
            raise ValueError(f"kafka.client_config: sasl.mechanism {mech!r} is not supported by "
                             f"bronze's Kafka source (use one of {', '.join(_JAAS)})")
        pw = str(c.get("sasl.password", "")).replace("\\", "\\\\").replace('"', '\\"')
        u = str(user).replace("\\", "\\\\").replace('"', '\\"')
        out["kafka.sasl.jaas.config"] = f'{_JAAS[mech]} required username="{u}" password="{pw}";'
    return out


def kafka_stream(spark: SparkSession, settings: Settings, max_offsets: int | None = None,
                 bucket_minutes: int | None = None, live: bool = False) -> DataFrame:
    """The topic as Spark's Kafka source reads it, in bronze's columns; with ``bucket_minutes``
    also the time-bucket partition column (``lakehouse.tables.PARTITION_COLUMN``). ``live``: a
    streaming run that batches slow traffic (``stream.min_offsets_per_trigger``); catch-up
    runs (``availableNow``) take what is there."""
    st = settings.stream
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", settings.kafka_bootstrap)
        .option("subscribe", settings.kafka.topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(max_offsets or st.max_offsets_per_trigger))
        .option("failOnDataLoss", str(st.kafka_fail_on_data_loss).lower())
        .option("includeHeaders", "true")
    )
    if st.kafka_min_partitions:
        reader = reader.option("minPartitions", str(st.kafka_min_partitions))
    if live and st.min_offsets_per_trigger:
        reader = (reader.option("minOffsetsPerTrigger", str(st.min_offsets_per_trigger))
                  .option("maxTriggerDelay", f"{int(st.max_batch_delay_seconds * 1000)}ms"))
    for k, v in java_client_options(settings.kafka.client_config).items():
        reader = reader.option(k, v)
    df = reader.load().select(
        "key", "value", "topic", "partition", "offset", "timestamp", "headers",
        F.current_timestamp().alias("ingest_time"))
    if bucket_minutes:
        df = df.withColumn(PARTITION_COLUMN, F.expr(bucket_sql(TABLE, bucket_minutes)))
    return df


def ensure_table(spark: SparkSession, settings: Settings) -> None:
    """The bronze table and the Kafka topics exist before a query subscribes."""
    # readers see an empty table before data; partitioned by the ingest time's bucket, computed
    # by the stream into a plain column (as bronze tables have always been created)
    delta_tables.ensure_named_table(spark, settings, TABLE, SCHEMA, generated=False)
    # Started on its own (a bronze role, a backfill), bronze may come up before the bridge has
    # created the topic; subscribing to a missing topic fails the query.
    ensure_topics(settings)


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          max_offsets: int | None = None) -> StreamingQuery:
    path, ckpt = settings.table_path(TABLE), settings.checkpoint_path(TABLE)
    ensure_table(spark, settings)
    app_id = query_id(ckpt)  # also locks the checkpoint: a second writer fails fast
    # A file per Kafka partition per batch made bronze the most crowded table at one-second
    # batches (docs/benchmarks.md, session 20's soak); one write task per core does the same
    # work in fewer files. On a cluster, cores outnumber partitions: nothing changes there.
    tasks = spark.sparkContext.defaultParallelism
    stream = kafka_stream(spark, settings, max_offsets, partition_minutes(path), live=trigger == "live")
    writer = (
        foreach_batch(stream, TABLE,
                      lambda df, batch_id: delta_tables.append(df.coalesce(tasks), path, app_id, batch_id))
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
    )
    with pool(spark, "bronze"):
        return writer.start()
