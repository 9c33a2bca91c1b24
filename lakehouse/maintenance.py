"""Table maintenance with delta-rs: compaction, vacuum, restore, history.

Streaming sinks commit a few small files per micro-batch, and scan time grows with file count, so
``compact`` bin-packs them (and Z-orders tables queried by device and time). Compaction commits
carry ``dataChange=false``: the Delta streaming source (``lakehouse.delta_source``) skips them, so
rewritten rows are never delivered twice. Every operation plans from the latest snapshot and does
nothing when there is nothing to do, so a retried task is harmless.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, TypeVar

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from lakehouse.delta_io import table_exists
from lakehouse.settings import Settings
from lakehouse.tables import SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Below this, vacuum can delete files that time travel, reprocessing or a lagging stream need.
MIN_RETENTION_HOURS = 168

#: Tables read by device over a time range: Z-ordering co-locates rows so file skipping works.
ZORDER_COLUMNS: dict[str, tuple[str, str]] = {
    "silver": ("device_id", "event_time"),
    "gold_metrics_1m": ("device_id", "window_start"),
    "gold_metrics_5m": ("device_id", "window_start"),
    "gold_metrics_1m_final": ("device_id", "window_start"),
    "gold_metrics_5m_final": ("device_id", "window_start"),
    "readings_scored": ("device_id", "event_time"),
    "anomalies": ("device_id", "event_time"),
}

#: Z-order rewrites the whole (unpartitioned) table, so it runs only when not-yet-compacted
#: small files hold at least this share of the bytes; otherwise plain bin-packing.
ZORDER_MIN_FRACTION = 0.1


def resolve_tables(settings: Settings, tables: Iterable[str] | None = None) -> list[str]:
    """Named tables (validated), or every known table that exists under ``settings``."""
    if not tables:
        return [t for t in SCHEMAS if table_exists(settings.table_path(t))]
    names = list(dict.fromkeys(tables))
    unknown = [t for t in names if t not in SCHEMAS]
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(map(repr, unknown))}; "
                         f"valid tables: {', '.join(SCHEMAS)}")
    return names


def _existing(settings: Settings, table: str) -> str:
    resolve_tables(settings, [table])
    path = settings.table_path(table)
    if not table_exists(path):
        raise ValueError(f"table {table!r} does not exist yet at {path}")
    return path


def _retry(op: Callable[[], T], what: str, attempts: int = 6) -> T:
    """Run ``op`` again on a commit conflict with a concurrent writer (jittered backoff)."""
    for attempt in range(attempts):
        try:
            return op()
        except CommitFailedError as e:
            if attempt == attempts - 1:
                raise
            delay = min(30.0, 0.5 * 2**attempt) * (0.5 + random.random())
            log.warning("%s: commit conflict (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _file_sizes(dt: DeltaTable) -> list[int]:
    return dt.get_add_actions(flatten=True).column("size_bytes").to_pylist()


def _compact_table(path: str, table: str, target_size: int, zorder: bool) -> dict[str, Any]:
    dt = DeltaTable(path)
    sizes, version_before = _file_sizes(dt), dt.version()
    cols = ZORDER_COLUMNS.get(table) if zorder else None
    if cols and not set(cols) <= set(dt.schema().to_arrow().names):
        cols = None
    small = [s for s in sizes if s < target_size // 2]
    if cols and len(small) > 1 and sum(small) >= ZORDER_MIN_FRACTION * sum(sizes):
        mode, metrics = "zorder", dt.optimize.z_order(cols, target_size=target_size)
    else:
        mode, metrics = "compact", dt.optimize.compact(target_size=target_size)
    after = DeltaTable(path)
    changed = after.version() != version_before and bool(metrics.get("numFilesRemoved"))
    return {"table": table, "mode": mode if changed else "noop", "files_before": len(sizes),
            "files_after": len(_file_sizes(after)), "files_removed": metrics.get("numFilesRemoved", 0),
            "files_added": metrics.get("numFilesAdded", 0), "version": after.version()}


def compact(settings: Settings, tables: list[str] | None = None, target_size: int | None = None,
            zorder: bool | None = None) -> list[dict[str, Any]]:
    """Bin-pack small files (Z-order where it pays) per table; returns per-table stats.

    ``target_size`` and ``zorder`` default to ``settings.maintenance``.
    """
    size = target_size or settings.maintenance.target_file_size
    use_z = settings.maintenance.zorder if zorder is None else zorder
    out = []
    for table in resolve_tables(settings, tables):
        path = settings.table_path(table)
        if not table_exists(path):
            out.append({"table": table, "mode": "missing"})
            continue
        stats = _retry(lambda p=path, t=table: _compact_table(p, t, size, use_z), f"compact {table}")
        log.info("compact %s: %s", table, stats)
        out.append(stats)
    return out


def effective_retention(settings: Settings, requested: int | None = None,
                        enforce_retention_duration: bool = True) -> int:
    """Requested retention, or the configured one; below 168 h only when not enforced."""
    hours = max(MIN_RETENTION_HOURS, settings.maintenance.vacuum_retention_hours) \
        if requested is None else requested
    if hours < 0:
        raise ValueError(f"retention must be >= 0 hours, got {hours}")
    if hours < MIN_RETENTION_HOURS and enforce_retention_duration:
        raise ValueError(
            f"retention {hours} h is below the {MIN_RETENTION_HOURS} h minimum: time travel, "
            "reprocessing and lagging streams could lose files. Use a larger value, or force "
            "it (--force) only when nothing reads older versions.")
    return hours


def vacuum(settings: Settings, tables: list[str] | None = None, retention_hours: int | None = None,
           dry_run: bool = False, enforce_retention_duration: bool = True) -> list[dict[str, Any]]:
    """Delete files no version within the retention references (incl. crash leftovers).

    Default retention: max(168 h, ``maintenance.vacuum_retention_hours``).
    """
    hours = effective_retention(settings, retention_hours, enforce_retention_duration)
    out = []
    for table in resolve_tables(settings, tables):
        path = settings.table_path(table)
        if not table_exists(path):
            out.append({"table": table, "deleted": [], "status": "missing"})
            continue
        # full=True also removes files of commits that never happened (crashed batches, failed
        # compactions); the retention keeps files of in-flight commits, which are seconds old.
        deleted = _retry(lambda p=path: DeltaTable(p).vacuum(
            retention_hours=hours, dry_run=dry_run, full=True,
            enforce_retention_duration=enforce_retention_duration), f"vacuum {table}")
        log.info("vacuum %s (%s h, dry_run=%s): %d files", table, hours, dry_run, len(deleted))
        out.append({"table": table, "retention_hours": hours, "dry_run": dry_run,
                    "deleted": sorted(deleted), "version": DeltaTable(path).version()})
    return out


def _load_at(path: str, table: str, target: int | datetime) -> DeltaTable:
    """The table at a version, or at the version current at a time (an error before creation;
    delta-rs would silently pick version 0)."""
    dt = DeltaTable(path)
    try:
        dt.load_as_version(target)
    except Exception as e:  # delta-rs raises several types for out-of-range targets
        raise ValueError(f"{table}: no version {target}: {e}") from e
    if isinstance(target, datetime):
        committed = datetime.fromtimestamp(dt.history(1)[0]["timestamp"] / 1000, UTC)
        if committed > target:
            raise ValueError(f"{table}: no version at {target.isoformat()}; the oldest "
                             f"readable version {dt.version()} is from {committed.isoformat()}")
    return dt


def parse_timestamp(value: str) -> datetime:
    """ISO 8601; a timestamp without zone is UTC."""
    try:
        ts = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"timestamp {value!r} is not ISO 8601 (e.g. 2024-05-01T12:00:00Z)") from None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def restore(settings: Settings, table: str, version: int | None = None,
            timestamp: str | None = None) -> dict[str, Any]:
    """Make the table's current state equal an older version (a new commit; history is kept).

    Restore is a data change: streams reading this table re-read the re-added files and do not
    see the removals, so reprocess downstream layers afterwards. A no-op when already equal.
    """
    if (version is None) == (timestamp is None):
        raise ValueError("restore needs exactly one of version or timestamp")
    path = _existing(settings, table)
    target: int | datetime = version if version is not None else parse_timestamp(timestamp or "")

    def run() -> dict[str, Any]:
        dt, old = DeltaTable(path), _load_at(path, table, target)
        if set(_paths(dt)) == set(_paths(old)) and dt.schema().to_json() == old.schema().to_json():
            return {"table": table, "restored_to": old.version(), "version": dt.version(),
                    "noop": True}
        try:
            metrics = dt.restore(old.version())
        except CommitFailedError:
            raise
        except DeltaError as e:
            if "missing file" not in str(e).lower():
                raise
            raise ValueError(f"{table}: version {old.version()} references files vacuum already "
                             f"deleted (older than the retention); pick a newer version") from e
        return {"table": table, "restored_to": old.version(), "version": DeltaTable(path).version(),
                "noop": False, **metrics}

    return _retry(run, f"restore {table}")


def _paths(dt: DeltaTable) -> list[str]:
    return dt.get_add_actions(flatten=True).column("path").to_pylist()


def version_at(settings: Settings, table: str, timestamp: datetime) -> int:
    """The table version current at ``timestamp``: pins a scheduled job to a reproducible state."""
    return _load_at(_existing(settings, table), table, timestamp).version()


def table_history(settings: Settings, table: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Commits, newest first (operation, parameters, metrics, timestamp, version)."""
    return DeltaTable(_existing(settings, table)).history(limit)
