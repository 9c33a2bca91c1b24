"""Gold health's scoring core: the rules both places a device's state can live in share.

A ``Bucket`` holds devices column-wise (times in epoch ms, no per-device Python objects).
``score_readings`` scores a batch of readings against it, per device in event-time order: each
reading of each metric by the streaming detector of ``gold/anomaly.py`` (every (device, metric)
lane in one compiled call, on the states where the bucket holds them), each reading's status by
the telemetry model's ``Rules``, the device's status once held (``_hold``). ``time_out`` (event
time) and ``time_out_received`` (the wall clock) take silent devices offline. What comes out is
``Rows`` of ``out_schema``, whichever mode writes them: Spark's state store
(``gold/state_store.py``) or the driver (``gold/device_state.py``); the rules in words are in
``gold/health.py``, the stream that picks the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F

from gold.anomaly import DetectorConfig, _njit_cached, initial_rows, score_lanes_at, upgrade_rows
from lakehouse.settings import GoldSettings
from lakehouse.telemetry import TelemetryModel

#: What the health stream writes, in either mode.
TABLES = ("readings_scored", "anomalies", "device_status_history", "device_current")

# One row per reading (kind "reading", its metrics side by side: a third of the rows of one row
# per metric, which the JVM and both Arrow conversions pay per row), per status change
# ("status") and per device seen ("current"); HealthBatch unpivots readings per metric.
def out_schema(metrics: tuple[str, ...], topics: tuple[str, ...] = ()) -> str:
    return ", ".join([
        "kind string, device_id string, event_id string, event_time timestamp",
        *(f"{m} double, {m}_score double, {m}_baseline double, {m}_anomaly boolean, "
          f"{m}_model double, {m}_low double, {m}_high double" for m in metrics),
        "status string, previous_status string, reason string, status_since timestamp, "
        "last_seen timestamp, anomaly_score double, last_received timestamp, status_reason string",
        *(f"{c} string" for c in topics),
    ])


_NAT = np.iinfo(np.int64).min  # timestamps are carried as int64 ns, NaT = null
#: The status a reading reports when its device is gone (silver's rows for Sparkplug deaths)
REPORTED_OFFLINE = "offline"
#: Statuses by code, as the hold kernel takes them; code -1 (none yet) indexes the last: None
STATUSES = np.array(["online", "degraded", "offline", None], dtype=object)
_OFFLINE = 2


def device_state_schema(metrics: tuple[str, ...], topics: tuple[str, ...] = ()) -> pa.Schema:
    """A device's state as a row. From a state written before the columns from ``last_received``
    on, a device loads with them unknown (no hold pending), set by its next reading."""
    return pa.schema([
        ("device_id", pa.string()), ("status", pa.string()),
        ("status_since", pa.int64()), ("last_seen", pa.int64()), ("timeout_at", pa.int64()),  # ms
        *[(m, pa.float64()) for m in metrics], ("anomaly_score", pa.float64()),
        # detector states as packed float64 bytes: pyspark 4.3 workers cannot parse array<double>
        # inside an applyInPandasWithState state schema
        *[(f"det_{m}", pa.binary()) for m in metrics],
        ("last_received", pa.int64()), ("status_reason", pa.string()),
        # the hold: the status the readings show if not the device's, for how many readings, since
        ("pending_status", pa.string()), ("pending_count", pa.int64()), ("pending_since", pa.int64()),
        *[(f"topic.{c}", pa.string()) for c in topics],  # a dot: no metric's or column's name
    ])



_NONE = np.iinfo(np.int64).min  # a missing epoch-ms time in a Bucket's int64 columns


@dataclass(slots=True)
class Bucket:
    """A bucket's devices column-wise (times in epoch ms): no per-device Python objects."""

    ids: np.ndarray  # device_id (object)
    status: np.ndarray  # object: str or None
    status_since: np.ndarray  # int64, _NONE = never
    last_seen: np.ndarray
    timeout_at: np.ndarray  # offline when the watermark passes it; _NONE once offline
    values: np.ndarray  # [devices, metrics] float64, NaN = none yet
    anomaly_score: np.ndarray  # float64, NaN = none yet
    dets: np.ndarray  # [metrics, devices, state_len] detector states (DetectorState.to_row())
    det_set: np.ndarray  # [metrics, devices] bool: a detector state exists
    last_received: np.ndarray  # int64: silver's ingest_time of its latest reading, _NONE = unknown
    reason: np.ndarray  # object: the current status's reason
    pending: np.ndarray  # int64 status code the readings hold to (-1: none)
    pending_n: np.ndarray  # int64: consecutive readings of it
    pending_since: np.ndarray  # int64: event time of the first of them
    topics: np.ndarray  # [devices, topic columns] object: latest value

    @classmethod
    def empty(cls, state_len: int, k: int, n_topics: int = 0) -> Bucket:
        def z() -> np.ndarray:
            return np.zeros(0, dtype=np.int64)

        return cls(np.zeros(0, dtype=object), np.zeros(0, dtype=object), z(), z(), z(),
                   np.zeros((0, k)), np.zeros(0), np.zeros((k, 0, state_len)),
                   np.zeros((k, 0), dtype=bool), z(), np.zeros(0, dtype=object), z(), z(), z(),
                   np.zeros((0, n_topics), dtype=object))

    def states(self) -> np.ndarray:
        """``dets`` as one [metrics * devices, state_len] matrix sharing its memory (made
        C-contiguous first if it is not), for ``score_lanes_at`` to update in place."""
        if not self.dets.flags.c_contiguous:
            self.dets = np.ascontiguousarray(self.dets)
        return self.dets.reshape(-1, self.dets.shape[2])  # a view: C-contiguous

    def index(self, names: np.ndarray) -> np.ndarray:
        """Positions of ``names``, appending the devices not seen before (in that order)."""
        pos = pd.Index(self.ids).get_indexer(names) if len(self.ids) else np.full(len(names), -1)
        new = pos < 0
        if new.any():
            k, n0, n_metrics = int(new.sum()), len(self.ids), self.values.shape[1]
            pos[new] = np.arange(n0, n0 + k)
            none = np.full(k, _NONE, dtype=np.int64)
            self.ids = np.concatenate([self.ids, names[new]])
            self.status = np.concatenate([self.status, np.full(k, None, dtype=object)])
            self.status_since = np.concatenate([self.status_since, none])
            self.last_seen = np.concatenate([self.last_seen, none])
            self.timeout_at = np.concatenate([self.timeout_at, none])
            self.values = np.concatenate([self.values, np.full((k, n_metrics), np.nan)])
            self.anomaly_score = np.concatenate([self.anomaly_score, np.full(k, np.nan)])
            self.dets = np.concatenate([self.dets, np.zeros((n_metrics, k, self.dets.shape[2]))], axis=1)
            self.det_set = np.concatenate([self.det_set, np.zeros((n_metrics, k), dtype=bool)], axis=1)
            self.last_received = np.concatenate([self.last_received, none])
            self.reason = np.concatenate([self.reason, np.full(k, None, dtype=object)])
            self.pending = np.concatenate([self.pending, np.full(k, -1, dtype=np.int64)])
            self.pending_n = np.concatenate([self.pending_n, np.zeros(k, dtype=np.int64)])
            self.pending_since = np.concatenate([self.pending_since, none])
            self.topics = np.concatenate([self.topics, np.full((k, self.topics.shape[1]), None, dtype=object)])
        return pos


def _ints(a: np.ndarray) -> pa.Array:
    return pa.array(a, pa.int64(), mask=a == _NONE)


def _floats(a: np.ndarray) -> pa.Array:
    return pa.array(a, pa.float64(), mask=np.isnan(a))


def _packed(rows: np.ndarray, present: np.ndarray) -> pa.Array:
    """Binary column of packed float64 rows (null where not ``present``), without a Python loop.
    Shares memory with ``rows`` where every row is present: write it out before they change."""
    size = rows.shape[1] * 8
    offsets = np.r_[0, np.cumsum(np.where(present, size, 0))].astype(np.int32)
    data = np.ascontiguousarray(rows if present.all() else rows[present])
    validity = pa.array(present).buffers()[1]
    return pa.Array.from_buffers(pa.binary(), len(present),
                                 [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
                                 null_count=int((~present).sum()))



def bucket_of(t: pa.Table, state_len: int, metrics: tuple[str, ...],
              cfg: DetectorConfig | None = None, topics: tuple[str, ...] = ()) -> Bucket:
    """Devices from their rows (``device_state_schema``, perhaps of other metrics or topic
    columns, or of a version without the later columns)."""
    n, k = t.num_rows, len(metrics)
    dets, det_set = np.zeros((k, n, state_len)), np.zeros((k, n), dtype=bool)
    values = np.full((n, k), np.nan)
    for i, m in enumerate(metrics):
        if m not in t.column_names:  # added to the model since this state was written
            continue
        values[:, i] = t.column(m).to_numpy(zero_copy_only=False)
        col = t.column(f"det_{m}")
        det_set[i] = pc.is_valid(col).to_numpy(zero_copy_only=False)
        packed = np.frombuffer(b"".join(col.drop_null().to_pylist()), dtype=np.float64)
        if packed.size:
            rows = packed.reshape(int(det_set[i].sum()), -1)
            # a state written by an older detector version continues (no re-warm-up)
            dets[i, det_set[i]] = rows if rows.shape[1] == state_len else upgrade_rows(rows, cfg)

    def ints(name: str, default: int = _NONE) -> np.ndarray:
        if name not in t.column_names:
            return np.full(n, default, dtype=np.int64)
        return t.column(name).fill_null(default).to_numpy().copy()  # writable

    def strings(name: str) -> np.ndarray:
        if name not in t.column_names:
            return np.full(n, None, dtype=object)
        return t.column(name).to_numpy(zero_copy_only=False).astype(object)

    pending = strings("pending_status")
    return Bucket(
        t.column("device_id").to_numpy(zero_copy_only=False), strings("status"),
        ints("status_since"), ints("last_seen"), ints("timeout_at"),
        values,
        t.column("anomaly_score").to_numpy(zero_copy_only=False).astype(np.float64),
        dets, det_set, ints("last_received"), strings("status_reason"), status_codes(pending),
        ints("pending_count", 0), ints("pending_since"),
        np.stack([strings(f"topic.{c}") for c in topics], axis=1) if topics
        else np.zeros((n, 0), dtype=object))


def status_codes(status: np.ndarray) -> np.ndarray:
    """Status names (object array) as ``STATUSES`` codes, -1 for none."""
    return np.select([status == "online", status == "degraded", status == "offline"], [0, 1, 2], -1)



def devices_table(b: Bucket, metrics: tuple[str, ...], rows: np.ndarray | None = None,
                  topics: tuple[str, ...] = ()) -> pa.Table:
    """The devices at positions ``rows`` (all by default) as rows of ``device_state_schema``."""
    def at(a: np.ndarray) -> np.ndarray:
        return a if rows is None else a[rows]

    k = len(metrics)
    return pa.table([
        pa.array(at(b.ids), pa.string()), pa.array(at(b.status), pa.string()),
        _ints(at(b.status_since)), _ints(at(b.last_seen)), _ints(at(b.timeout_at)),
        *[_floats(at(b.values[:, i])) for i in range(k)], _floats(at(b.anomaly_score)),
        *[_packed(at(b.dets[i]), at(b.det_set[i])) for i in range(k)],
        _ints(at(b.last_received)), pa.array(at(b.reason), pa.string()),
        pa.array(STATUSES[at(b.pending)], pa.string()), pa.array(at(b.pending_n), pa.int64()),
        _ints(at(b.pending_since)),
        *[pa.array(at(b.topics[:, j]), pa.string()) for j in range(len(topics))],
    ], schema=device_state_schema(metrics, topics))


class Rows:
    """Output rows collected as column parts; one pandas frame per call (no per-row dicts)."""

    def __init__(self, out_types: dict[str, str]) -> None:
        self.parts: list[tuple[int, dict]] = []
        self.out_types = out_types

    def add(self, n: int, **cols: object) -> None:
        if n:
            self.parts.append((n, cols))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self._columns(self.parts, self.out_types))

    def columns(self, kind: str) -> dict[str, np.ndarray]:
        """The rows of one kind as arrays, only the columns its parts name (and ``kind``): what
        the driver writes from, without a frame of every column for every row."""
        parts = [(n, cols) for n, cols in self.parts if cols.get("kind") == kind]
        names = {"kind": None} | {c: None for _, cols in parts for c in cols}
        return self._columns(parts, {c: t for c, t in self.out_types.items() if c in names})

    @staticmethod
    def _columns(parts: list[tuple[int, dict]], types: dict[str, str]) -> dict[str, np.ndarray]:
        total = sum(n for n, _ in parts)
        data = {}
        for c, typ in types.items():
            if typ == "double":
                col = np.full(total, np.nan)
            elif typ == "timestamp":
                col = np.full(total, _NAT, dtype=np.int64)
            else:
                col = np.full(total, None, dtype=object)
            pos = 0
            for n, cols in parts:
                if c in cols:
                    col[pos:pos + n] = cols[c]
                pos += n
            data[c] = col.view("datetime64[ns]") if typ == "timestamp" else col
        return data


@dataclass(frozen=True)
class Rules:
    """What makes a device degraded, from the telemetry model: one row per status rule."""

    metrics: tuple[str, ...]  # the gold metrics, in state order
    rule_metric: np.ndarray  # index into metrics, per rule
    below: np.ndarray  # float, NaN = no bound
    above: np.ndarray
    names: tuple[str, ...]  # rule reasons, then "error", "anomaly"
    error_status: str
    topics: tuple[str, ...]  # the topic columns a device's state keeps the latest of

    @classmethod
    def of(cls, model: TelemetryModel) -> Rules:
        metrics = model.gold_metrics
        r = model.status_rules
        return cls(metrics, np.array([metrics.index(x.metric) for x in r], dtype=np.int64),
                   np.array([np.nan if x.below is None else x.below for x in r], dtype=float),
                   np.array([np.nan if x.above is None else x.above for x in r], dtype=float),
                   (*(x.reason for x in r), "error", "anomaly"), model.error_status,
                   model.topic_columns)

    def reasons(self, fired: np.ndarray) -> np.ndarray:
        """Comma-joined reasons per column of ``fired`` ([rules + 2, n] bool); "data" if none."""
        codes = (fired.astype(np.int64) << np.arange(len(self.names))[:, None]).sum(axis=0)
        names = {c: ",".join(n for j, n in enumerate(self.names) if c >> j & 1) or "data"
                 for c in np.unique(codes).tolist()}
        return np.array([names[c] for c in codes.tolist()], dtype=object)



def go_offline(devs: Bucket, went: np.ndarray, when_ms: np.ndarray | int, reason: str, out: Rows) -> None:
    """Take the devices at positions ``went`` offline as of ``when_ms``, for ``reason``: at once,
    whatever status their readings were holding to."""
    out.add(len(went), kind="status", device_id=devs.ids[went], status="offline",
            previous_status=devs.status[went], reason=reason, event_time=when_ms * 1_000_000)
    devs.status[went], devs.status_since[went], devs.reason[went] = "offline", when_ms, reason
    devs.timeout_at[went], devs.pending[went], devs.pending_n[went] = _NONE, -1, 0


def time_out(devs: Bucket, candidates: np.ndarray, wm: int, timeout_ms: int, out: Rows) -> np.ndarray:
    """Take the ``candidates`` (bool per device) whose deadline is below the watermark ``wm``
    offline as of last reading + timeout (no reading for that long); returns their positions."""
    timed_out = np.flatnonzero(candidates & (devs.timeout_at != _NONE) & (devs.timeout_at < wm))
    devs.timeout_at[timed_out] = _NONE
    went = timed_out[devs.status[timed_out] != "offline"]
    go_offline(devs, went, devs.last_seen[went] + timeout_ms, "no_data", out)
    return timed_out


def _live(devs: Bucket) -> np.ndarray:
    """Per device: online or degraded, and received at a known time (the wall-clock rule's)."""
    return (((devs.status == "online") | (devs.status == "degraded"))
            & (devs.last_received != _NONE))


def time_out_received(devs: Bucket, now_ms: int, since_ms: int, timeout_ms: int, out: Rows) -> np.ndarray:
    """The wall-clock rule: take the devices the pipeline received nothing from for
    ``timeout_ms`` as of ``now_ms``, counted from their last reading or from ``since_ms`` (the
    live run's start) if later, offline as of then + timeout; returns their positions."""
    due = np.maximum(devs.last_received, since_ms) + timeout_ms
    went = np.flatnonzero(_live(devs) & (due <= now_ms))
    go_offline(devs, went, due[went], "no_data", out)
    return went


def next_due(devs: Bucket, since_ms: int, timeout_ms: int) -> int | None:
    """When the wall-clock rule takes its next device offline (epoch ms; None: no device to)."""
    live = _live(devs)
    return max(int(devs.last_received[live].min()), since_ms) + timeout_ms if live.any() else None


def add_current(devs: Bucket, cur: np.ndarray, out: Rows, rules: Rules) -> None:
    """A ``current`` row (``device_current``) for each device at positions ``cur``."""
    out.add(len(cur), kind="current", device_id=devs.ids[cur], status=devs.status[cur],
            status_since=_ns(devs.status_since[cur]), last_seen=_ns(devs.last_seen[cur]),
            **{m: devs.values[cur, i] for i, m in enumerate(rules.metrics)},
            anomaly_score=devs.anomaly_score[cur], last_received=_ns(devs.last_received[cur]),
            status_reason=devs.reason[cur], **{c: devs.topics[cur, j] for j, c in enumerate(rules.topics)})


def _ns(ms: np.ndarray) -> np.ndarray:
    """Epoch ms (``_NONE`` = missing) as int64 ns (``_NAT``)."""
    return np.where(ms == _NONE, _NAT, ms * 1_000_000)


@lru_cache(maxsize=8)
def _initial_det(cfg: DetectorConfig) -> np.ndarray:
    """The detector state of a never-seen (device, metric)."""
    return initial_rows(1, cfg)[0]


def score_readings(pdf: pd.DataFrame, devs: Bucket, out: Rows, cfg: DetectorConfig,
                   gold: GoldSettings, timeout_ms: int, rules: Rules) -> np.ndarray:
    """Score one bucket's readings per device in event-time order; returns the devices' positions."""
    codes, names = pd.factorize(pdf["device_id"].to_numpy(dtype=object))
    t_raw = pdf["event_time"].to_numpy(dtype="datetime64[ns]").view(np.int64)
    order = np.lexsort((t_raw, codes))  # stable: ties keep their arrival order
    codes, t_ns = codes[order], t_raw[order]
    n = len(order)
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    ends = np.r_[starts[1:], n]
    ms = t_ns // 1_000_000
    t_sec = ms / 1000.0
    metrics = rules.metrics
    k = len(metrics)
    vals = np.stack([pdf[m].to_numpy(dtype=float)[order] for m in metrics])
    pos = devs.index(np.asarray(names, dtype=object)[codes[starts]])

    # one detector lane per (metric, device): every lane of the bucket in one compiled call,
    # on the states where the bucket holds them (a copy of every state out and back would cost
    # more than the scoring)
    present = ~np.isnan(vals)
    unset = np.nonzero(~devs.det_set[:, pos])
    # a (device, metric) never learnt starts from the initial state (unset until it learns)
    devs.dets[unset[0], pos[unset[1]]] = _initial_det(cfg)
    states = devs.states()
    offsets = np.r_[(starts + n * np.arange(k)[:, None]).ravel(), k * n]
    lanes = (np.arange(k)[:, None] * len(devs.ids) + pos).ravel()
    s, bl, f, nb, mdl, low, high = score_lanes_at(vals.ravel(), np.tile(t_sec, k), offsets, states,
                                                  lanes, cfg)
    scores, base, flags = s.reshape(k, n), bl.reshape(k, n), f.reshape(k, n)
    model = np.where(mdl > 0, mdl, np.nan).reshape(k, n)  # 0: no model yet (first reading)
    low, high = low.reshape(k, n), high.reshape(k, n)
    # a metric without readings keeps its state (and a never-seen one stays unset)
    seen = np.add.reduceat(present, starts, axis=1) > 0
    for i in range(k):
        devs.det_set[i, pos[seen[i]]] = True

    warm = nb.reshape(k, n) + 1 > cfg.warmup  # no status from warm-up scores
    max_score = np.where(warm, scores, 0.0).max(axis=0)

    dev_col = names[codes]
    idx = np.flatnonzero(present.any(axis=0))
    out.add(len(idx), kind="reading", device_id=dev_col[idx],
            event_id=pdf["event_id"].to_numpy(dtype=object)[order][idx], event_time=t_ns[idx],
            **{c: v for i, m in enumerate(metrics) for c, v in (
                (m, vals[i, idx]), (f"{m}_score", scores[i, idx]), (f"{m}_baseline", base[i, idx]),
                (f"{m}_anomaly", flags[i, idx]), (f"{m}_model", model[i, idx]),
                (f"{m}_low", low[i, idx]), (f"{m}_high", high[i, idx]))})

    with np.errstate(invalid="ignore"):  # NaN (no value) fires no rule
        rv = vals[rules.rule_metric]  # [rules, n]
        fired = (rv < rules.below[:, None]) | (rv > rules.above[:, None])
    err = (pdf["status"].to_numpy(dtype=object)[order] == rules.error_status) if rules.error_status \
        else np.zeros(n, dtype=bool)
    anom = max_score >= gold.anomaly_score_high
    fired = np.vstack([fired, err, anom])
    # a death certificate (Sparkplug DDEATH / NDEATH, reported as status "offline"): offline now
    dead = pdf["status"].to_numpy(dtype=object)[order] == REPORTED_OFFLINE
    shown = np.where(dead, _OFFLINE, fired.any(axis=0).astype(np.int64))  # each reading's status
    before = status_codes(devs.status[pos])
    status, pend, pend_n, pend_since = (before.copy(), devs.pending[pos], devs.pending_n[pos],
                                        devs.pending_since[pos])
    eff, is_change = _hold(shown, ms, starts, status, pend, pend_n, pend_since,
                           gold.status_hold_readings, round(gold.status_hold_seconds * 1000))
    prev = np.empty(n, dtype=np.int64)
    prev[1:] = eff[:-1]
    prev[starts] = before
    changed = np.flatnonzero(is_change)

    def why(i: np.ndarray) -> np.ndarray:
        return np.where(dead[i], "death", rules.reasons(fired[:, i]))

    out.add(len(changed), kind="status", device_id=dev_col[changed], status=STATUSES[eff[changed]],
            previous_status=STATUSES[prev[changed]], reason=why(changed), event_time=t_ns[changed])

    last = ends - 1
    last_change = np.maximum.reduceat(np.where(is_change, np.arange(n), -1), starts)
    devs.status[pos] = STATUSES[status]
    devs.pending[pos], devs.pending_n[pos], devs.pending_since[pos] = pend, pend_n, pend_since
    devs.status_since[pos] = np.where(last_change >= 0, ms[last_change], devs.status_since[pos])
    # the status's reason: that of its latest reading showing it (a change's reading shows it)
    agrees = np.maximum.reduceat(np.where(eff == shown, np.arange(n), -1), starts)
    has = agrees >= 0
    devs.reason[pos[has]] = why(agrees[has])
    devs.last_seen[pos] = np.maximum(ms[last], np.where(devs.last_seen[pos] == _NONE, 0,
                                                        devs.last_seen[pos]))
    received = pdf["ingest_time"].to_numpy(dtype="datetime64[ns]").view(np.int64)[order]
    received = np.where(received == _NAT, _NONE, received // 1_000_000)
    devs.last_received[pos] = np.maximum(devs.last_received[pos], np.maximum.reduceat(received, starts))
    for j, c in enumerate(rules.topics):  # the latest reading's topic parts (the last known)
        v = pdf[c].to_numpy(dtype=object)[order][last]
        devs.topics[pos, j] = np.where(pd.isna(v), devs.topics[pos, j], v)
    devs.values[pos] = vals[:, last].T
    devs.anomaly_score[pos] = max_score[last]
    devs.timeout_at[pos] = np.where(dead[last], _NONE, devs.last_seen[pos] + timeout_ms)
    if "node_death" in pdf.columns:
        return np.union1d(pos, node_deaths(pdf, devs, out))
    return pos


@_njit_cached
def _hold(shown, t_ms, starts, status, pend, pend_n, pend_since, hold_n, hold_ms):
    """The devices' statuses through their readings (``starts``: each device's first, in
    event-time order), each ``STATUSES`` code: ``shown`` per reading; ``status``, ``pend`` (the
    status the readings hold to, -1: none), ``pend_n`` (readings of it) and ``pend_since`` (the
    first one's time) per device, updated in place. A change between online and degraded takes
    effect at the reading that completes its hold (``hold_n`` consecutive readings and
    ``hold_ms`` since the first); offline, and any status after offline or none, at once.
    Returns each reading's status after it and whether it changed there."""
    n = shown.size
    eff = np.empty(n, np.int64)
    change = np.zeros(n, np.bool_)
    for d in range(starts.size):
        end = starts[d + 1] if d + 1 < starts.size else n
        e, p, c, since = status[d], pend[d], pend_n[d], pend_since[d]
        for i in range(starts[d], end):
            r = shown[i]
            if r == e:
                p, c = -1, 0
            elif e < 0 or e == 2 or r == 2:
                e, p, c = r, -1, 0
                change[i] = True
            else:
                if r != p:
                    p, c, since = r, 0, t_ms[i]
                c += 1
                if c >= hold_n and t_ms[i] - since >= hold_ms:
                    e, p, c = r, -1, 0
                    change[i] = True
            eff[i] = e
        status[d], pend[d], pend_n[d], pend_since[d] = e, p, c, since
    return eff, change


def node_deaths(pdf: pd.DataFrame, devs: Bucket, out: Rows) -> np.ndarray:
    """An edge node's death (NDEATH) takes every device of the node offline (those with no
    later message), as of the death's time: reason ``node_death``."""
    nd = pdf["node_death"].to_numpy(dtype=bool)
    gone: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    ids = pdf["device_id"].to_numpy(dtype=object)
    t_ms = pdf["event_time"].to_numpy(dtype="datetime64[ns]").view(np.int64) // 1_000_000
    for i in np.flatnonzero(nd):
        prefix, when = ids[i] + "/", t_ms[i]
        hit = np.array([d.startswith(prefix) for d in devs.ids], dtype=bool) \
            & (devs.status != "offline") & ((devs.last_seen == _NONE) | (devs.last_seen <= when))
        went = np.flatnonzero(hit)
        go_offline(devs, went, when, "node_death", out)
        gone.append(went)
    return np.unique(np.concatenate(gone))


def health_input(model: TelemetryModel) -> list[str]:
    """The silver columns the health stream reads (``extra``: Sparkplug's node and message type;
    ``ingest_time``: when the pipeline received the reading, the wall-clock rule's)."""
    return ["device_id", "event_id", "event_time", *model.gold_metrics, "status", "ingest_time",
            *model.topic_columns, *(["extra"] if model.sparkplug else [])]


def node_death() -> Column:
    """Whether a Sparkplug row is an edge node's death (NDEATH: its devices go offline)."""
    return F.coalesce(F.get_json_object("extra", "$.message_type") == "NDEATH", F.lit(False))


