"""Helpers shared by the layer streams: stable query ids, triggers, lifecycle."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

from py4j.protocol import Py4JJavaError
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter

from lakehouse.settings import Settings


class CheckpointBusy(RuntimeError):
    """Another process runs a stream on this checkpoint."""


_held: dict[str, int] = {}  # checkpoint -> fd of its lock file, held by this process


def lock_checkpoint(checkpoint: str) -> None:
    """Take the checkpoint's exclusive lock (released by the OS if the process dies).

    Two queries on one checkpoint corrupt it; this makes a backfill or a second ``iotlake run``
    fail fast instead. Re-taking a lock this process holds is a no-op (restarts in-process).
    """
    if checkpoint in _held:
        return
    Path(checkpoint).mkdir(parents=True, exist_ok=True)
    fd = os.open(os.path.join(checkpoint, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointBusy(
            f"checkpoint {checkpoint} is in use by another running stream (e.g. `iotlake run`); "
            "stop that stream first, or let it catch up by itself") from None
    _held[checkpoint] = fd


def release_checkpoints() -> None:
    """Release every checkpoint lock this process holds (after its queries stopped)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)


def query_id(checkpoint: str) -> str:
    """Lock the checkpoint and return the streaming query id persisted in it.

    The id is created before the first start.

    Spark keeps the id in ``<checkpoint>/metadata`` across restarts; writing it ourselves first
    lets the sinks use it as their Delta app-transaction id before the query exists.
    """
    lock_checkpoint(checkpoint)
    meta = Path(checkpoint, "metadata")
    if meta.exists():
        return json.loads(meta.read_text().splitlines()[0])["id"]
    meta.parent.mkdir(parents=True, exist_ok=True)
    qid = str(uuid.uuid4())
    tmp = meta.with_suffix(".tmp")
    tmp.write_text(json.dumps({"id": qid}) + "\n")
    tmp.rename(meta)
    return qid


@contextmanager
def pool(spark: SparkSession, name: str) -> Iterator[None]:
    """Start queries inside this block in the FAIR scheduler pool ``name`` (bronze, silver or
    gold: ``lakehouse/runtime/fairscheduler.xml``). A query's thread, and the jobs its foreachBatch
    runs, inherit the pool from the thread that started it; the caller's pool is restored."""
    sc = spark.sparkContext
    before = sc.getLocalProperty("spark.scheduler.pool")
    sc.setLocalProperty("spark.scheduler.pool", name)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.scheduler.pool", before)


def trigger_kwargs(settings: Settings, mode: str = "live", layer: str = "") -> dict:
    """``live``: processingTime from settings (gold's own interval for ``layer="gold"``, the
    window aggregates' for ``layer="windows"``); ``available_now`` / ``once`` for batch catch-up."""
    if mode == "available_now":
        return {"availableNow": True}
    if mode == "once":
        return {"once": True}
    if mode != "live":
        raise ValueError(f"unknown trigger mode {mode!r}: use live, available_now or once")
    st = settings.stream
    seconds = st.trigger_seconds
    if layer in ("gold", "windows") and st.gold_trigger_seconds >= 0:
        seconds = st.gold_trigger_seconds
    if layer == "windows" and st.windows_trigger_seconds >= 0:
        seconds = st.windows_trigger_seconds
    return {"processingTime": f"{int(seconds * 1000)} milliseconds"}


def batch_watermark_ms(checkpoint: str, batch_id: int) -> int:
    """Event-time watermark (epoch ms) a micro-batch evicts state with, from the offsets log.

    Spark writes ``offsets/<batch>`` before running the batch, and a replay reuses it, so every
    run of a batch (first or replayed) sees the same watermark.
    """
    f = Path(checkpoint, "offsets", str(batch_id))
    if not f.exists():
        raise RuntimeError(f"offsets log for batch {batch_id} missing in {checkpoint}")
    return int(json.loads(f.read_text().splitlines()[1]).get("batchWatermarkMs", 0))


def pin_mode(checkpoint: str, setting: str, mode: str, started_as: str | None, rebuild: str) -> None:
    """A checkpoint keeps the ``setting``'s mode it started with (each mode keeps its state in
    its own form, which the other cannot read): raises ValueError on a change, saying how to go
    back or ``rebuild``. ``started_as``: the mode of a started checkpoint from before the pin."""
    f = Path(checkpoint, "iotlake_" + setting.split(".")[-1] + "_mode")
    if not f.exists():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text((started_as or mode) + "\n")
    was = f.read_text().strip()
    if was != mode:
        raise ValueError(f"checkpoint {checkpoint} was started with {setting} = {was!r}, not "
                         f"{mode!r}: set {setting} = {was!r} again, or {rebuild} to switch")


def at_or_before(ts: Column, epoch_us: int) -> Column:
    """``ts <= epoch_us`` for a bound that changes every micro-batch (a watermark).

    Spark writes a long or timestamp literal into its generated code, so a new bound makes the
    batch's code new: compiled again, and run interpreted until the JIT has compiled it again
    (measured: a per-batch compile on every micro-batch). A decimal literal is passed to the code as a reference
    instead, so the code stays the same from batch to batch. Decimal(18, 0) holds every
    timestamp Spark has (years 1 to 9999 in microseconds)."""
    return F.unix_micros(ts).cast("decimal(18,0)") <= F.lit(Decimal(epoch_us)).cast("decimal(18,0)")


#: What Spark takes for a query being stopped (``StreamExecution.isInterruptionException``).
_INTERRUPTIONS = frozenset({"java.lang.InterruptedException", "java.io.InterruptedIOException",
                            "java.nio.channels.ClosedByInterruptException"})


class QueryStopping(RuntimeError):
    """A ``foreachBatch`` error whose text Spark takes for its query's stop (see ``stoppable``)."""


def _stopped(what: str, name: str = "java.lang.InterruptedException") -> QueryStopping:
    return QueryStopping(f"py4j.protocol.Py4JJavaError: An error occurred while calling {what} "
                         f"(query stopping)\n: {name}")


class _QuietStops(logging.Filter):
    """py4j logs each error a Python ``foreachBatch`` raises, with its traceback, as an ERROR;
    a stop is none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], QueryStopping))


_quiet_stops = _QuietStops()


def foreach_batch(stream: DataFrame, query: str,
                  batch_fn: Callable[[DataFrame, int], None]) -> DataStreamWriter:
    """``stream``'s writer as the query named ``query``, each micro-batch through ``batch_fn``
    (``stoppable``: a graceful stop ends it between micro-batches)."""
    return stream.writeStream.queryName(query).foreachBatch(stoppable(batch_fn, query))


def stoppable(batch_fn: Callable[[DataFrame, int], None],
              query: str) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function for the query named ``query`` that a graceful stop
    (``between_batches``) holds at its start, and whose interruption reads as a stop to Spark.

    Spark recognises a stop that interrupted a Python ``foreachBatch`` by matching the Python
    error text with a regular expression (``StreamExecution.PROXY_ERROR``, ``(.|\\n)*``) whose
    matching recurses per character: on the long Java stack trace of a write interrupted
    mid-commit it overflowed the thread's stack (seen with the fused query), and the query died
    with a ``StackOverflowError`` instead of stopping. A short error naming the same Java
    exception lets the match succeed; any other error is raised as it is."""
    logging.getLogger("py4j.clientserver").addFilter(_quiet_stops)  # once: a set underneath

    def run(df: DataFrame, batch_id: int) -> None:
        _gate.hold_if_closed(query)
        try:
            batch_fn(df, batch_id)
        except Py4JJavaError as e:
            name = _interruption(e.java_exception)
            if name is None:
                raise
            raise _stopped("the batch's write", name) from None

    return run


class BatchGate:
    """A graceful stop's gate: the queries whose next micro-batch must not start, those of them
    whose batch waits at its start now, and those whose stop has begun (their batch gives way)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed: set[str] = set()
        self._held: set[str] = set()
        self._opened: set[str] = set()

    def hold_if_closed(self, query: str) -> None:
        """At a batch's start: return at once, or wait until the query's stop began and raise
        the interruption Spark takes for it. Nothing of the batch ran: Spark replays it at the
        next start, as after any stop."""
        with self._cond:
            if query not in self._closed:
                return
            self._held.add(query)
            self._cond.wait_for(lambda: query in self._opened or query not in self._closed)
            self._held.discard(query)
        raise _stopped("the batch (held for the stop)")

    def holding(self, query: str) -> bool:
        with self._cond:
            return query in self._held

    def open(self, query: str) -> None:
        with self._cond:
            self._opened.add(query)
            self._cond.notify_all()

    def close(self, queries: set[str]) -> None:
        with self._cond:
            self._closed.update(queries)

    def clear(self, queries: set[str]) -> None:
        with self._cond:
            self._closed.difference_update(queries)
            self._opened.difference_update(queries)
            self._cond.notify_all()


_gate = BatchGate()  # one per process: query names are unique among a session's active queries


@contextmanager
def between_batches(queries: Iterable[str]) -> Iterator[BatchGate]:
    """Hold each named query's next micro-batch at its start (``stoppable``) until the block
    opens it: a stop then finds the query between batches, with no Spark job to cancel.

    The held batch must be let go only after its query's ``stop()`` began (Spark marks the query
    terminated first): it then fails with an interruption, which Spark takes for the stop. Let go
    earlier, the query would fail. Spark cancels a batch's jobs when it is stopped mid-batch:
    correct (the batch is replayed at the next start), but pages of errors in the log."""
    names = set(queries)
    _gate.close(names)
    try:
        yield _gate
    finally:
        _gate.clear(names)


def _interruption(error) -> str | None:
    """The interruption's class name in a Java exception's cause chain, if any."""
    try:
        for _ in range(20):
            if error is None:
                return None
            name = error.getClass().getName()
            if name in _INTERRUPTIONS:
                return name
            error = error.getCause()
    except Exception:  # noqa: BLE001 - the JVM going away: not for us to judge
        return None
    return None
