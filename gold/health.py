"""Gold device health: per-device anomaly scores and online / degraded / offline status.

One arbitrary-state stream keyed by ``device_id`` (``applyInPandasWithState``, RocksDB state in
the checkpoint, so it survives restarts and scales by key):

- each reading of each metric is scored by the streaming detector in ``gold/anomaly.py``,
  whose state (one per metric) lives in the device's state;
- status per reading: ``degraded`` when battery is low, the device reports an error, or a
  metric's anomaly score is high (thresholds in settings); else ``online``;
- an event-time timeout fires ``offline_after_seconds`` after the device's last reading once
  the watermark (driven by *other* devices' data) passes it: the device goes ``offline``.

Outputs, written exactly once per micro-batch: ``readings_scored`` (every scored reading),
``anomalies`` (flagged ones), ``device_status_history`` (every change) and ``device_current``
(MERGE by device).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from gold.anomaly import DetectorConfig, DetectorState, score_batch
from lakehouse.delta_io import MergeSpec, append_arrow, ensure_table, merge_arrow
from lakehouse.settings import GoldSettings, Settings
from lakehouse.streams import query_id, trigger_kwargs
from lakehouse.tables import (
    ANOMALIES,
    DEVICE_CURRENT,
    DEVICE_STATUS_HISTORY,
    METRICS,
    READINGS_SCORED,
)

QUERY = "gold_health"

OUT_SCHEMA = (
    "kind string, device_id string, event_id string, event_time timestamp, metric string, "
    "value double, score double, baseline double, is_anomaly boolean, status string, "
    "previous_status string, reason string, status_since timestamp, last_seen timestamp, "
    "temperature double, humidity double, battery double, anomaly_score double"
)
STATE_SCHEMA = (
    "status string, status_since long, last_seen long, temperature double, humidity double, "
    "battery double, anomaly_score double, "
    # detector states as packed float64 bytes: pyspark 4.3 workers cannot parse array<double>
    # inside an applyInPandasWithState state schema
    + ", ".join(f"det_{m} binary" for m in METRICS)
)
_OUT_COLS = [c.split()[0] for c in OUT_SCHEMA.split(", ")]


def _ms(ts: pd.Series) -> np.ndarray:
    return ts.astype("datetime64[ns]").astype("int64").to_numpy() // 1_000_000


def _ts(ms: float | int | None) -> pd.Timestamp | None:
    return None if ms is None or pd.isna(ms) else pd.Timestamp(int(ms), unit="ms")


def _row(**kw) -> dict:
    return {c: kw.get(c) for c in _OUT_COLS}


def health_fn(gold: GoldSettings):
    """The per-device state function (a closure over the rules, shipped to executors)."""
    cfg = DetectorConfig(threshold=gold.anomaly_threshold)
    timeout_ms = gold.offline_after_seconds * 1000

    def fn(key: tuple, pdfs: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        device = key[0]
        if state.exists:
            (status, since, last_seen, temp, hum, batt, score, *dets) = state.get
        else:
            status = since = last_seen = temp = hum = batt = score = None
            dets = [None] * len(METRICS)
        out: list[dict] = []

        if state.hasTimedOut:  # no reading for offline_after: offline as of last_seen + timeout
            if status != "offline":
                when = last_seen + timeout_ms
                out.append(_row(kind="status", device_id=device, status="offline",
                                previous_status=status, reason="no_data", event_time=_ts(when)))
                status, since = "offline", when
        else:
            pdf = pd.concat(list(pdfs), ignore_index=True).sort_values("event_time", kind="stable")
            if pdf.empty:
                return
            times_ms = _ms(pdf["event_time"])
            t_sec = times_ms / 1000.0
            max_score = np.zeros(len(pdf))
            for i, m in enumerate(METRICS):
                prev = DetectorState.from_row(np.frombuffer(dets[i])) if dets[i] is not None else None
                scores, base, flags, st = score_batch(pdf[m].to_numpy(dtype=float), t_sec, prev, cfg)
                present = pdf[m].notna().to_numpy()
                seen_before = prev.n if prev is not None else 0
                warm = seen_before + np.cumsum(present) > cfg.warmup  # no status from warm-up scores
                dets[i] = np.asarray(st.to_row(), dtype=np.float64).tobytes()
                max_score = np.maximum(max_score, np.where(warm, scores, 0.0))
                out.extend(
                    _row(kind="reading", device_id=device, event_id=e, event_time=t, metric=m,
                         value=v, score=s, baseline=None if np.isnan(b) else b, is_anomaly=bool(f))
                    for e, t, v, s, b, f, ok in zip(pdf["event_id"], pdf["event_time"], pdf[m],
                                                    scores, base, flags, present, strict=True)
                    if ok)
            reasons = _degraded_reasons(pdf, max_score, gold)
            for j, r in enumerate(reasons):
                new = "degraded" if r else "online"
                if new != status:
                    out.append(_row(kind="status", device_id=device, status=new,
                                    previous_status=status, reason=r or "data",
                                    event_time=pdf["event_time"].iloc[j]))
                    status, since = new, int(times_ms[j])
            last = pdf.iloc[-1]
            last_seen = max(int(times_ms[-1]), last_seen or 0)
            temp, hum, batt = (None if pd.isna(last[m]) else float(last[m]) for m in METRICS)
            score = float(max_score[-1])
            state.setTimeoutTimestamp(last_seen + timeout_ms)

        state.update((status, since, last_seen, temp, hum, batt, score, *dets))
        out.append(_row(kind="current", device_id=device, status=status, status_since=_ts(since),
                        last_seen=_ts(last_seen), temperature=temp, humidity=hum, battery=batt,
                        anomaly_score=score))
        yield pd.DataFrame(out, columns=_OUT_COLS)

    return fn


def _degraded_reasons(pdf: pd.DataFrame, max_score: np.ndarray, gold: GoldSettings) -> list[str]:
    batt_low = (pdf["battery"] < gold.battery_low).fillna(False).to_numpy()
    err = (pdf["status"] == "error").fillna(False).to_numpy()
    anom = max_score >= gold.anomaly_score_high
    return [",".join(n for n, flag in (("battery_low", b), ("error", e), ("anomaly", a)) if flag)
            for b, e, a in zip(batt_low, err, anom, strict=True)]


def health_frame(silver: DataFrame, settings: Settings) -> DataFrame:
    return (
        silver.select("device_id", "event_id", "event_time", *METRICS, "status")
        .withWatermark("event_time", f"{settings.stream.watermark_seconds} seconds")
        .groupBy("device_id")
        .applyInPandasWithState(health_fn(settings.gold), OUT_SCHEMA, STATE_SCHEMA, "append",
                                GroupStateTimeout.EventTimeTimeout)
    )


class HealthBatch:
    """foreachBatch: split the state function's output into the four gold tables."""

    def __init__(self, settings: Settings, app_id: str) -> None:
        self.paths = {t: settings.table_path(t) for t in
                      ("readings_scored", "anomalies", "device_status_history", "device_current")}
        self.app_id = app_id

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        out = df.toArrow()
        if out.num_rows == 0:
            return
        kind = out.column("kind")
        readings = out.filter(pc.equal(kind, "reading"))
        rs = readings.select(READINGS_SCORED.names).cast(READINGS_SCORED)
        an = rs.filter(rs.column("is_anomaly"))
        hist = out.filter(pc.equal(kind, "status")).rename_columns(
            ["changed_at" if c == "event_time" else c for c in out.column_names])
        hist = hist.select(DEVICE_STATUS_HISTORY.names).cast(DEVICE_STATUS_HISTORY)
        cur = out.filter(pc.equal(kind, "current"))
        cur = cur.append_column("updated_at", pa.array([pd.Timestamp.now(tz="UTC")] * cur.num_rows,
                                                       pa.timestamp("us", tz="UTC")))
        cur = cur.select(DEVICE_CURRENT.names).cast(DEVICE_CURRENT)
        for name, data in (("readings_scored", rs), ("anomalies", an), ("device_status_history", hist)):
            if data.num_rows:
                append_arrow(self.paths[name], data, self.app_id, batch_id)
        if cur.num_rows:
            merge_arrow(self.paths["device_current"], cur, MergeSpec(["device_id"]), self.app_id, batch_id)


def start(spark: SparkSession, settings: Settings, trigger: str = "live",
          max_rows: int | None = None) -> StreamingQuery:
    from gold.windows import silver_stream

    ckpt = settings.checkpoint_path(QUERY)
    for name, schema in (("readings_scored", READINGS_SCORED), ("anomalies", ANOMALIES),
                         ("device_status_history", DEVICE_STATUS_HISTORY),
                         ("device_current", DEVICE_CURRENT)):
        ensure_table(settings.table_path(name), schema)
    return (
        health_frame(silver_stream(spark, settings, max_rows), settings).writeStream
        .queryName(QUERY).outputMode("append")
        .foreachBatch(HealthBatch(settings, query_id(ckpt)))
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger))
        .start()
    )
