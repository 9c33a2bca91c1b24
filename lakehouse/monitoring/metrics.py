"""Streaming metrics: every progress event of every query, to Delta and to Prometheus.

A PySpark ``StreamingQueryListener`` turns each progress event into a ``pipeline_metrics`` row
(input rows, rates, batch duration and its parts, state rows and memory, watermark, rows dropped
by the watermark, duplicates dropped, consumer lag) and updates Prometheus gauges. The callback
only buffers: a background thread MERGEs the buffer into the table with delta-spark every few
seconds (a Spark job inside the listener would stall Spark's listener bus), keyed on
(query_id, batch_id), so a batch replayed after a restart is one row.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import Counter, Gauge
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQueryListener

from lakehouse.delta.read import latest_version
from lakehouse.delta.tables import ensure_named_table, timestamp_literal, upsert
from lakehouse.tables import PIPELINE_METRICS

log = logging.getLogger(__name__)

_LABEL = ["query"]
INPUT_ROWS = Counter("iotlake_stream_input_rows", "rows read by a streaming query", _LABEL)
INPUT_RATE = Gauge("iotlake_stream_input_rows_per_second", "input rate of the last batch", _LABEL)
PROC_RATE = Gauge("iotlake_stream_processed_rows_per_second", "processing rate of the last batch", _LABEL)
BATCH_MS = Gauge("iotlake_stream_batch_duration_ms", "trigger execution time of the last batch", _LABEL)
STATE_ROWS = Gauge("iotlake_stream_state_rows", "rows in the query's state store", _LABEL)
STATE_BYTES = Gauge("iotlake_stream_state_memory_bytes", "memory used by the state store", _LABEL)
LAG = Gauge("iotlake_stream_lag", "records (Kafka) or table versions (Delta) not yet read", _LABEL)
BATCH_ID = Gauge("iotlake_stream_last_batch_id", "last completed micro-batch", _LABEL)


def _offsets(value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


#: Delta source offset index past a version's last file (``DeltaSourceOffset.END_INDEX``).
END_INDEX = 2**63 - 1 - 100


def _partitions(offsets: dict) -> dict[str, int]:
    """Spark's kafka source offsets ``{topic: {partition: offset}}`` flattened."""
    return {f"{t}/{p}": int(o) for t, parts in offsets.items() if isinstance(parts, dict)
            for p, o in parts.items()}


def _delta_path(description: str) -> str | None:
    """The table of a Delta source, from its description ``DeltaSource[file:/...]``."""
    if not description.startswith("DeltaSource[") or not description.endswith("]"):
        return None
    path = description[len("DeltaSource["):-1]
    return path[len("file:"):] if path.startswith("file:") else path


def lag_of(source: dict) -> int | None:
    """Kafka: records not yet read (sum over partitions of latest - read offset); Delta: table
    versions not yet fully read (Delta's source reports no latest offset: the table's latest
    version, read from its log without a JVM call)."""
    end = _offsets(source.get("endOffset"))
    if not end:
        return None
    if "reservoirVersion" in end:
        path = _delta_path(source.get("description") or "")
        if path is None:
            return None
        version, index = int(end["reservoirVersion"]), int(end.get("index", -1))
        done = version if index == END_INDEX else version - 1  # fully read versions
        try:
            return max(0, latest_version(path, known=max(done, 0)) - done)
        except Exception:  # noqa: BLE001 - a lag figure must never break a stream
            return None
    latest = _partitions(_offsets(source.get("latestOffset")))
    read = _partitions(end)
    if not latest:
        return None
    return sum(max(0, o - read.get(p, 0)) for p, o in latest.items())


#: Figures a foreachBatch writer measured itself (silver's dedup index keeps state outside
#: Spark's operators), by (query id, batch id); merged into that batch's progress row.
_BATCH_NOTES: dict[tuple[str, int], dict] = {}


def note_batch(query_id: str, batch_id: int, **figures: int) -> None:
    """Record ``state_rows`` / ``rows_dropped_by_watermark`` / ``duplicates_dropped`` for a batch
    whose query keeps them outside Spark's state operators."""
    if len(_BATCH_NOTES) > 10_000:  # a query without a listener: keep memory bounded
        _BATCH_NOTES.clear()
    _BATCH_NOTES[(query_id, batch_id)] = figures


def progress_row(p: dict) -> dict:
    ops = p.get("stateOperators") or []
    custom = [o.get("customMetrics") or {} for o in ops]
    lags = [lag_of(s) for s in p.get("sources") or []]
    noted = _BATCH_NOTES.pop((p["id"], int(p["batchId"])), {})
    return {**_progress_fields(p, ops, custom, lags), **noted}


def _progress_fields(p: dict, ops: list[dict], custom: list[dict], lags: list) -> dict:
    return {
        "query_name": p.get("name") or "", "query_id": p["id"], "run_id": p.get("runId"),
        "batch_id": int(p["batchId"]),
        "timestamp": datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")),
        "num_input_rows": int(p.get("numInputRows") or 0),
        "input_rows_per_second": float(p.get("inputRowsPerSecond") or 0.0),
        "processed_rows_per_second": float(p.get("processedRowsPerSecond") or 0.0),
        "batch_duration_ms": int((p.get("durationMs") or {}).get("triggerExecution") or 0),
        "duration_ms": json.dumps(p.get("durationMs") or {}),
        "state_rows": sum(int(o.get("numRowsTotal") or 0) for o in ops),
        "state_memory_bytes": sum(int(o.get("memoryUsedBytes") or 0) for o in ops),
        "rows_dropped_by_watermark": sum(int(o.get("numRowsDroppedByWatermark") or 0) for o in ops),
        "duplicates_dropped": sum(int(c.get("numDroppedDuplicateRows") or 0) for c in custom),
        "watermark": (p.get("eventTime") or {}).get("watermark"),
        "lag": next((x for x in lags if x is not None), None),
        "progress_json": json.dumps(p),
    }


class _JsonEvents:
    """The JVM side's view of a :class:`JsonListener`: takes each progress event as its JSON.

    PySpark's own bridge first rebuilds every event as Python objects, field by field over
    Py4J (hundreds of round trips per event, several events per second per query): one call
    for the JSON is all the listener needs.
    """

    def __init__(self, listener: JsonListener) -> None:
        self.listener = listener

    def onQueryStarted(self, jevent) -> None:
        pass

    def onQueryProgress(self, jevent) -> None:
        self.listener.record(jevent.progress().json())

    def onQueryIdle(self, jevent) -> None:
        pass

    def onQueryTerminated(self, jevent) -> None:
        self.listener.ended(str(jevent.runId()))

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


class JsonListener(StreamingQueryListener):
    """A listener that takes each progress event as its JSON (``record``) and each query's end
    as its run id (``ended``), through :class:`_JsonEvents`. Both run on Spark's listener bus,
    in the order the events were posted: no Spark job there."""

    @property
    def _jlistener(self):
        """Registered with the JVM by ``spark.streams.addListener``: the JSON-only bridge."""
        if not hasattr(self, "_jlistenerobj"):
            from pyspark import SparkContext

            self._jlistenerobj = SparkContext._jvm.PythonStreamingQueryListenerWrapper(_JsonEvents(self))
        return self._jlistenerobj

    def record(self, progress_json: str) -> None:
        raise NotImplementedError

    def ended(self, run_id: str) -> None:
        pass

    def onQueryStarted(self, event) -> None:
        pass

    def onQueryProgress(self, event) -> None:
        self.record(event.progress.json)

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        self.ended(str(event.runId))


class BatchTotals(JsonListener):
    """Input rows and micro-batches of each query run, from every progress event: a query's
    ``recentProgress`` keeps the last 100 only (``spark.sql.streaming.numRecentProgressUpdates``),
    so a sum over it is short after 100 batches. Add it before the queries start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, list[int]] = {}  # run id -> [rows, batches, last batch id, its rows]
        self._ended: dict[str, threading.Event] = {}

    def record(self, progress_json: str) -> None:
        p = json.loads(progress_json)
        rows, batch = int(p.get("numInputRows") or 0), int(p["batchId"])
        with self._lock:
            t = self._runs.setdefault(p["runId"], [0, 0, -1, 0])
            if t[2] == batch:  # a batch reported again: its last report counts
                t[0] -= t[3]
            else:
                t[1] += 1
            t[0] += rows
            t[2], t[3] = batch, rows

    def ended(self, run_id: str) -> None:
        self._event(run_id).set()

    def _event(self, run_id: str) -> threading.Event:
        with self._lock:
            return self._ended.setdefault(run_id, threading.Event())

    def totals(self, query) -> tuple[int, int]:
        """(input rows, micro-batches) ``query`` has reported so far."""
        with self._lock:
            rows, batches, *_ = self._runs.get(str(query.runId), [0, 0])
        return rows, batches

    def final(self, query, timeout: float = 60.0) -> tuple[int, int]:
        """``totals`` once the listener has had the query's end: the bus delivers events after
        the query has stopped, its last batch's progress before its end."""
        if not self._event(str(query.runId)).wait(timeout):
            log.warning("no end event from query %s within %.0f s: its counts may be short",
                        query.name, timeout)
        return self.totals(query)


class MetricsListener(JsonListener):
    """Records progress to Prometheus at once and to ``pipeline_metrics`` every
    ``flush_seconds`` (from its own thread)."""

    def __init__(self, spark: SparkSession, table_path: str, flush_seconds: float) -> None:
        # its own session: the MERGE's transaction id is a session conf (``with_txn``), which
        # other threads' commits in the shared session (the upkeep's DELETEs) would pick up
        self.spark = spark.newSession()
        self.path = table_path
        self.flush_seconds = flush_seconds
        self._rows: list[dict] = []
        self._lock = threading.Lock()  # the buffer
        self._write_lock = threading.Lock()  # one MERGE at a time, in order
        self._flushes = 0
        self._app_id = f"pipeline_metrics-{uuid.uuid4()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="iotlake-metrics-writer", daemon=True)
        self._thread.start()

    def record(self, progress_json: str) -> None:
        """One progress event (its JSON) into the buffer and the Prometheus series."""
        try:
            row = progress_row(json.loads(progress_json))
        except Exception:  # noqa: BLE001 - metrics must never break a stream
            log.exception("could not read a progress event")
            return
        q = row["query_name"] or row["query_id"]
        INPUT_ROWS.labels(q).inc(row["num_input_rows"])
        INPUT_RATE.labels(q).set(row["input_rows_per_second"])
        PROC_RATE.labels(q).set(row["processed_rows_per_second"])
        BATCH_MS.labels(q).set(row["batch_duration_ms"])
        STATE_ROWS.labels(q).set(row["state_rows"])
        STATE_BYTES.labels(q).set(row["state_memory_bytes"])
        BATCH_ID.labels(q).set(row["batch_id"])
        if row["lag"] is not None:
            LAG.labels(q).set(row["lag"])
        with self._lock:
            self._rows.append(row)

    # ``ended``: no flush there: a MERGE is a Spark job, and this runs on the listener bus.

    def _run(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            if self.spark.sparkContext._jsc is None:  # the session stopped: nothing to write to
                return
            self.flush()

    def close(self) -> None:
        """Stop the writer thread after a last flush."""
        self._stop.set()
        self._thread.join(timeout=60)
        self.flush()

    def flush(self) -> None:
        """MERGE buffered rows into ``pipeline_metrics`` (one row per query and batch)."""
        with self._write_lock:
            with self._lock:
                rows, self._rows = self._rows, []
            if not rows:
                return
            latest = {(r["query_id"], r["batch_id"]): r for r in rows}  # last report of a batch wins
            data = pa.Table.from_pylist([{k: r.get(k) for k in PIPELINE_METRICS.names}
                                         for r in latest.values()], schema=PIPELINE_METRICS)
            try:
                if self.spark.sparkContext._jsc is None:  # the session stopped
                    raise RuntimeError("the Spark session is stopped")
                # Roles in separate processes (``run --role``) MERGE into this table at the same
                # time: upsert retries commit conflicts (the MERGE is keyed: a retry is harmless)
                upsert(self.spark.createDataFrame(data), self.path, ["query_id", "batch_id"],
                       self._app_id, self._flushes, within=_recent(data))
                self._flushes += 1
            except Exception:  # noqa: BLE001
                log.exception("could not write pipeline_metrics; %d rows dropped", len(rows))


def _recent(data: pa.Table) -> str | None:
    """A MERGE condition that spares the scan of the table's older days (7 by default): the
    reports of one batch (again, or after a restart) come within a day of each other."""
    first = pc.min(data.column("timestamp")).as_py()
    if first is None:
        return None
    return f"t.`timestamp` >= {timestamp_literal(first - timedelta(days=1))}"


def install(spark, settings) -> MetricsListener:
    """Attach the listener to the session (one per session, re-pointed if the table moved)."""
    path = settings.table_path("pipeline_metrics")
    existing = getattr(spark, "_iotlake_metrics", None)
    if existing is not None:
        if existing.path == path:
            return existing
        existing.close()
        spark.streams.removeListener(existing)
    ensure_named_table(spark, settings, "pipeline_metrics", PIPELINE_METRICS)
    listener = MetricsListener(spark, path, settings.observability.metrics_flush_seconds)
    spark.streams.addListener(listener)
    spark._iotlake_metrics = listener
    return listener


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Expose every iotlake metric (bridge and streams) for Prometheus on ``addr:port``."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=addr)
    log.info("Prometheus metrics on http://%s:%d/metrics", addr, port)
