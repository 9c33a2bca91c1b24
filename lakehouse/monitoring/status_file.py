"""The status file ``iotlake run`` writes every second, and the one way to read and judge it.

``orchestration.status`` builds the snapshot inside the running process; ``iotlake status`` and
the dashboard's ``/healthz`` (a separate process) read it here, so both say the same thing.
A file older than ``max_age`` means the process is gone (or hung): not running, unhealthy.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lakehouse.settings import Settings

#: Seconds after which a status file is taken for a process that no longer runs.
DEFAULT_MAX_AGE = 10.0


def status_path(settings: Settings, role: str = "all") -> Path:
    """``<run_dir>/status.json`` for ``iotlake run``; ``status-<role>.json`` for ``--role ROLE``
    (role processes may share a data root)."""
    if not re.fullmatch(r"[a-z]+", role):
        raise ValueError(f"role {role!r} must be lower-case letters (e.g. all, bridge, streams)")
    return settings.run_dir / ("status.json" if role == "all" else f"status-{role}.json")


def iso_time(t: datetime) -> str:
    """UTC with milliseconds and a ``Z``: ``2026-12-02T12:00:00.000Z``."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def write_status(path: Path, snapshot: dict[str, Any]) -> None:
    """Replace the file atomically: a reader sees the last snapshot or the one before, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(snapshot, allow_nan=False))
    os.replace(tmp, path)


def not_running(role: str, problem: str, last: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of a process that is not there: no facts, one problem."""
    out: dict[str, Any] = {"time": None, "pid": None, "role": role, "running": False,
                           "healthy": False, "problems": [problem], "queries": {}, "bridge": None,
                           "brokers": {}, "disk": None, "alerts": {"open": 0, "firing": []}}
    if last is not None:
        out["last_status"] = last
    return out


def read_status(settings: Settings, max_age: float = DEFAULT_MAX_AGE, role: str = "all",
                now: datetime | None = None) -> dict[str, Any]:
    """The running process's last snapshot with ``age_s`` and ``running``; when the file is
    missing, unreadable or older than ``max_age`` seconds, an unhealthy "not running" one (the
    old snapshot under ``last_status``)."""
    path = status_path(settings, role)
    try:
        snap = json.loads(path.read_text())
        written = datetime.fromisoformat(snap["time"].replace("Z", "+00:00"))
    except FileNotFoundError:
        return not_running(role, f"not running: no status file {path} (start `iotlake run`"
                                 f"{'' if role == 'all' else f' --role {role}'})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return not_running(role, f"not running: unreadable status file {path} ({e})")
    age = round(((now or datetime.now(UTC)) - written).total_seconds(), 1)
    if age > max_age:
        return not_running(role, f"not running: the status in {path} is {age:.0f} s old (pid "
                                 f"{snap.get('pid')}, written {snap['time']}; fresh within "
                                 f"{max_age:g} s)", last=snap)
    return {**snap, "running": True, "age_s": max(age, 0.0)}
