"""The health of ``iotlake run``, taken inside it once a second: one snapshot for every reader.

``StatusWriter.tick`` (from ``run``'s loop) judges what the process runs: each Spark query
(active, its last progress and batch, input rate, lag), the MQTT -> Kafka bridge, the brokers
(a TCP connect), the free disk under the data root, and lists what is wrong in ``problems``.
The snapshot goes to ``<run_dir>/status.json`` (``lakehouse.monitoring.status_file``: ``iotlake status``
and the dashboard's ``/healthz`` read it there) and stays in ``latest`` for the alert engine.

A query is stale when it is not active, had no progress event for ``stale_seconds`` (the
``pipeline_stale`` alert rule's, else 60 s), or has data waiting (lag > 0) and ran no batch for
as long. An idle query runs no batch, but Spark still reports its progress every
``spark.sql.streaming.noDataProgressEventInterval`` (10 s): an idle pipeline is healthy.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lakehouse.monitoring.metrics import lag_of
from lakehouse.monitoring.status_file import iso_time, status_path, write_status
from lakehouse.settings import Settings
from orchestration.upkeep import error_line, free_disk_bytes

log = logging.getLogger(__name__)

DEFAULT_STALE_SECONDS = 60.0
#: A broker is up when a TCP connect to it succeeds within this.
PROBE_TIMEOUT = 0.5
NO_ALERTS: dict[str, Any] = {"open": 0, "firing": []}
#: Roles whose process talks to MQTT / to Kafka.
MQTT_ROLES = ("all", "bridge")
KAFKA_ROLES = ("all", "bridge", "streams", "bronze")


def stale_seconds(settings: Settings) -> float:
    rule = next((r for r in settings.alerts.rules if r.kind == "pipeline_stale"), None)
    return rule.stale_seconds if rule is not None else DEFAULT_STALE_SECONDS


def max_lag(settings: Settings) -> int | None:
    """The ``pipeline_lag`` rule's bound on a Kafka-sourced query's lag, if there is one."""
    rule = next((r for r in settings.alerts.rules if r.kind == "pipeline_lag"), None)
    return rule.max_lag if rule is not None else None


@dataclass
class Memory:
    """What one look cannot tell: when each query (by id) was first seen and ran its last batch,
    when the bridge last delivered and was last connected. Wall-clock seconds."""

    first_seen: dict[str, float] = field(default_factory=dict)
    batches: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # id, time, rows
    looked_back: dict[str, int] = field(default_factory=dict)  # at which idle batch id
    bridge_seen: float | None = None
    confirmed: int = -1
    confirmed_at: float | None = None
    connected_at: float | None = None


def _num(x: Any, digits: int = 1) -> float | None:
    """A finite float for JSON (Spark reports NaN rates for empty intervals), else None."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return round(v, digits) if math.isfinite(v) else None


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 1)


def _source_kind(source: dict) -> str | None:
    desc = source.get("description") or ""
    return "delta" if desc.startswith("DeltaSource") else "kafka" if desc.startswith("Kafka") else None


def _time(p: dict) -> float | None:
    t = p.get("timestamp")
    return datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() if t else None


def _ran(p: dict) -> bool:
    """A progress event of a batch that ran; an idle one (no batch) carries the next batch's id
    and no ``addBatch`` duration."""
    return "addBatch" in (p.get("durationMs") or {})


def query_facts(q, memory: Memory, now: float) -> dict[str, Any]:
    """One query's facts from its ``lastProgress`` and ``status`` (a few py4j calls)."""
    qid = str(q.id)
    memory.first_seen.setdefault(qid, now)
    active = q.isActive
    error = None
    if not active:
        e = q.exception()
        error = error_line(e) if e is not None else None
    p = q.lastProgress or {}
    st = q.status or {}
    progress_at = _time(p)
    if progress_at is not None:
        seen = memory.batches.get(qid, (None,))[0]
        if _ran(p):
            if seen != p["batchId"]:
                memory.batches[qid] = (int(p["batchId"]), progress_at, int(p.get("numInputRows") or 0))
        elif seen != p["batchId"] - 1 and memory.looked_back.get(qid) != p["batchId"]:
            # idle since a batch this process did not see (it ran between two looks, before
            # the first): Spark's last 100 progress events have it
            memory.looked_back[qid] = p["batchId"]
            ran = next((r for r in reversed(q.recentProgress) if _ran(r)), None)
            if ran is not None:
                memory.batches[qid] = (int(ran["batchId"]), _time(ran), int(ran.get("numInputRows") or 0))
    sources = p.get("sources") or []
    lags = [(lag_of(s), _source_kind(s)) for s in sources]
    lag, kind = next(((x, k) for x, k in lags if x is not None),
                     (None, _source_kind(sources[0]) if sources else None))
    batch = memory.batches.get(qid)
    return {
        "id": qid, "active": active, "in_batch": bool(st.get("isTriggerActive")),
        "last_progress_age_s": _age(now, progress_at),
        "last_batch_id": batch[0] if batch else None,
        "last_batch_rows": batch[2] if batch else None,
        "last_batch_age_s": _age(now, batch[1] if batch else None),
        "input_rows_per_s": _num(p.get("inputRowsPerSecond")),
        "processed_rows_per_s": _num(p.get("processedRowsPerSecond")),
        "lag": lag, "source": kind,
        "watched_s": _age(now, memory.first_seen[qid]),
        "error": error,
    }


def query_problems(name: str, f: dict[str, Any], stale: float, lag_bound: int | None) -> list[str]:
    """What is wrong with one query; sets ``f["stale"]``. Before its first progress (or batch)
    the time since it was first seen counts."""
    out: list[str] = []
    if not f["active"]:
        out.append(f"query {name} stopped" + (f": {f['error']}" if f["error"] else ""))
    else:
        progress = f["last_progress_age_s"] if f["last_progress_age_s"] is not None else f["watched_s"]
        batch = f["last_batch_age_s"] if f["last_batch_age_s"] is not None else f["watched_s"]
        unit = "table versions" if f["source"] == "delta" else "records"
        if progress > stale:
            out.append(f"query {name}: no progress for {progress:.0f} s (stale after {stale:g} s)")
        elif f["lag"] and batch > stale:
            out.append(f"query {name}: {f['lag']} {unit} waiting and no batch for {batch:.0f} s "
                       f"(stale after {stale:g} s)")
    f["stale"] = bool(out)
    if lag_bound is not None and f["source"] == "kafka" and (f["lag"] or 0) > lag_bound:
        out.append(f"query {name}: {f['lag']} records behind Kafka (pipeline_lag above {lag_bound})")
    return out


def bridge_facts(bridge, memory: Memory, now: float, stall: float) -> dict[str, Any]:
    """The bridge's counters and thread; delivering = it confirmed a delivery within ``stall``
    seconds or has nothing waiting."""
    st = bridge.stats
    if memory.bridge_seen is None:
        memory.bridge_seen = now
    confirmed = st["delivered"] + st["dead_lettered"]
    if confirmed != memory.confirmed:
        if memory.confirmed >= 0 or confirmed > 0:
            memory.confirmed_at = now
        memory.confirmed = confirmed
    connected = bool(st["connected"])
    if connected or memory.connected_at is None:
        memory.connected_at = now
    running = bridge.thread.is_alive()
    since = now - (memory.confirmed_at or memory.bridge_seen)
    p99 = bridge.latency.quantile(0.99)
    failure = getattr(bridge, "failure", None)
    return {
        "id": bridge.bridge_id, "running": running,
        "delivering": running and (st["in_flight"] == 0 or since < stall),
        "connected": connected, "disconnected_s": 0.0 if connected else _age(now, memory.connected_at),
        "last_delivery_age_s": _age(now, memory.confirmed_at),
        "received": st["received"], "delivered": st["delivered"],
        "dead_lettered": st["dead_lettered"], "failed": st["failed"], "pending": st["in_flight"],
        "reconnects": st["reconnects"],
        "latency_p99_s": _num(p99, 3),  # since the bridge started; bucket resolution
        "error": repr(failure) if failure is not None else None,
    }


def bridge_problems(f: dict[str, Any], stall: float, mqtt: str) -> list[str]:
    name = f"bridge {f['id']}"
    if not f["running"]:
        return [f"{name} stopped" + (f": {f['error']}" if f["error"] else "")]
    out = []
    if not f["delivering"]:
        waited = f["last_delivery_age_s"]
        out.append(f"{name}: {f['pending']} messages waiting, nothing delivered to Kafka "
                   f"{'yet' if waited is None else f'for {waited:.0f} s'} "
                   f"(bridge.delivery_stall_seconds = {stall:g})")
    if f["disconnected_s"] and f["disconnected_s"] > stall:
        out.append(f"{name}: not connected to MQTT {mqtt} for {f['disconnected_s']:.0f} s")
    return out


def _endpoints(bootstrap: str) -> list[tuple[str, int]]:
    """``host:port`` pairs of a Kafka bootstrap list (``PROTO://`` prefixes, ``[v6]`` hosts)."""
    out = []
    for entry in bootstrap.split(","):
        entry = entry.strip().rsplit("://", 1)[-1]
        host, sep, port = entry.rpartition(":")
        if sep and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    return out


def reachable(endpoints: list[tuple[str, int]], timeout: float = PROBE_TIMEOUT) -> bool:
    """Any of the endpoints accepts a TCP connection."""
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            continue
    return False


def broker_facts(settings: Settings, role: str) -> dict[str, dict[str, Any]]:
    """The brokers this role uses; embedded = this process started them (role ``all``)."""
    out: dict[str, dict[str, Any]] = {}
    if role in MQTT_ROLES:
        host, port = settings.mqtt_endpoint
        out["mqtt"] = {"endpoint": f"{host}:{port}", "up": reachable([(host, port)]),
                       "embedded": role == "all" and not settings.mqtt.host}
    if role in KAFKA_ROLES:
        bootstrap = settings.kafka_bootstrap
        out["kafka"] = {"endpoint": bootstrap, "up": reachable(_endpoints(bootstrap)),
                        "embedded": role == "all" and not settings.kafka.bootstrap}
    return out


def disk_facts(settings: Settings) -> dict[str, Any]:
    floor = settings.maintenance.min_free_disk_gb
    free = free_disk_bytes(settings)
    return {"path": str(settings.root), "free_gb": round(free / 2**30, 2), "min_free_gb": floor,
            "ok": free >= floor * 2**30}


def snapshot(settings: Settings, role: str = "all", queries: dict | None = None, bridge=None,
             alerts: Callable[[], dict] | None = None, memory: Memory | None = None,
             now: datetime | None = None, stopping: str | None = None) -> dict[str, Any]:
    """The process's health now. ``queries``: name -> StreamingQuery (``Running.queries``);
    ``bridge``: the in-process ``Bridge`` (its ``thread``); ``alerts``: the alert engine's
    ``{"open": n, "firing": [...]}``; ``memory``: kept between calls (``StatusWriter`` does);
    ``stopping``: the process is shutting down, and why."""
    now_dt = now or datetime.now(UTC)
    t = now_dt.timestamp()
    memory = memory if memory is not None else Memory()
    stale, lag_bound = stale_seconds(settings), max_lag(settings)
    stall = settings.bridge.delivery_stall_seconds
    problems = [f"stopping: {stopping}"] if stopping else []
    qs: dict[str, dict[str, Any]] = {}
    for key, q in list((queries or {}).items()):
        name = q.name or key
        qs[name] = query_facts(q, memory, t)
        problems += query_problems(name, qs[name], stale, lag_bound)
    b = None
    if bridge is not None:
        b = bridge_facts(bridge, memory, t, stall)
        host, port = settings.mqtt_endpoint
        problems += bridge_problems(b, stall, f"{host}:{port}")
    brokers = broker_facts(settings, role)
    for kind, f in brokers.items():
        if not f["up"]:
            problems.append(f"{'MQTT broker' if kind == 'mqtt' else 'Kafka'} {f['endpoint']} "
                            f"unreachable{' (embedded)' if f['embedded'] else ''}")
    disk = disk_facts(settings)
    if not disk["ok"]:
        problems.append(f"only {disk['free_gb']:.2f} GB free under {disk['path']} "
                        f"(maintenance.min_free_disk_gb = {disk['min_free_gb']:g})")
    return {
        "time": iso_time(now_dt), "pid": os.getpid(), "role": role, "running": True,
        "healthy": not problems, "problems": problems,
        "limits": {"stale_seconds": stale, "delivery_stall_seconds": stall, "max_lag": lag_bound},
        "queries": qs, "bridge": b, "brokers": brokers, "disk": disk,
        "alerts": _alerts(alerts),
    }


def _alerts(alerts: Callable[[], dict] | None) -> dict[str, Any]:
    if alerts is None:
        return dict(NO_ALERTS)
    try:
        return {**NO_ALERTS, **alerts()}
    except Exception as e:  # noqa: BLE001 - the status must not fail with the alert engine
        return {**NO_ALERTS, "error": error_line(e)}


class StatusWriter:
    """``tick()`` once a second: a snapshot into ``latest`` and, atomically, ``path``. As a
    context manager it ticks at entry, and at exit writes a last snapshot that says the process
    is stopping (and why)."""

    def __init__(self, settings: Settings, role: str = "all", running=None, bridge=None,
                 alerts: Callable[[], dict] | None = None) -> None:
        self.settings, self.role, self.running, self.bridge = settings, role, running, bridge
        #: the alert engine's summary, ``{"open": n, "firing": [...]}`` (None: no engine)
        self.alerts = alerts
        self.path = status_path(settings, role)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.memory = Memory()
        self.latest: dict[str, Any] | None = None
        self._failed: str | None = None

    def tick(self, now: datetime | None = None, stopping: str | None = None) -> dict[str, Any]:
        """Take, keep and write the snapshot; never raises (a status must not stop the run)."""
        began = time.monotonic()
        try:
            queries = self.running.queries if self.running is not None else None
            snap = snapshot(self.settings, self.role, queries, self.bridge, self.alerts,
                            self.memory, now, stopping)
            self._failed = None
        except Exception as e:  # noqa: BLE001
            why = error_line(e)
            if why != self._failed:
                log.warning("status: could not take a snapshot: %s", why, exc_info=True)
            self._failed = why
            snap = {"time": iso_time(now or datetime.now(UTC)), "pid": os.getpid(),
                    "role": self.role, "running": True, "healthy": False,
                    "problems": [f"status: could not take a snapshot: {why}"], "queries": {},
                    "bridge": None, "brokers": {}, "disk": None, "alerts": dict(NO_ALERTS)}
        snap["took_s"] = round(time.monotonic() - began, 3)
        self.latest = snap
        try:
            write_status(self.path, snap)
        except OSError as e:
            log.warning("status: could not write %s: %s", self.path, e)
        return snap

    def __enter__(self) -> StatusWriter:
        self.tick()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        why = error_line(exc) if exc is not None and not isinstance(exc, KeyboardInterrupt) \
            else "shutdown requested"
        self.tick(stopping=why)
