"""Parse raw bronze payloads into the typed, versioned telemetry schema.

Version 1 of the payload: ``schema_version, device_id, event_id, ts`` (ISO-8601 event time) and
numeric metrics. Unknown fields are kept as JSON in ``extra`` (additive schema evolution), so a
device that sends a new field never fails. Parse problems become reasons, not exceptions: the
row is routed to quarantine with them.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import MapType, StringType

from lakehouse.tables import METRICS

SCHEMA_VERSION = 1
KNOWN_FIELDS = ("schema_version", "device_id", "event_id", "ts", *METRICS, "status")
_PAYLOAD = MapType(StringType(), StringType())
#: Every parse reason with the payload field it checks; the quality log counts each per batch.
#: ``not_json`` is checked on every row, the others only on rows that are JSON objects.
PARSE_CHECKS: tuple[tuple[str, str], ...] = (
    ("not_json", "value"), ("missing_event_id", "event_id"), ("missing_ts", "ts"), ("bad_ts", "ts"),
    *((f"wrong_type:{c}", c) for c in (*METRICS, "schema_version")),
)


def _nonempty(c: Column) -> Column:
    return c.isNotNull() & (F.length(F.trim(c)) > 0)


def parse(bronze: DataFrame) -> DataFrame:
    """Bronze rows -> typed columns + ``parse_reasons`` (comma-joined, "" when parseable).

    No higher-order functions (``filter``/``map_filter`` with a lambda): Spark interprets those
    row by row, which roughly doubled the cost of parsing.
    """
    m = F.from_json(F.col("value").cast("string"), _PAYLOAD, {"mode": "PERMISSIVE"})
    df = bronze.withColumn("_m", m)
    m = F.col("_m")
    ts = m["ts"]
    event_time = F.coalesce(
        F.expr("try_to_timestamp(_m['ts'])"),
        # epoch milliseconds are accepted too
        F.when(ts.rlike(r"^\d{12,14}$"), F.timestamp_millis(F.expr("try_cast(_m['ts'] as bigint)"))),
    )
    # An event time no device clock can produce is unparseable (``bad_ts``): before the epoch, or
    # more than a day after bronze received the record (relative to ingest_time, so a replay routes
    # it the same). Kept, it would advance the watermark for everyone (later readings quarantined
    # as late) and overflow pandas' nanosecond timestamps in gold (a crash on every restart).
    event_time = F.when(event_time.between(F.timestamp_seconds(F.lit(0)),
                                           F.col("ingest_time") + F.expr("INTERVAL 1 DAY")), event_time)
    metrics = {c: F.expr(f"try_cast(_m['{c}'] as double)") for c in METRICS}
    reasons = [
        F.when(m.isNull(), F.lit("not_json")),
        F.when(m.isNotNull() & ~_nonempty(m["event_id"]), F.lit("missing_event_id")),
        F.when(m.isNotNull() & ~_nonempty(ts), F.lit("missing_ts")),
        F.when(_nonempty(ts) & event_time.isNull(), F.lit("bad_ts")),
        *[F.when(m[c].isNotNull() & metrics[c].isNull(), F.lit(f"wrong_type:{c}")) for c in METRICS],
        F.when(m["schema_version"].isNotNull()
               & F.expr("try_cast(_m['schema_version'] as int)").isNull(), F.lit("wrong_type:schema_version")),
    ]
    # Unknown fields are rare: filter the map only when it holds more than the known fields found.
    known = sum((m[k].isNotNull().cast("int") for k in KNOWN_FIELDS), F.lit(0))
    extra = F.when(F.size(m) > known, F.map_filter(m, lambda k, _: ~k.isin(*KNOWN_FIELDS)))
    return df.select(
        F.col("value"), F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"),
        F.col("ingest_time"),
        m["event_id"].alias("event_id"),
        m["device_id"].alias("device_id"),
        event_time.alias("event_time"),
        *[metrics[c].alias(c) for c in METRICS],
        m["status"].alias("status"),
        F.coalesce(F.expr("try_cast(_m['schema_version'] as int)"), F.lit(SCHEMA_VERSION)).alias("schema_version"),
        F.when(F.size(extra) > 0, F.to_json(extra)).alias("extra"),
        F.concat_ws(",", *reasons).alias("parse_reasons"),
    )
