"""The lakehouse's tables: logical names and Arrow schemas (the contract between layers).

Streams create their output tables with these schemas; the query CLI, the dashboard and the
maintenance jobs address tables by these names.
"""

from __future__ import annotations

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
_HEADERS = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))

#: Metrics a telemetry payload carries (numeric, per device).
METRICS = ("temperature", "humidity", "battery")

BRONZE = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp", TS),
    ("headers", _HEADERS), ("ingest_time", TS),
])

SILVER = pa.schema([
    ("event_id", pa.string()), ("device_id", pa.string()), ("event_time", TS),
    ("temperature", pa.float64()), ("humidity", pa.float64()), ("battery", pa.float64()),
    ("status", pa.string()), ("schema_version", pa.int32()),
    ("extra", pa.string()),  # unknown payload fields, as JSON (additive schema evolution)
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

DEVICE_CURRENT = pa.schema([
    ("device_id", pa.string()), ("status", pa.string()), ("status_since", TS),
    ("last_seen", TS), ("temperature", pa.float64()), ("humidity", pa.float64()),
    ("battery", pa.float64()), ("anomaly_score", pa.float64()), ("updated_at", TS),
])

DEVICE_STATUS_HISTORY = pa.schema([
    ("device_id", pa.string()), ("status", pa.string()), ("previous_status", pa.string()),
    ("changed_at", TS), ("reason", pa.string()),
])

READINGS_SCORED = pa.schema([
    ("event_id", pa.string()), ("device_id", pa.string()), ("event_time", TS),
    ("metric", pa.string()), ("value", pa.float64()), ("score", pa.float64()),
    ("baseline", pa.float64()), ("is_anomaly", pa.bool_()),
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

SCHEMAS: dict[str, pa.Schema] = {
    "bronze": BRONZE,
    "silver": SILVER,
    "quarantine": QUARANTINE,
    "gold_metrics_1m": METRIC_WINDOWS,
    "gold_metrics_5m": METRIC_WINDOWS,
    "gold_metrics_1m_final": METRIC_WINDOWS,  # append-only: closed windows, each once
    "gold_metrics_5m_final": METRIC_WINDOWS,
    "device_current": DEVICE_CURRENT,
    "device_status_history": DEVICE_STATUS_HISTORY,
    "readings_scored": READINGS_SCORED,
    "anomalies": ANOMALIES,
    "quality_log": QUALITY_LOG,
    "pipeline_metrics": PIPELINE_METRICS,
}
