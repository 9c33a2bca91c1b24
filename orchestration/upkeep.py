"""Built-in table upkeep of ``iotlake run``: retention, compaction and vacuum while the streams run.

Streaming sinks add small files every micro-batch and nothing else ever deletes a row, so a
plain ``iotlake run`` would slow every query as it goes and fill the disk. Every
``maintenance.check_seconds`` this thread:

- publishes the free disk under the local data root and warns while it is under
  ``maintenance.min_free_disk_gb`` (a full disk stops the embedded Kafka and fails every commit);
- drops a table's partitions that passed its retention (Delta's file statistics say so without
  a scan; a table created unpartitioned loses rows once the oldest is ``RETENTION_SLACK`` of its
  retention past due);
- bin-packs the tables whose small files (under ``maintenance.small_file_bytes``) reached
  ``maintenance.compact_min_files``, leaving bigger files alone (no Z-order: it would rewrite
  whole tables under load; the Airflow DAG does that);
- deletes Delta log files past ``maintenance.log_retention_hours`` (``clean_log``), except
  those a lagging stream still has to read;
- every ``maintenance.vacuum_interval_hours``, vacuums what those removed (``LITE``: found in the
  Delta log, no directory listing, which took 10-80 s a table under load). The full vacuum,
  which also finds files of writes that never committed, is the DAG's and ``iotlake vacuum``'s.
  Such a pass takes minutes under load, so retention and compaction run between its tables:
  a partition that expires during the pass is dropped on time, not one pass later.

It calls the same functions as the CLI and the DAG (``orchestration.maintenance``), in the FAIR
pool ``maintenance`` so the streams' tasks go first. ``maintenance.auto = false`` turns it off
when Airflow does the upkeep.

The Delta logs stay bounded by ``maintenance.log_retention_hours``; Spark bounds the streams'
checkpoint logs and state versions (``stream.checkpoint_batches``), silver's dedup index its own
changelog.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import Gauge

from lakehouse.delta.read import table_exists
from lakehouse.settings import Settings
from orchestration.maintenance import (
    clean_log,
    compact,
    expiry,
    oldest,
    resolve_tables,
    retain,
    session,
    small_files,
    vacuum,
)

log = logging.getLogger(__name__)

JOB_GROUP = "iotlake-upkeep"

DISK_FREE = Gauge("iotlake_data_root_disk_free_bytes",
                  "free bytes on the disk under the local data root, at the last upkeep pass")

#: Expired rows may linger this share of their table's retention before a DELETE runs.
RETENTION_SLACK = 0.1


def error_line(e: BaseException) -> str:
    """The line of a (py4j) error that names it: Delta's error class or the Java exception,
    not py4j's "An error occurred while calling o84.sql"."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = next((ln for ln in lines if "[DELTA_" in ln or "Exception:" in ln), None)
    return (named or (lines[0] if lines else type(e).__name__))[:300]


def free_disk_bytes(settings: Settings) -> int:
    """Free bytes on the disk under the local data root, also published as ``DISK_FREE``."""
    free = shutil.disk_usage(settings.root).free
    DISK_FREE.set(free)
    return free


class Upkeep:
    """One upkeep pass (``tick``) and the thread that runs it every ``check_seconds``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._state = settings.run_dir / "upkeep.json"  # the last vacuum survives restarts
        self.last_vacuum = self._load_last_vacuum()
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sc = None  # the SparkContext the thread's jobs run in

    def tick(self, now: datetime | None = None) -> dict[str, Any]:
        """Retention, compaction of crowded tables, then vacuum when due; what it did.
        One table at a time, so a stop request waits for one operation at most."""
        s, m = self.settings, self.settings.maintenance
        start, began = now or datetime.now(UTC), time.monotonic()

        def clock() -> datetime:
            return start + timedelta(seconds=time.monotonic() - began)

        done: dict[str, Any] = {"retained": [], "compacted": []}
        free_gb = self.watch_disk()
        if free_gb is not None:
            done["low_disk_free_gb"] = free_gb
        self._keep_up(done, clock)
        done["log_files_deleted"] = sum(clean_log(s).values())
        if not done["log_files_deleted"]:
            del done["log_files_deleted"]
        if start - self.last_vacuum >= timedelta(hours=m.vacuum_interval_hours):
            done["vacuumed"] = []
            for table in resolve_tables(s):
                if self._stop.is_set():
                    return done
                vacuum(s, [table], lite=True)  # the files compaction and retention removed
                done["vacuumed"].append(table)
                # a vacuum pass takes minutes under load: partitions expire and streams add
                # files meanwhile, so retention and compaction keep their pace
                self._keep_up(done, clock)
            self.last_vacuum = self._save_last_vacuum(start)
        self.passes += 1
        return done

    def watch_disk(self) -> float | None:
        """Publish the local data root's free disk; the free GB when under
        ``maintenance.min_free_disk_gb`` (and a warning that says what to do), else None."""
        s = self.settings
        free = free_disk_bytes(s)
        floor = s.maintenance.min_free_disk_gb
        if free >= floor * 2**30:
            return None
        free_gb = round(free / 2**30, 2)
        log.warning("only %.2f GB free on the disk under %s (maintenance.min_free_disk_gb = %g): "
                    "when it is full the embedded Kafka stops and every commit fails. Shorten "
                    "maintenance.retention_days or kafka.embedded_retention_bytes, or free space",
                    free_gb, s.root, floor)
        return free_gb

    def _keep_up(self, done: dict[str, Any], clock: Callable[[], datetime]) -> None:
        """Expired partitions before compaction (dropping them frees disk, and compacting them
        first would be wasted work), and the crowded tables after each table's retention: a
        busy table adds a file a second, so compaction must not wait for every retention."""
        expiring = self._expiring(clock())
        for table in expiring:
            if self._stop.is_set():
                return
            try:
                done["retained"] += [r for r in retain(self.settings, [table], now=clock())
                                     if r.get("deleted_rows")]
            except Exception as e:  # noqa: BLE001 - e.g. conflicts with a busy stream's appends
                log.warning("retention of %s failed (the next pass tries again): %s", table,
                            error_line(e))
            self._compact_crowded(done)
        if not expiring:
            self._compact_crowded(done)

    def _compact_crowded(self, done: dict[str, Any]) -> None:
        """Bin-pack the tables with ``compact_min_files`` files under ``small_file_bytes`` into
        files of up to 4x that, leaving bigger files alone: each row is rewritten about twice,
        not at every pass (a table compacted whole each time left 12x its live bytes on disk
        in removed files awaiting vacuum, and retention then rewrote the big files again)."""
        m = self.settings.maintenance
        for table in resolve_tables(self.settings):
            if self._stop.is_set():
                return
            if small_files(self.settings, table, m.small_file_bytes) >= m.compact_min_files:
                done["compacted"] += compact(self.settings, [table], target_size=4 * m.small_file_bytes,
                                             zorder=False, small_size=m.small_file_bytes)

    def _load_last_vacuum(self) -> datetime:
        """The last vacuum; on a data root that has none yet, now: nothing can be due before the
        first interval ends (tables are younger than vacuum's retention), so a fresh start does
        not spend its first minute vacuuming every table."""
        try:
            return datetime.fromisoformat(json.loads(self._state.read_text())["last_vacuum"])
        except (OSError, ValueError, KeyError):
            return self._save_last_vacuum(datetime.now(UTC))

    def _save_last_vacuum(self, when: datetime) -> datetime:
        self._state.parent.mkdir(parents=True, exist_ok=True)
        self._state.write_text(json.dumps({"last_vacuum": when.isoformat()}))
        return when

    def _expiring(self, now: datetime) -> list[str]:
        """Tables with a whole partition past its retention, or (unpartitioned) whose oldest row
        is past it by more than the slack."""
        s = self.settings
        out = []
        for table, days in s.maintenance.retention_days.items():
            if not table_exists(s.table_path(table)):
                continue
            boundary, _, whole = expiry(s, table, now)
            if not whole:
                boundary = now - timedelta(days=days * (1 + RETENTION_SLACK))
            first = oldest(s, table)
            if first is not None and first < boundary:
                out.append(table)
        return out

    def start(self) -> Upkeep:
        self._thread = threading.Thread(target=self._run, name="iotlake-upkeep", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop now: the running operation's Spark jobs are cancelled (a Delta commit is whole
        or absent, so nothing is left half done; the next pass does it again)."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            if self._sc is not None:  # never start a session just to stop
                self._sc.cancelJobGroup(JOB_GROUP)
            self._thread.join(timeout)

    def _run(self) -> None:
        sc = self._sc = session(self.settings).sparkContext
        sc.setLocalProperty("spark.scheduler.pool", "maintenance")  # this thread's jobs only
        sc.setJobGroup(JOB_GROUP, "iotlake run's table upkeep")
        while not self._stop.wait(self.settings.maintenance.check_seconds):
            try:
                done = self.tick()
                if any(done.values()):
                    log.info("upkeep: %s", done)
            except Exception as e:  # noqa: BLE001 - upkeep must never stop the pipeline
                if self._stop.is_set():
                    return
                log.warning("upkeep pass failed (retried in %.0f s): %s",
                            self.settings.maintenance.check_seconds, error_line(e))
