"""The health stream's wall clock: ticks, and when each live run started listening.

Ticks: a health micro-batch when a device's wall-clock deadline passes and no data came.

Spark runs no micro-batch without new input, so when nothing arrives at all (a quiet site,
bridge or broker) the health stream would never look at the clock. Its driver mode reads a
second source beside silver: Spark's text file source on ``<checkpoint>/ticks``. After each
live batch the stream arms a timer for the earliest deadline of its online devices (last
received + ``offline_after_seconds``); each batch re-arms it, so it fires only when no batch
came after the deadline, and then writes a file there, which is new input: the next trigger
runs a batch, which reads its clock from the offsets log (``batchTimestampMs``, reused by a
replay). Idle with no deadline due, nothing runs and the query reads as idle (``isDataAvailable``
false), unlike a ``rate`` source's batch every trigger (~0.14 cores idle, measured). The file
source keeps ``availableNow`` (Spark falls back to a single ``once`` batch, ignoring
``maxFilesPerTrigger``, for a ``rate`` source) and needs no Python worker (a Python data
source kept ~230 MB of Python processes). Spark deletes the files of committed batches.

A device's silence counts from its last reading or from the start of the live run, whichever
is later (``LiveStarts``): while the pipeline was down its devices' data waited in the broker
and Kafka, and a restart after a long stop must not take the fleet offline before silver has
caught up on it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


def tick_dir(checkpoint: str) -> Path:
    return Path(checkpoint, "ticks")


def last_planned(checkpoint: str) -> int | None:
    """The checkpoint's last planned batch (None: none yet)."""
    offsets = Path(checkpoint, "offsets")
    return max((int(p.name) for p in offsets.glob("[0-9]*")), default=None) if offsets.is_dir() else None


def sources_planned(checkpoint: str) -> int | None:
    """How many sources the checkpoint's last planned batch read (None: none planned yet)."""
    batch = last_planned(checkpoint)
    if batch is None:
        return None
    return len(Path(checkpoint, "offsets", str(batch)).read_text().splitlines()) - 2  # version, metadata


def tick_stream(spark: SparkSession, checkpoint: str) -> DataFrame:
    """The ticks as a stream of one ``value`` (string) column."""
    d = tick_dir(checkpoint)
    d.mkdir(parents=True, exist_ok=True)
    return spark.readStream.format("text").option("cleanSource", "delete").load(str(d))


def batch_time_ms(checkpoint: str, batch_id: int) -> int:
    """The wall clock (epoch ms) Spark planned batch ``batch_id`` at, from the offsets log: what
    ``current_timestamp()`` is in the batch, the same for every run of it."""
    meta = Path(checkpoint, "offsets", str(batch_id)).read_text().splitlines()[1]
    return int(json.loads(meta)["batchTimestampMs"])


class TickTimer:
    """Writes a tick file at the deadline it was last set to (one armed timer at a time)."""

    def __init__(self, checkpoint: str, min_delay_s: float) -> None:
        self.dir = tick_dir(checkpoint)
        self.min_delay_s = min_delay_s  # a deadline already past: after a trigger, not at once
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def set(self, due_ms: int | None) -> None:
        """Arm for ``due_ms`` (epoch ms; None: disarm)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if due_ms is None:
                return
            delay = max(due_ms / 1000 - time.time(), self.min_delay_s)
            self._timer = threading.Timer(delay, self._tick, (due_ms,))
            self._timer.daemon = True
            self._timer.start()

    def _tick(self, due_ms: int) -> None:
        name = f"{due_ms}-{time.time_ns()}.txt"
        tmp = self.dir / f".{name}.tmp"  # a hidden name: Spark lists no file starting with "."
        try:
            tmp.write_text(f"{due_ms}\n")
            tmp.rename(self.dir / name)
        except OSError as e:  # the checkpoint went away (a test's, a rebuilt generation's)
            log.warning("health tick not written to %s: %s", self.dir, e)


class LiveStarts:
    """When each live run started (epoch ms), by the first batch it plans, in the checkpoint:
    a replayed batch counts from the start its first run counted from."""

    KEEP = 10  # a replay is of the last planned batch: the last two entries cover it

    def __init__(self, checkpoint: str) -> None:
        self.file = Path(checkpoint, "live_starts.json")
        self.entries: list[list[int]] = json.loads(self.file.read_text()) if self.file.exists() else []

    def begin(self, now_ms: int) -> None:
        """A live run starts: its batches are those after the last planned one (which, not
        committed, is replayed as its first run counted)."""
        planned = last_planned(str(self.file.parent))
        first = 0 if planned is None else planned + 1
        self.entries = [e for e in self.entries if e[0] < first][-(self.KEEP - 1):] + [[first, now_ms]]
        tmp = self.file.with_name(f".{self.file.name}.tmp")
        tmp.write_text(json.dumps(self.entries))
        tmp.replace(self.file)

    def since(self, batch_id: int) -> int:
        """The start of the run batch ``batch_id`` belongs to (0: none recorded)."""
        started = [ms for first, ms in self.entries if first <= batch_id]  # by first batch
        return started[-1] if started else 0
