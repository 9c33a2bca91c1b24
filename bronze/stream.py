"""Bronze: every Kafka record exactly as received, with its Kafka coordinates.

Nothing is parsed away: raw key and value bytes, topic / partition / offset / Kafka timestamp,
headers, and the time bronze ingested it. Malformed payloads are kept byte for byte.

Spark's Kafka source keeps the offsets in the checkpoint, and each micro-batch is appended with
the query id and batch id as its Delta transaction (``lakehouse.delta.tables.append``, as
Delta's own streaming sink does, without the sink's log replay per batch), so a batch replayed
after a crash is written once.
"""

from __future__ import annotations

import base64
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta import tables as delta_tables
from lakehouse.delta.read import partition_minutes
from lakehouse.kafka.config import client_config
from lakehouse.kafka.topics import ensure_topics
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


#: PBES2's object id, DER-encoded: how OpenSSL 3 and ``cryptography`` encrypt PKCS#8 keys.
_PBES2_OID = bytes.fromhex("06092a864886f70d01050d")
_TO_PKCS8 = ("convert it with `openssl pkcs8 -topk8 -in KEY -out KEY.pk8` and -nocrypt, or "
             "-v1 PBE-SHA1-3DES to keep it encrypted (both clients read that), and point to it")


def _pem_key(text: str, where: str) -> str:
    """The Java client reads PKCS#8 keys only (``BEGIN [ENCRYPTED] PRIVATE KEY``), and on Java 17
    no PBES2-encrypted one (``SecretKeyFactory`` has no PBES2; found by
    ``tests/test_kafka_security.py``): fail here, not in bronze's first batch."""
    if "-----BEGIN RSA PRIVATE KEY-----" in text or "-----BEGIN EC PRIVATE KEY-----" in text:
        raise ValueError(f"kafka.client_config: {where} is a PKCS#1/SEC1 key, which bronze's Kafka "
                         f"source cannot read: {_TO_PKCS8}")
    rest = text.partition("-----BEGIN ENCRYPTED PRIVATE KEY-----")[2]
    if rest:
        body = "".join(rest.split("-----END", 1)[0].split())
        if _PBES2_OID in base64.b64decode(body)[:24]:
            raise ValueError(f"kafka.client_config: {where} is encrypted with PBES2, which bronze's "
                             f"Kafka source (Java) cannot decrypt: {_TO_PKCS8}")
    return text


def _pem(c: dict[str, str], name: str) -> str | None:
    """``ssl.<name>.pem``, or the contents of the file ``ssl.<name>.location`` names."""
    if f"ssl.{name}.pem" in c:
        return c[f"ssl.{name}.pem"]
    path = c.get(f"ssl.{name}.location")
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"kafka.client_config: ssl.{name}.location {path}: {e.strerror}; "
                         "point it at a readable PEM file") from e


def _ssl_options(c: dict[str, str]) -> dict[str, str]:
    """librdkafka's trust store, client certificate and key as the Java client's PEM (or
    PKCS#12) stores. Certificate and key in one file: its path; in two: their contents, as the
    Java client's ``ssl.keystore.location`` wants both in one file."""
    out: dict[str, str] = {}
    ca = c.get("ssl.ca.location")
    if ca and ca != "probe":  # probe: librdkafka finds the system's CAs; Java has its own
        out |= {"ssl.truststore.location": ca, "ssl.truststore.type": "PEM"}
    elif "ssl.ca.pem" in c:
        out |= {"ssl.truststore.certificates": c["ssl.ca.pem"], "ssl.truststore.type": "PEM"}
    cert, key = _pem(c, "certificate"), _pem(c, "key")
    key_where = "ssl.key.pem" if "ssl.key.pem" in c else "ssl.key.location"
    if (cert is None) != (key is None):
        raise ValueError("kafka.client_config: a client certificate needs its key and a key its "
                         "certificate (set both ssl.certificate.location and ssl.key.location)")
    if cert is not None and key is not None:
        _pem_key(key, key_where)
        if c.get("ssl.certificate.location") and c.get("ssl.certificate.location") == c.get("ssl.key.location"):
            out["ssl.keystore.location"] = c["ssl.key.location"]
        else:
            out |= {"ssl.keystore.certificate.chain": cert, "ssl.keystore.key": key}
        out["ssl.keystore.type"] = "PEM"
    elif "ssl.keystore.location" in c:  # librdkafka's keystore is PKCS#12
        out |= {"ssl.keystore.location": c["ssl.keystore.location"], "ssl.keystore.type": "PKCS12"}
        if "ssl.keystore.password" in c:
            out["ssl.keystore.password"] = c["ssl.keystore.password"]
    if "ssl.key.password" in c:
        out["ssl.key.password"] = c["ssl.key.password"]
    return out


def java_client_options(client_config: dict[str, str]) -> dict[str, str]:
    """Spark ``kafka.*`` options from the librdkafka-style client configuration the bridge
    uses (``lakehouse.kafka.config.client_config``): the keys both clients share, the TLS trust
    store, certificate and key as PEM stores (``_ssl_options``), and a JAAS line for PLAIN /
    SCRAM built from ``sasl.username`` / ``sasl.password``."""
    c = {k: str(v) for k, v in client_config.items()}
    out = {f"kafka.{k}": c[k] for k in _SHARED_KEYS if k in c}
    out |= {f"kafka.{k}": v for k, v in _ssl_options(c).items()}
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
    for k, v in java_client_options(client_config(settings)).items():
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
    # batches (an hour-long soak counted them); one write task per core does the same
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
