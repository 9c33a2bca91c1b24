"""The lakehouse's tables: logical names and Arrow schemas (the contract between layers).

Streams create their output tables with these schemas; the query CLI, the dashboard and the
maintenance jobs address tables by these names.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa

from lakehouse.telemetry import TelemetryModel

TS = pa.timestamp("us", tz="UTC")
_HEADERS = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))

BRONZE = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp", TS),
    ("headers", _HEADERS), ("ingest_time", TS),
])

_METRIC_TYPES = {"double": pa.float64(), "long": pa.int64()}


def silver_schema(model: TelemetryModel) -> pa.Schema:
    """Silver's columns for a telemetry model: one typed column per declared metric and one
    string column per named topic part, between the identity and the bookkeeping columns.
    A model without metrics has no silver table (``TelemetryModel.require_metrics``)."""
    return pa.schema([
        ("event_id", pa.string()), ("device_id", pa.string()), ("event_time", TS),
        *[(m.name, _METRIC_TYPES[m.type]) for m in model.require_metrics().metrics],
        *[(c, pa.string()) for c in model.topic_columns],
        ("status", pa.string()), ("schema_version", pa.int32()),
        ("extra", pa.string()),  # top-level payload fields the model does not read, as JSON
        ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()), ("ingest_time", TS),
    ])


QUARANTINE = pa.schema([
    ("reason", pa.string()),  # comma-separated: parse reasons or failed expectation names
    ("value", pa.binary()),  # raw payload, byte for byte
    ("event_id", pa.string()), ("device_id", pa.string()), ("event_time", TS),
    ("kafka_topic", pa.string()), ("kafka_partition", pa.int32()), ("kafka_offset", pa.int64()),
    ("ingest_time", TS), ("quarantined_at", TS),
])

# Window aggregates, long format: one row per device, metric and window.
METRIC_WINDOWS = pa.schema([
    ("device_id", pa.string()), ("metric", pa.string()),
    ("window_start", TS), ("window_end", TS),
    ("count", pa.int64()), ("mean", pa.float64()), ("min", pa.float64()), ("max", pa.float64()),
    ("stddev", pa.float64()), ("last", pa.float64()),
])

def device_current_schema(model: TelemetryModel) -> pa.Schema:
    """``device_current``: each device's status, why (``status_reason``: the status rules that
    fired, ``error``, ``anomaly``, ``no_data``, ``death``, ``node_death``; ``data`` when online),
    when it was last heard (``last_seen``: its event time; ``last_received``: the pipeline's
    clock, silver's ``ingest_time``), its latest value of every gold metric, its topic parts
    and what the device registry says of it (``registry_columns``). The columns added since
    the first version come last, where ``ALTER TABLE ADD COLUMNS`` puts them in older tables."""
    own = pa.schema([
        ("device_id", pa.string()), ("status", pa.string()), ("status_since", TS),
        ("last_seen", TS), *[(m, pa.float64()) for m in model.gold_metrics],
        ("anomaly_score", pa.float64()), ("updated_at", TS),
        ("last_received", TS), ("status_reason", pa.string()),
        *[(c, pa.string()) for c in model.topic_columns],
    ])
    return pa.schema([*own, *registry_columns(model)])


#: device_current's site column: the topic's part of that name, else the registry's site
SITE = "site"


def registry_columns(model: TelemetryModel) -> pa.Schema:
    """device_current's columns from the device registry (``DEVICES``): ``labels`` (its JSON
    object, null when unregistered), ``registered`` (the registry has a row for it, revoked or
    not), ``revoked_at`` (when it was revoked) and, when the topic names no ``site``, the
    registry's ``site``."""
    site = [] if SITE in (*model.topic_columns, *model.gold_metrics) else [(SITE, pa.string())]
    return pa.schema([("labels", pa.string()), ("registered", pa.bool_()), ("revoked_at", TS), *site])


DEVICE_STATUS_HISTORY = pa.schema([
    ("device_id", pa.string()), ("status", pa.string()), ("previous_status", pa.string()),
    ("changed_at", TS), ("reason", pa.string()),
])

READINGS_SCORED = pa.schema([
    ("event_id", pa.string()), ("device_id", pa.string()), ("event_time", TS),
    ("metric", pa.string()), ("value", pa.float64()), ("score", pa.float64()),
    ("baseline", pa.float64()), ("is_anomaly", pa.bool_()),
    # why: the detector's view that explains the score (gold.anomaly.MODELS) and the range it
    # expected (null before the detector's second reading, and for a flat line)
    ("anomaly_model", pa.string()), ("expected_low", pa.float64()), ("expected_high", pa.float64()),
])

ANOMALIES = READINGS_SCORED

QUALITY_LOG = pa.schema([
    ("query_id", pa.string()), ("batch_id", pa.int64()), ("logged_at", TS),
    ("expectation", pa.string()),  # expectation name, or a counter: rows_in, duplicates, late
    ("column", pa.string()), ("kind", pa.string()),  # row | set | counter
    ("evaluated", pa.int64()), ("passed", pa.int64()), ("failed", pa.int64()),
    ("success", pa.bool_()), ("details", pa.string()),
])

PIPELINE_METRICS = pa.schema([
    ("query_name", pa.string()), ("query_id", pa.string()), ("run_id", pa.string()),
    ("batch_id", pa.int64()), ("timestamp", TS), ("num_input_rows", pa.int64()),
    ("input_rows_per_second", pa.float64()), ("processed_rows_per_second", pa.float64()),
    ("batch_duration_ms", pa.int64()), ("duration_ms", pa.string()),  # JSON of the parts
    ("state_rows", pa.int64()), ("state_memory_bytes", pa.int64()),
    ("rows_dropped_by_watermark", pa.int64()), ("duplicates_dropped", pa.int64()),
    ("watermark", pa.string()), ("lag", pa.int64()), ("progress_json", pa.string()),
])

# Alerts (gold/alerts): every transition of every alert, append-only, and the open ones.
# ``alert_id`` numbers an incident (one per rule and device, site or query while it lasts);
# ``fingerprint`` names the rule and subject, as Alertmanager's does its label set.
_ALERT_COLUMNS = [
    ("alert_id", pa.int64()), ("fingerprint", pa.string()), ("rule", pa.string()),
    ("kind", pa.string()), ("severity", pa.string()), ("subject", pa.string()),
    ("device_id", pa.string()), ("site", pa.string()), ("status", pa.string()),
    ("starts_at", TS), ("ends_at", TS), ("value", pa.float64()), ("summary", pa.string()),
    ("labels", pa.string()),  # JSON: every label the notifications carry
]
ALERTS = pa.schema([*_ALERT_COLUMNS[:9], ("transition", pa.string()), ("changed_at", TS),
                    *_ALERT_COLUMNS[9:]])
ALERTS_CURRENT = pa.schema([*_ALERT_COLUMNS, ("acknowledged", pa.bool_()),
                            ("silenced", pa.bool_()), ("updated_at", TS)])

# The device registry (`iotlake devices`, lakehouse.device_registry): a row per provisioned
# device, revoked ones kept (``revoked`` set), written by delta-rs.
DEVICES = pa.schema([
    ("device_id", pa.string()), ("site", pa.string()),
    ("labels", pa.string()),  # JSON object of the device's labels
    ("created", TS), ("revoked", TS),
])

#: Every table's schema but those that follow the telemetry model (``schemas``).
_FIXED: dict[str, pa.Schema] = {
    "bronze": BRONZE,
    "quarantine": QUARANTINE,
    "gold_metrics_1m": METRIC_WINDOWS,
    "gold_metrics_5m": METRIC_WINDOWS,
    "gold_metrics_1m_final": METRIC_WINDOWS,  # append-only: closed windows, each once
    "gold_metrics_5m_final": METRIC_WINDOWS,
    "device_status_history": DEVICE_STATUS_HISTORY,
    "readings_scored": READINGS_SCORED,
    "anomalies": ANOMALIES,
    "quality_log": QUALITY_LOG,
    "pipeline_metrics": PIPELINE_METRICS,
    "alerts": ALERTS,
    "alerts_current": ALERTS_CURRENT,
    "devices": DEVICES,
}

#: Every table's name, in the order a record passes them.
TABLES: tuple[str, ...] = (
    "bronze", "silver", "quarantine", "gold_metrics_1m", "gold_metrics_5m", "gold_metrics_1m_final",
    "gold_metrics_5m_final", "device_current", "device_status_history", "readings_scored",
    "anomalies", "quality_log", "pipeline_metrics", "alerts", "alerts_current", "devices")


def schemas(model: TelemetryModel) -> dict[str, pa.Schema]:
    """Every table's schema, silver's and device_current's for ``model``."""
    own = {"silver": silver_schema(model), "device_current": device_current_schema(model)}
    return {n: own[n] if n in own else _FIXED[n] for n in TABLES}


#: The time column retention expires each table's rows by (``maintenance.retention_days``):
#: arrival time for raw and quarantined rows (a device's clock can be wrong), event or window
#: time for derived ones. ``device_current`` (a row per device) never expires.
RETENTION_COLUMNS: dict[str, str] = {
    "bronze": "ingest_time", "silver": "ingest_time", "quarantine": "quarantined_at",
    "gold_metrics_1m": "window_end", "gold_metrics_5m": "window_end",
    "gold_metrics_1m_final": "window_end", "gold_metrics_5m_final": "window_end",
    "device_status_history": "changed_at", "readings_scored": "event_time",
    "anomalies": "event_time", "quality_log": "logged_at", "pipeline_metrics": "timestamp",
}


#: The window tables of ``gold.windows``, merged and final, tumbling and sliding
_WINDOW_TABLES = ("gold_metrics_1m", "gold_metrics_5m", "gold_metrics_1m_final", "gold_metrics_5m_final")

#: The columns Delta keeps file statistics on (min, max, null count), per table: the keys and
#: times that reads filter or join on, data skipping, Z-ordering (``orchestration.maintenance``)
#: and retention (``RETENTION_COLUMNS``) use. Delta computes statistics row by row at every
#: write; on its default (the first 32 columns) that was a quarter of gold health's JVM CPU
#: (docs/history/benchmarks.md). Silver adds the telemetry model's topic parts (``stats_columns``).
STATS_COLUMNS: dict[str, tuple[str, ...]] = {
    "bronze": ("topic", "partition", "offset", "timestamp", "ingest_time"),
    "silver": ("device_id", "event_time", "ingest_time"),
    "quarantine": ("device_id", "event_time", "ingest_time", "quarantined_at"),
    **{t: ("device_id", "metric", "window_start", "window_end") for t in _WINDOW_TABLES},
    "device_current": ("device_id", "last_seen", "updated_at"),
    "device_status_history": ("device_id", "changed_at"),
    "readings_scored": ("device_id", "event_time", "metric"),
    "anomalies": ("device_id", "event_time", "metric"),
    "quality_log": ("query_id", "batch_id", "logged_at"),
    "pipeline_metrics": ("query_name", "batch_id", "timestamp"),
    "alerts": ("alert_id", "device_id", "changed_at"),
    "alerts_current": ("alert_id", "device_id"),
}

#: The table property naming them.
STATS_COLUMNS_PROPERTY = "delta.dataSkippingStatsColumns"


def stats_columns(table: str, model: TelemetryModel) -> tuple[str, ...]:
    """``STATS_COLUMNS`` of ``table`` (none: Delta's default), silver's with its topic parts."""
    cols = STATS_COLUMNS.get(table, ())
    return (*cols, *model.topic_columns) if table == "silver" else cols


_SCORES = ("event_id", "score", "baseline", "expected_low", "expected_high")

#: Columns written without Parquet's dictionary encoding, per table: values unique per row (ids,
#: offsets, raw payloads) or computed to full precision (scores, means), for which the writer
#: would hash every value into a dictionary only to drop it as no smaller. Readings themselves keep it: sensors report with few digits, and a dictionary
#: then pays.
PLAIN_COLUMNS: dict[str, tuple[str, ...]] = {
    "bronze": ("value", "offset"),
    "silver": ("event_id", "kafka_offset"),
    "quarantine": ("value", "event_id", "kafka_offset"),
    **{t: ("mean", "stddev") for t in _WINDOW_TABLES},
    "readings_scored": _SCORES,
    "anomalies": _SCORES,
}


def column_properties(table: str, model: TelemetryModel) -> dict[str, str]:
    """The table properties iotlake gives ``table``'s columns: statistics (``STATS_COLUMNS``)
    and encodings (``PLAIN_COLUMNS``; Delta hands table properties to the Parquet writer)."""
    stats = stats_columns(table, model)
    return {**({STATS_COLUMNS_PROPERTY: ",".join(stats)} if stats else {}),
            **{f"parquet.enable.dictionary#{c}": "false" for c in PLAIN_COLUMNS.get(table, ())}}


#: Every table retention can expire is partitioned by this column: the UTC start of the
#: ``maintenance.partition_minutes`` bucket its retention column falls in, as text
#: (``2026-11-25``, or ``2026-11-25-1305`` for buckets under a day), generated by Delta from
#: that column (bronze's stream computes it: ``time_partitioning``). Retention then drops whole
#: partitions: a DELETE whose predicate names only partitions does not conflict with the
#: streams appending to newer ones (Delta's conflict check looks at partition values only, and
#: OSS Delta has no WriteSerializable isolation to ignore blind appends).
PARTITION_COLUMN = "time_bucket"

#: Table property recording the bucket width a table was created with (a later settings change
#: does not re-partition it).
PARTITION_MINUTES_PROPERTY = "iotlake.partitionMinutes"

_DAY_MINUTES = 1440


def _bucket_format(minutes: int) -> tuple[str, str]:
    """(Spark pattern, strftime pattern) of a bucket's text: the day alone for whole days."""
    # no characters a partition directory name would escape (``:``, space)
    return ("yyyy-MM-dd", "%Y-%m-%d") if minutes % _DAY_MINUTES == 0 else ("yyyy-MM-dd-HHmm", "%Y-%m-%d-%H%M")


def bucket_sql(table: str, minutes: int) -> str:
    """The Spark SQL expression of ``table``'s ``PARTITION_COLUMN``."""
    seconds = minutes * 60
    return (f"from_unixtime(unix_timestamp(`{RETENTION_COLUMNS[table]}`) DIV {seconds} * {seconds}, "
            f"'{_bucket_format(minutes)[0]}')")


def time_partitioning(table: str, minutes: int, generated: bool = True) -> dict:
    """``ensure_table`` keywords partitioning ``table`` by the bucket of its retention column
    (none for a table that never expires). ``generated=False``: a plain column its writer
    fills with ``bucket_sql`` (Delta's streaming sink reports 0 input rows in the query's
    progress when it computes or checks a generated column)."""
    if table not in RETENTION_COLUMNS:
        return {}
    out = {"partition_by": (PARTITION_COLUMN,), "properties": {PARTITION_MINUTES_PROPERTY: str(minutes)}}
    if generated:
        out["generated"] = {PARTITION_COLUMN: bucket_sql(table, minutes)}
    else:
        out["extra_columns"] = {PARTITION_COLUMN: "STRING"}
    return out


def bucket_start(ts: datetime, minutes: int) -> datetime:
    """The start of the bucket ``ts`` falls in (UTC)."""
    seconds = minutes * 60
    epoch = int(ts.timestamp()) // seconds * seconds
    return datetime.fromtimestamp(epoch, UTC)


def bucket_text(ts: datetime, minutes: int) -> str:
    """The partition value of ``ts``'s bucket, as the generated column writes it."""
    return bucket_start(ts, minutes).strftime(_bucket_format(minutes)[1])
