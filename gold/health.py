"""Gold device health: per-device anomaly scores and online / degraded / offline status.

One arbitrary-state stream (``applyInPandasWithState``, RocksDB state in the checkpoint, so it
survives restarts):

- each reading of each metric is scored by the streaming detector in ``gold/anomaly.py``,
  whose state (one per device and metric) lives in the device's state;
- status per reading: ``degraded`` when battery is low, the device reports an error, or a
  metric's anomaly score is high (thresholds in settings); else ``online``;
- an event-time timeout fires ``offline_after_seconds`` after the device's last reading once
  the watermark (driven by *other* devices' data) passes it: the device goes ``offline``.

State is keyed by a hash bucket of ``device_id`` (``STATE_BUCKETS``), each holding the states of
its devices: Spark's fixed cost per group in the Python worker (Arrow to pandas per group, state
(de)serialisation, one output frame per group) is ~1 ms, which with a key per device capped the
stream at ~1k readings/s for 10k devices. A bucket is processed column-wise (one sort,
vectorised rules and output columns); only the detector runs per device. Timeouts stay per
device and exact: a bucket's timeout is its devices' earliest deadline, and every call also
times out its devices without data whose deadline is below the watermark (Spark's rule).
Changing ``STATE_BUCKETS`` or ``DEVICE_STATE`` needs a new checkpoint.

Outputs, written exactly once per micro-batch: ``readings_scored`` (every scored reading),
``anomalies`` (flagged ones), ``device_status_history`` (every change) and ``device_current``
(MERGE by device).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
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
#: Fixed per checkpoint. More buckets: less state rewritten when few of a bucket's devices
#: report in a micro-batch; fewer: less per-group overhead.
STATE_BUCKETS = 256

# One row per reading (kind "reading", its metrics side by side: a third of the rows of one row
# per metric, which the JVM and both Arrow conversions pay per row), per status change
# ("status") and per device seen ("current"); HealthBatch unpivots readings per metric.
OUT_SCHEMA = ", ".join([
    "kind string, device_id string, event_id string, event_time timestamp",
    *(f"{m} double, {m}_score double, {m}_baseline double, {m}_anomaly boolean" for m in METRICS),
    "status string, previous_status string, reason string, status_since timestamp, "
    "last_seen timestamp, anomaly_score double",
])
_OUT_TYPES = dict(c.split() for c in OUT_SCHEMA.split(", "))
_NAT = np.iinfo(np.int64).min  # timestamps are carried as int64 ns, NaT = null

STATE_SCHEMA = "devices binary"  # an Arrow IPC stream of DEVICE_STATE, one row per device
DEVICE_STATE = pa.schema([
    ("device_id", pa.string()), ("status", pa.string()),
    ("status_since", pa.int64()), ("last_seen", pa.int64()), ("timeout_at", pa.int64()),  # ms
    *[(m, pa.float64()) for m in METRICS], ("anomaly_score", pa.float64()),
    # detector states as packed float64 bytes: pyspark 4.3 workers cannot parse array<double>
    # inside an applyInPandasWithState state schema
    *[(f"det_{m}", pa.binary()) for m in METRICS],
])


@dataclass(slots=True)
class Device:
    """One device's state inside its bucket (times in epoch ms)."""

    status: str | None = None
    status_since: int | None = None
    last_seen: int | None = None
    timeout_at: int | None = None  # offline when the watermark passes it; None once offline
    values: list[float | None] = field(default_factory=lambda: [None] * len(METRICS))
    anomaly_score: float | None = None
    dets: list[bytes | None] = field(default_factory=lambda: [None] * len(METRICS))


def load_devices(blob: bytes) -> dict[str, Device]:
    """A bucket's state (Arrow IPC: typed and compact, unlike a pickle of Python objects)."""
    c = pa.ipc.open_stream(blob).read_all().to_pydict()
    return {d: Device(c["status"][i], c["status_since"][i], c["last_seen"][i], c["timeout_at"][i],
                      [c[m][i] for m in METRICS], c["anomaly_score"][i],
                      [c[f"det_{m}"][i] for m in METRICS])
            for i, d in enumerate(c["device_id"])}


def dump_devices(devs: dict[str, Device]) -> bytes:
    ds = list(devs.values())
    cols = {"device_id": list(devs), "status": [d.status for d in ds],
            "status_since": [d.status_since for d in ds], "last_seen": [d.last_seen for d in ds],
            "timeout_at": [d.timeout_at for d in ds],
            **{m: [d.values[i] for d in ds] for i, m in enumerate(METRICS)},
            "anomaly_score": [d.anomaly_score for d in ds],
            **{f"det_{m}": [d.dets[i] for d in ds] for i, m in enumerate(METRICS)}}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, DEVICE_STATE) as w:
        w.write_table(pa.table(cols, schema=DEVICE_STATE))
    return sink.getvalue().to_pybytes()


class Rows:
    """Output rows collected as column parts; one pandas frame per call (no per-row dicts)."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, dict]] = []

    def add(self, n: int, **cols: object) -> None:
        if n:
            self.parts.append((n, cols))

    def frame(self) -> pd.DataFrame:
        total = sum(n for n, _ in self.parts)
        data = {}
        for c, typ in _OUT_TYPES.items():
            if typ == "double":
                col = np.full(total, np.nan)
            elif typ == "timestamp":
                col = np.full(total, _NAT, dtype=np.int64)
            else:
                col = np.full(total, None, dtype=object)
            pos = 0
            for n, cols in self.parts:
                if c in cols:
                    col[pos:pos + n] = cols[c]
                pos += n
            data[c] = col.view("datetime64[ns]") if typ == "timestamp" else col
        return pd.DataFrame(data)


def _ns(ms: int | None) -> int:
    return _NAT if ms is None else ms * 1_000_000


def health_fn(gold: GoldSettings):
    """The per-bucket state function (a closure over the rules, shipped to executors)."""
    cfg = DetectorConfig(threshold=gold.anomaly_threshold)
    timeout_ms = gold.offline_after_seconds * 1000

    def fn(key: tuple, pdfs: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        devs = load_devices(state.get[0]) if state.exists else {}
        out = Rows()
        touched: list[str] = []
        if not state.hasTimedOut:
            frames = [p for p in pdfs if len(p)]
            if frames:
                pdf = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
                touched = score_readings(pdf, devs, out, cfg, gold, timeout_ms)
        wm = state.getCurrentWatermarkMs()
        with_data = set(touched)
        timed_out = [d for d, dv in devs.items() if d not in with_data
                     and dv.timeout_at is not None and dv.timeout_at < wm]
        for d in timed_out:  # no reading for offline_after: offline as of last_seen + timeout
            dv = devs[d]
            dv.timeout_at = None
            if dv.status != "offline":
                when = dv.last_seen + timeout_ms
                out.add(1, kind="status", device_id=d, status="offline",
                        previous_status=dv.status, reason="no_data", event_time=_ns(when))
                dv.status, dv.status_since = "offline", when
        current = [devs[d] for d in touched + timed_out]
        out.add(len(current), kind="current", device_id=touched + timed_out,
                status=[d.status for d in current],
                status_since=[_ns(d.status_since) for d in current],
                last_seen=[_ns(d.last_seen) for d in current],
                **{m: [np.nan if d.values[i] is None else d.values[i] for d in current]
                   for i, m in enumerate(METRICS)},
                anomaly_score=[np.nan if d.anomaly_score is None else d.anomaly_score
                               for d in current])
        state.update((dump_devices(devs),))
        pending = [dv.timeout_at for dv in devs.values() if dv.timeout_at is not None]
        if pending:
            state.setTimeoutTimestamp(min(pending))
        if out.parts:
            yield out.frame()

    return fn


def score_readings(pdf: pd.DataFrame, devs: dict[str, Device], out: Rows, cfg: DetectorConfig,
                   gold: GoldSettings, timeout_ms: int) -> list[str]:
    """Score one bucket's readings device by device in event-time order; returns the devices."""
    codes, names = pd.factorize(pdf["device_id"].to_numpy(dtype=object))
    t_raw = pdf["event_time"].to_numpy(dtype="datetime64[ns]").view(np.int64)
    order = np.lexsort((t_raw, codes))  # stable: ties keep their arrival order
    codes, t_ns = codes[order], t_raw[order]
    n = len(order)
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    ends = np.r_[starts[1:], n]
    seg = np.repeat(np.arange(len(starts)), ends - starts)
    ms = t_ns // 1_000_000
    t_sec = ms / 1000.0
    vals = np.stack([pdf[m].to_numpy(dtype=float)[order] for m in METRICS])
    devices = [names[c] for c in codes[starts]]
    dstate = [devs.setdefault(d, Device()) for d in devices]

    k_m = len(METRICS)
    present = ~np.isnan(vals)
    scores, base = np.zeros((k_m, n)), np.full((k_m, n), np.nan)
    flags = np.zeros((k_m, n), dtype=bool)
    n_before = np.zeros((k_m, len(starts)))
    for k, (a, b, dv) in enumerate(zip(starts.tolist(), ends.tolist(), dstate, strict=True)):
        ts = t_sec[a:b]
        for i in range(k_m):
            if not present[i, a:b].any():  # the detector would score 0 and keep its state
                continue
            prev = None if dv.dets[i] is None else DetectorState.from_row(
                np.frombuffer(dv.dets[i]).tolist())
            s, bl, f, st = score_batch(vals[i, a:b], ts, prev, cfg)
            scores[i, a:b], base[i, a:b], flags[i, a:b] = s, bl, f
            n_before[i, k] = prev.n if prev is not None else 0
            dv.dets[i] = np.asarray(st.to_row(), dtype=np.float64).tobytes()

    cum = np.cumsum(present, axis=1)
    within = cum - (cum - present)[:, starts][:, seg]  # readings so far in the device's batch
    warm = n_before[:, seg] + within > cfg.warmup  # no status from warm-up scores
    max_score = np.where(warm, scores, 0.0).max(axis=0)

    dev_col = names[codes]
    idx = np.flatnonzero(present.any(axis=0))
    out.add(len(idx), kind="reading", device_id=dev_col[idx],
            event_id=pdf["event_id"].to_numpy(dtype=object)[order][idx], event_time=t_ns[idx],
            **{k: v for i, m in enumerate(METRICS) for k, v in (
                (m, vals[i, idx]), (f"{m}_score", scores[i, idx]), (f"{m}_baseline", base[i, idx]),
                (f"{m}_anomaly", flags[i, idx]))})

    batt_low = vals[METRICS.index("battery")] < gold.battery_low
    err = pdf["status"].to_numpy(dtype=object)[order] == "error"
    anom = max_score >= gold.anomaly_score_high
    new = np.where(batt_low | err | anom, "degraded", "online").astype(object)
    prev_status = np.empty(n, dtype=object)
    prev_status[1:] = new[:-1]
    prev_status[starts] = [dv.status for dv in dstate]
    changed = np.flatnonzero(new != prev_status)
    reasons = [",".join(r for r, flag in (("battery_low", b), ("error", e), ("anomaly", a)) if flag)
               or "data" for b, e, a in zip(batt_low[changed], err[changed], anom[changed], strict=True)]
    out.add(len(changed), kind="status", device_id=dev_col[changed], status=new[changed],
            previous_status=prev_status[changed], reason=reasons, event_time=t_ns[changed])

    last_change = np.maximum.reduceat(np.where(new != prev_status, np.arange(n), -1), starts)
    for dv, j, c in zip(dstate, (ends - 1).tolist(), last_change.tolist(), strict=True):
        dv.status = new[j]
        if c >= 0:
            dv.status_since = int(ms[c])
        dv.last_seen = max(int(ms[j]), dv.last_seen or 0)
        dv.values = [None if np.isnan(v) else float(v) for v in vals[:, j]]
        dv.anomaly_score = float(max_score[j])
        dv.timeout_at = dv.last_seen + timeout_ms
    return devices


def health_frame(silver: DataFrame, settings: Settings) -> DataFrame:
    return (
        silver.select("device_id", "event_id", "event_time", *METRICS, "status")
        .withWatermark("event_time", f"{settings.stream.watermark_seconds} seconds")
        .withColumn("bucket", F.pmod(F.xxhash64("device_id"), F.lit(STATE_BUCKETS)))
        .groupBy("bucket")
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
        rs = readings_scored(out.filter(pc.equal(kind, "reading")))
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


def readings_scored(readings: pa.Table) -> pa.Table:
    """Unpivot the state function's reading rows: one row per present metric."""
    parts = []
    for m in METRICS:
        r = readings.filter(pc.is_valid(readings.column(m)))
        parts.append(pa.table({
            "event_id": r["event_id"], "device_id": r["device_id"], "event_time": r["event_time"],
            "metric": pa.repeat(m, r.num_rows), "value": r[m], "score": r[f"{m}_score"],
            "baseline": r[f"{m}_baseline"], "is_anomaly": r[f"{m}_anomaly"]}))
    return pa.concat_tables(parts).cast(READINGS_SCORED)


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
