"""The alert engine: conditions in, alert transitions and notifications out, once per incident.

Every ``alerts.evaluate_seconds`` (wall clock) a tick gathers what is true now
(``gold.alerts.rules``): devices offline or degraded in ``device_current``, sites not heard
from, the pipeline's own health, and the breaches of threshold and anomaly rules in the
readings the streams handed over since the last tick (``observe_readings`` from silver,
``observe_scores`` from gold health). A condition that held its rule's ``for_seconds`` opens an
alert (``firing``); an open alert whose condition no longer holds is ``resolved``. One alert
per (rule, subject) incident; a firing alert is notified again every ``renotify_seconds``
unless acknowledged; a silenced one is not notified (its resolution neither, if its firing was
not). A source that could not be read at a tick (no ``device_current`` yet, no status
snapshot) resolves nothing.

A tick's state, its transitions (``alerts_log``, for the Delta tables) and its notifications
(the outbox) commit in one SQLite transaction (``gold.alerts.store``): a restart neither
repeats a notification nor loses one. Readings older than ``alerts.max_age_seconds`` (event
time) never fire: a catch-up after an outage, a backfill or a replay is the past.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gold.alerts import store
from gold.alerts.notification import Notification
from gold.alerts.rules import (
    DEVICE_KINDS,
    PIPELINE_KINDS,
    READING_KINDS,
    Breach,
    Breaches,
    Condition,
    device_conditions,
    pipeline_conditions,
    site_conditions,
)
from lakehouse.delta.read import open_table, table_exists
from lakehouse.settings import Settings

log = logging.getLogger(__name__)


def fingerprint(rule: str, labels: dict[str, str]) -> str:
    """A stable id of (rule, subject labels), hex (as Alertmanager fingerprints label sets)."""
    text = json.dumps({"alertname": rule, **labels}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _iso(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


class DeviceTable:
    """``device_current`` as of its latest version, read with delta-rs only when it changed."""

    COLUMNS = ("device_id", "status", "status_reason", "last_received", "last_seen")

    def __init__(self, path: str, site_column: str) -> None:
        self.path, self.site_column = path, site_column
        self.table = None
        self.version = -1
        self.rows: list[dict] | None = None

    def read(self) -> list[dict] | None:
        """The rows (None while the table does not exist or cannot be read)."""
        try:
            if self.table is None:
                if not table_exists(self.path):
                    return None
                self.table = open_table(self.path)
            else:
                self.table.update_incremental()
            v = self.table.version()
            if v != self.version or self.rows is None:
                names = {f.name for f in self.table.schema().fields}
                cols = [c for c in (*self.COLUMNS, self.site_column) if c in names]
                t = self.table.to_pyarrow_table(columns=cols)
                if self.site_column in cols and self.site_column != "site":
                    t = t.rename_columns([("site" if c == self.site_column else c) for c in t.column_names])
                self.rows, self.version = t.to_pylist(), v
        except Exception as e:  # noqa: BLE001 - a table being compacted or vacuumed: next tick
            log.warning("alerts: cannot read %s now (%s)", self.path, e)
            self.table = None
            return None
        return self.rows


class AlertEngine:
    """Conditions to alerts (see the module docstring). ``outbox`` delivers notifications
    (``gold.alerts.outbox.Outbox``); ``pipeline`` returns the run's latest status snapshot."""

    def __init__(self, settings: Settings, outbox=None, pipeline: Callable[[], dict | None] | None = None,
                 db: Path | None = None) -> None:
        self.settings, self.cfg = settings, settings.alerts
        self.rules = list(self.cfg.rules)
        sites = settings.telemetry.topic_columns
        # a site rule waits for a model whose topics name sites
        if self.cfg.site_column not in sites and any(r.kind == "site_silent" for r in self.rules):
            log.info("alerts: site rules inactive: telemetry.topic_pattern names no {%s} "
                     "(alerts.site_column)", self.cfg.site_column)
            self.rules = [r for r in self.rules if r.kind != "site_silent"]
        self.site_column = self.cfg.site_column
        self.outbox, self.pipeline = outbox, pipeline
        self.conn = store.connect(db or store.db_path(settings))
        if outbox is not None:
            outbox.init(self.conn)
        with store.transaction(self.conn):
            if store.meta(self.conn, "engine_id") is None:
                store.set_meta(self.conn, "engine_id", uuid.uuid4().hex)
        self.engine_id = store.meta(self.conn, "engine_id")
        self.open = store.open_alerts(self.conn)
        self.pending = dict(self.conn.execute("SELECT key, since FROM alert_pending"))
        self.breaches = Breaches(self.rules, self.site_column)
        for key, since, last, value in self.conn.execute("SELECT key, since, last, value FROM alert_breach"):
            name, subject = key.split("|", 1)
            dev, _, metric = subject.partition("|")
            rule = next((r for r in self.rules if r.name == name), None)
            if rule is not None:
                self.breaches.state[key] = Breach(since, last, value, dev, metric or rule.metric)
        self.devices = DeviceTable(settings.table_path("device_current"), self.site_column)
        self.heard: dict[str, float] = {}  # site -> latest reception of any of its devices
        self.frontier: float | None = None  # the latest reception any silver batch carried
        self.last_batch_at: float | None = None  # wall time of the last silver batch with rows
        self.inbox: deque[tuple[str, pa.Table]] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when a tick wrote rows for the Delta tables
        self.arrived = threading.Event()  # set when a stream handed over a batch: tick now
        self.ticks = 0

    # -- what the streams hand over (any thread) -------------------------------------------

    def observe_readings(self, table: pa.Table) -> None:
        """Silver's rows of a batch (any columns of silver's schema)."""
        self.inbox.append(("readings", table))
        self.arrived.set()

    def observe_scores(self, table: pa.Table) -> None:
        """Gold health's scored readings of a batch (``readings_scored``'s columns)."""
        self.inbox.append(("scores", table))
        self.arrived.set()

    # -- a tick -------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> list[dict]:
        """Evaluate once; returns the transitions it committed (rows of the ``alerts`` table)."""
        now = time.time() if now is None else now
        with self.lock:
            return self._tick(now)

    def _tick(self, now: float) -> list[dict]:
        oldest = now - self.cfg.max_age_seconds
        while self.inbox:
            kind, t = self.inbox.popleft()
            if kind == "readings":
                self.breaches.readings(t, oldest)
                self._hear(t, now)
            else:
                self.breaches.scores(t, oldest)
        evaluated: set[str] = set(READING_KINDS)
        # subjects judged at this tick, per kind: an open alert of a subject not seen now (a
        # device_current read between rewrites, a site not yet heard since a restart) stays open
        known: dict[str, set[str]] = {}
        conds: list[Condition] = self.breaches.active()
        devices = self.devices.read() if any(r.kind in DEVICE_KINDS or r.kind == "site_silent"
                                             for r in self.rules) else None
        if devices is not None:
            evaluated |= DEVICE_KINDS
            ids = {d["device_id"] for d in devices}
            known.update({k: ids for k in DEVICE_KINDS})
            conds += device_conditions([r for r in self.rules if r.kind in DEVICE_KINDS], devices)
            for d in devices:
                t = d.get("last_received") or d.get("last_seen")
                site = d.get("site")
                if site and t is not None:
                    self.heard[site] = max(self.heard.get(site, 0.0), t.timestamp())
        snap = self.pipeline() if self.pipeline is not None else None
        # a batch under way, or records waiting in Kafka: what is heard is late, not silent
        busy = any(q.get("source") == "kafka" and (q.get("in_batch") or (q.get("lag") or 0) > 0)
                   for q in ((snap or {}).get("queries") or {}).values())
        if self.heard:
            evaluated.add("site_silent")
            known["site_silent"] = set(self.heard)
            conds += site_conditions(self.rules, self.heard, now, self.settings.gold.offline_after_seconds,
                                     self.frontier, self.last_batch_at, busy)
        if snap is not None:
            evaluated |= PIPELINE_KINDS
            conds += pipeline_conditions(self.rules, snap)

        # wall-clock kinds wait out for_seconds here; reading kinds did in event time
        active: dict[str, Condition] = {}
        pending_now: dict[str, float] = {}
        for c in conds:
            if c.rule.kind in READING_KINDS:
                active[c.key] = c
                continue
            since = self.pending.get(c.key, now)
            pending_now[c.key] = since
            if now - since >= c.rule.for_seconds:
                active[c.key] = c
        # a pending condition of a kind not evaluated now keeps waiting
        for k, since in self.pending.items():
            if k not in pending_now and self._kind_of(k) not in evaluated:
                pending_now[k] = since

        rows: list[dict] = []
        notes: list[Notification] = []
        changed: dict[str, store.Alert | None] = {}
        silences = store.silences(self.conn, now)
        by_key = {a.extra.get("key"): a for a in self.open.values()}
        for key, c in active.items():
            if key not in by_key:
                a = self._open(c, now)
                by_key[key] = a
                changed[a.fingerprint] = a
                rows.append(self._row(a, "firing", now))
            else:
                a = by_key[key]
                if c.value is not None and c.value != a.value:
                    a.value = c.value  # shown in alerts_current; not a transition
        for c in self.breaches.take_episodes():  # held and ended within one batch
            a = by_key.pop(c.key, None)
            if a is None:  # fired and resolved since the last tick
                a = self._open(c, now)
                rows.append(self._row(a, "firing", now))
                self._notify(a, silences, now, notes)
            a.value = c.value
            self.open.pop(a.fingerprint, None)
            changed[a.fingerprint] = None
            rows.append(self._row(a, "resolved", now))
            notes += self._resolution(a, now)
        for a in list(self.open.values()):
            key = a.extra.get("key")
            judged = a.kind in evaluated and (a.kind not in known or a.subject in known[a.kind])
            if key not in active and judged and a.fingerprint not in changed:
                del self.open[a.fingerprint]
                changed[a.fingerprint] = None
                rows.append(self._row(a, "resolved", now))
                notes += self._resolution(a, now)
        for a in self.open.values():
            if self._notify(a, silences, now, notes):
                changed.setdefault(a.fingerprint, a)
        acks = store.pending_acks(self.conn)
        for alert_id, by in acks:
            a = next((x for x in self.open.values() if x.alert_id == alert_id), None)
            if a is not None and not a.acknowledged:
                a.acknowledged = True
                a.extra["acknowledged_by"] = by
                changed.setdefault(a.fingerprint, a)
                rows.append(self._row(a, "acknowledged", now))
        breach_changes = {k: self.breaches.state.get(k) for k in self.breaches.changed}
        self.breaches.changed.clear()
        if not (rows or notes or changed or breach_changes or pending_now != self.pending or acks):
            self.ticks += 1
            return []
        with store.transaction(self.conn) as conn:
            for fp, a in changed.items():
                if a is None:
                    conn.execute("DELETE FROM alert_open WHERE fingerprint = ?", (fp,))
                else:
                    conn.execute("INSERT INTO alert_open VALUES (?, ?) ON CONFLICT(fingerprint) "
                                 "DO UPDATE SET body = excluded.body", (fp, a.to_json()))
            conn.execute("DELETE FROM alert_pending")
            conn.executemany("INSERT INTO alert_pending VALUES (?, ?)", pending_now.items())
            for k, b in breach_changes.items():
                if b is None:
                    conn.execute("DELETE FROM alert_breach WHERE key = ?", (k,))
                else:
                    conn.execute("INSERT INTO alert_breach VALUES (?, ?, ?, ?) ON CONFLICT(key) DO UPDATE "
                                 "SET since = excluded.since, last = excluded.last, value = excluded.value",
                                 (k, b.since, b.last, b.value))
            conn.execute("UPDATE alert_acks SET applied = 1 WHERE applied = 0")
            if rows or changed:
                seq = store.next_id(conn, "log_seq")
                current = [self._current(a, now) for a in self.open.values()]
                conn.execute("INSERT INTO alerts_log VALUES (?, ?, ?)",
                             (seq, json.dumps(rows, default=str), json.dumps(current, default=str)))
            if notes and self.outbox is not None:
                self.outbox.enqueue(conn, notes)
        self.pending = pending_now
        self.ticks += 1
        if rows or changed:
            self.wake.set()
        if notes and self.outbox is not None:
            self.outbox.kick()
        for r in rows:
            log.info("alert %s %s: %s", r["alert_id"], r["transition"], r["summary"])
        return rows

    def _kind_of(self, key: str) -> str | None:
        name = key.split("|", 1)[0]
        return next((r.kind for r in self.rules if r.name == name), None)

    def _hear(self, t: pa.Table, now: float) -> None:
        if "ingest_time" not in t.column_names or not t.num_rows:
            return
        latest = pc.max(pc.cast(t.column("ingest_time"), pa.int64())).as_py()  # epoch µs
        if latest is not None:
            self.frontier = max(self.frontier or 0.0, latest / 1e6)
            self.last_batch_at = now
        if self.site_column not in t.column_names:
            return
        g = t.group_by(self.site_column).aggregate([("ingest_time", "max")])
        for site, last in zip(g.column(self.site_column).to_pylist(),
                              pc.cast(g.column("ingest_time_max"), pa.int64()).to_pylist(), strict=True):
            if site is not None and last is not None:
                self.heard[site] = max(self.heard.get(site, 0.0), last / 1e6)

    def _open(self, c: Condition, now: float) -> store.Alert:
        labels = {**c.labels, **c.rule.labels}
        fp = fingerprint(c.rule.name, c.labels)
        alert_id = store.next_id(self.conn, "alert_id")  # committed alone: an id is never reused
        a = store.Alert(alert_id=alert_id, fingerprint=fp, rule=c.rule.name, kind=c.rule.kind,
                        severity=c.rule.severity, subject=c.subject, labels=labels, summary=c.summary,
                        starts_at=now, value=c.value, device_id=c.device_id, site=c.site,
                        extra={"key": c.key})
        self.open[fp] = a
        return a

    def _notify(self, a: store.Alert, silences: list[store.Silence], now: float,
                notes: list[Notification]) -> bool:
        """Notify ``a`` if due (first firing, or re-notification) and not silenced; whether
        the alert's state changed (to be saved)."""
        silenced = any(s.matches(a, now) for s in silences)
        changed = silenced != a.silenced
        a.silenced = silenced
        if silenced:
            return changed
        due = not a.notified or (self.cfg.renotify_seconds > 0 and not a.acknowledged
                                 and now - a.last_notified >= self.cfg.renotify_seconds)
        if due:
            a.notifications += 1
            a.notified, a.last_notified = True, now
            notes.append(self._note(a, "firing", None, a.notifications))
        return changed or due

    def _resolution(self, a: store.Alert, now: float) -> list[Notification]:
        return [self._note(a, "resolved", now, a.notifications)] if a.notified else []

    def _note(self, a: store.Alert, status: str, ends: float | None, n: int) -> Notification:
        labels = {"alertname": a.rule, "severity": a.severity, **a.labels}
        annotations = {"summary": a.summary, "alert_id": str(a.alert_id), "kind": a.kind,
                       **({"value": f"{a.value:g}"} if a.value is not None else {})}
        return Notification(key=f"{a.fingerprint}:{status}:{a.alert_id}:{n}", fingerprint=a.fingerprint,
                            status=status, labels=labels, annotations=annotations,
                            starts_at=_iso(a.starts_at), ends_at=_iso(ends))

    def _row(self, a: store.Alert, transition: str, now: float) -> dict:
        return {"alert_id": a.alert_id, "fingerprint": a.fingerprint, "rule": a.rule, "kind": a.kind,
                "severity": a.severity, "subject": a.subject, "device_id": a.device_id, "site": a.site,
                "status": "resolved" if transition == "resolved" else "firing",
                "transition": transition, "changed_at": now, "starts_at": a.starts_at,
                "ends_at": now if transition == "resolved" else None, "value": a.value,
                "summary": a.summary, "labels": json.dumps({"alertname": a.rule, "severity": a.severity,
                                                            **a.labels}, sort_keys=True)}

    def _current(self, a: store.Alert, now: float) -> dict:
        row = self._row(a, "firing", now)
        row.pop("transition"), row.pop("changed_at")
        return {**row, "acknowledged": a.acknowledged, "silenced": a.silenced, "updated_at": now}

    # -- the running loop -----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick every ``alerts.evaluate_seconds``, and at once when a stream hands over a
        batch (a breach does not wait for the clock), until ``stop``; a failing tick is logged
        and retried at the next one (its changes did not commit)."""
        while not stop.is_set():
            self.arrived.clear()
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep evaluating; the log says what failed
                log.exception("alerts: tick failed")
            self.arrived.wait(self.cfg.evaluate_seconds)

    def summary(self) -> dict:
        """Open alerts for the status snapshot: ``{"open": n, "firing": [...]}``."""
        alerts = sorted(self.open.values(), key=lambda a: a.alert_id)
        return {"open": len(alerts), "firing": [
            {"alert_id": a.alert_id, "rule": a.rule, "severity": a.severity, "subject": a.subject,
             "summary": a.summary, "since": _iso(a.starts_at).isoformat(), "acknowledged": a.acknowledged,
             "silenced": a.silenced} for a in alerts]}

    def close(self) -> None:
        self.conn.close()
