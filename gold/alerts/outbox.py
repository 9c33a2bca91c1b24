"""The outbox: notifications committed with the engine's state, delivered at least once.

``enqueue`` writes one row per (notification, channel) inside the caller's SQLite transaction,
so an alert's state change and its notifications commit together or not at all. A thread of
the outbox's own (``start``; ``deliver_due`` runs one pass) sends due rows oldest first and
marks them delivered; a failure backs the row off (``alerts.retry_seconds`` doubling up to
``retry_max_seconds``) and, unless the receiver answered with a refusal (4xx), holds back the
channel's later rows as long (also after a restart: it is the row's state), so a receiver that
is down gets one attempt per back-off and everything in order once it is back. A refused row
holds back only the later notifications of its alert: a resolution never overtakes its firing. After ``alerts.max_attempts`` failed attempts a row is
kept as ``failed`` (counted, logged once; ``retry_failed`` sends it again). Rows survive a
restart: a new ``Outbox`` on the file picks up what was pending.

Alertmanager forgets an alert whose ``endsAt`` passed: the outbox keeps each alert's last
firing notification for the channels with ``resend_seconds`` (``outbox_firing``) and posts
them again that often, until the alert's resolution is enqueued. That also gives a restarted
Alertmanager, which keeps no alerts on disk, the alerts that still fire.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import Counter, Gauge

from gold.alerts.channels import Channel, Rejected
from gold.alerts.notification import Notification
from lakehouse.settings import AlertsSettings

log = logging.getLogger(__name__)

NOTIFICATIONS = Counter(
    "iotlake_alert_notifications",
    "alert notifications by channel and outcome: delivered; retried (an attempt failed, tried "
    "again later); failed (gave up after alerts.max_attempts, kept in the outbox); resent "
    "(firing alerts posted to Alertmanager again)", ["channel", "status"])
OUTBOX_ROWS = Gauge("iotlake_alert_outbox_notifications",
                    "notifications in the outbox by channel and state (pending, delivered, failed)",
                    ["channel", "state"])

STATES = ("pending", "delivered", "failed")
#: Delivered rows are kept this long (the receivers' history, ``counts``), then deleted.
KEEP_DELIVERED_SECONDS = 7 * 86_400
#: Rows one pass reads per channel; a pass that delivered some starts the next one at once.
PASS_ROWS = 500
#: Alerts per re-post to Alertmanager.
RESEND_BATCH = 500
#: The thread looks for due rows at least this often (another process may have changed some).
POLL_SECONDS = 5.0

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS outbox_queue (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        channel TEXT NOT NULL,
        key TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        status TEXT NOT NULL,
        body TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_at REAL NOT NULL,
        refused INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        done_at REAL,
        last_error TEXT,
        UNIQUE (channel, key))""",
    "CREATE INDEX IF NOT EXISTS outbox_queue_state ON outbox_queue (state, channel, id)",
    """CREATE TABLE IF NOT EXISTS outbox_firing (
        channel TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        body TEXT NOT NULL,
        next_at REAL NOT NULL,
        PRIMARY KEY (channel, fingerprint))""",
)


def init(conn: sqlite3.Connection) -> None:
    """Create the outbox's tables (statement by statement: ``executescript`` would commit the
    caller's open transaction)."""
    for stmt in _SCHEMA:
        conn.execute(stmt)


class Outbox:
    """Durable delivery of notifications to ``channels`` (see the module docstring)."""

    def __init__(self, path: str | Path, channels: list[Channel], cfg: AlertsSettings) -> None:
        self.path, self.channels, self.cfg = Path(path), list(channels), cfg
        names = [c.name for c in self.channels]
        if len(set(names)) != len(names):
            raise ValueError(f"outbox: channel names must be unique (got {names})")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = self._connect()
        init(self.conn)
        self._lock = threading.Lock()  # one delivery pass at a time
        self._resend_after: dict[str, float] = {}  # channel -> epoch s: a re-post failed
        self._down: set[str] = set()  # channels whose last attempt failed (logged once)
        self._pruned = 0.0
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        unknown = sorted({r[0] for r in self.conn.execute(
            "SELECT DISTINCT channel FROM outbox_queue WHERE state = 'pending'")} - set(names))
        if unknown:
            log.warning("alerts: the outbox holds pending notifications for %s, which [alerts] no "
                        "longer configures: they wait until it does", ", ".join(unknown))

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), timeout=30, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    # ---- the engine's side ------------------------------------------------------------------
    def init(self, conn: sqlite3.Connection) -> None:
        """Create the outbox's tables on the caller's connection (the engine's file)."""
        init(conn)

    def enqueue(self, conn: sqlite3.Connection, notifications: Iterable[Notification],
                now: float | None = None) -> int:
        """Queue each notification for every channel in the caller's open transaction on
        ``conn`` (committed with it); a key already queued is ignored. Returns rows added."""
        now = time.time() if now is None else now
        added = 0
        for n in notifications:
            body = n.to_json()
            for ch in self.channels:
                cur = conn.execute(
                    "INSERT INTO outbox_queue (channel, key, fingerprint, status, body, next_at, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (channel, key) DO NOTHING",
                    (ch.name, n.key, n.fingerprint, n.status, body, now, now))
                if not cur.rowcount:
                    continue
                added += 1
                if getattr(ch, "resend_seconds", None):
                    if n.status == "firing":
                        conn.execute(
                            "INSERT INTO outbox_firing VALUES (?, ?, ?, ?) ON CONFLICT (channel, "
                            "fingerprint) DO UPDATE SET body = excluded.body, next_at = excluded.next_at",
                            (ch.name, n.fingerprint, body, now + ch.resend_seconds))
                    else:
                        conn.execute("DELETE FROM outbox_firing WHERE channel = ? AND fingerprint = ?",
                                     (ch.name, n.fingerprint))
        return added

    def kick(self) -> None:
        """Wake the delivery thread (new rows committed)."""
        self._kick.set()

    # ---- delivery ---------------------------------------------------------------------------
    def start(self) -> Outbox:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="iotlake-alert-outbox", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread (after the send in progress), close the channels and the file."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            for ch in self.channels:
                try:
                    ch.close()
                except Exception:  # noqa: BLE001 - closing one must not keep the others open
                    log.exception("alerts: closing channel %s", ch.name)
            self.conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()
            try:
                delivered = self.deliver_due()
            except Exception:  # noqa: BLE001 - the thread must outlive a bad pass
                log.exception("alerts: outbox delivery pass failed")
                delivered = 0
            if not delivered:
                self._kick.wait(self._idle_seconds())

    def _idle_seconds(self) -> float:
        """Until the next back-off or re-post ends (at most ``POLL_SECONDS``): a row due now
        that the last pass left waits behind one of those."""
        now = time.time()
        names = [c.name for c in self.channels]
        if not names:
            return POLL_SECONDS
        among = ", ".join("?" * len(names))
        with self._lock:
            nexts = [t for (t,) in self.conn.execute(
                f"SELECT min(next_at) FROM outbox_queue WHERE state = 'pending' AND next_at > ? "
                f"AND channel IN ({among}) UNION ALL SELECT min(next_at) FROM outbox_firing "
                f"WHERE next_at > ? AND channel IN ({among})", (now, *names, now, *names)) if t is not None]
        nexts += [t for t in self._resend_after.values() if t > now]
        return min(POLL_SECONDS, max(0.01, min(nexts, default=now + POLL_SECONDS) - now))

    def deliver_due(self, now: float | None = None) -> int:
        """One pass: every channel's due rows, then its due re-posts. Returns rows delivered."""
        with self._lock:
            now = time.time() if now is None else now
            delivered = 0
            for ch in self.channels:
                n, available = self._deliver(ch, now)
                delivered += n
                if available and getattr(ch, "resend_seconds", None):
                    self._resend(ch, now)
            if now - self._pruned > 3600:
                self.conn.execute("DELETE FROM outbox_queue WHERE state = 'delivered' AND done_at < ?",
                                  (now - KEEP_DELIVERED_SECONDS,))
                self._pruned = now
            for name, by_state in self.counts(self.conn).items():
                for state, n in by_state.items():
                    OUTBOX_ROWS.labels(name, state).set(n)
            return delivered

    def _deliver(self, ch: Channel, now: float) -> tuple[int, bool]:
        """The channel's due rows in order; returns how many were delivered and whether the
        receiver is available (no row waits out a back-off it caused)."""
        rows = self.conn.execute(
            "SELECT id, key, fingerprint, body, attempts, next_at, refused FROM outbox_queue "
            "WHERE channel = ? AND state = 'pending' ORDER BY id LIMIT ?", (ch.name, PASS_ROWS)).fetchall()
        waiting: set[str] = set()  # alerts with an earlier row not delivered: theirs wait
        delivered = 0
        for row_id, key, fp, body, attempts, next_at, refused in rows:
            if fp in waiting:
                continue
            if next_at > now:
                if not refused:  # the receiver was unavailable: nothing overtakes this row
                    return delivered, False
                waiting.add(fp)
                continue
            n = Notification.from_json(body)
            try:
                ch.send(n)
            except Exception as e:  # noqa: BLE001 - every failure is retried, then kept
                refused = isinstance(e, Rejected)
                self._failed_attempt(ch, row_id, key, attempts + 1, refused, e, now)
                if not refused:
                    return delivered, False
                waiting.add(fp)
                continue
            self.conn.execute("UPDATE outbox_queue SET state = 'delivered', attempts = ?, done_at = ?, "
                              "last_error = NULL WHERE id = ?", (attempts + 1, now, row_id))
            if n.status == "firing" and getattr(ch, "resend_seconds", None):
                self.conn.execute("UPDATE outbox_firing SET next_at = ? WHERE channel = ? AND fingerprint = ?",
                                  (now + ch.resend_seconds, ch.name, fp))
            NOTIFICATIONS.labels(ch.name, "delivered").inc()
            delivered += 1
            if ch.name in self._down:
                self._down.discard(ch.name)
                log.info("alerts: %s takes notifications again", ch.name)
        return delivered, True

    def _failed_attempt(self, ch: Channel, row_id: int, key: str, attempts: int, refused: bool,
                        e: Exception, now: float) -> None:
        error = f"{type(e).__name__}: {e}"[:1000]
        if attempts >= self.cfg.max_attempts:
            self.conn.execute("UPDATE outbox_queue SET state = 'failed', attempts = ?, done_at = ?, "
                              "refused = ?, last_error = ? WHERE id = ?",
                              (attempts, now, refused, error, row_id))
            NOTIFICATIONS.labels(ch.name, "failed").inc()
            log.error("alerts: %s: notification %s failed %d times, kept as failed (retry_failed "
                      "sends it again): %s", ch.name, key, attempts, error)
            return
        delay = min(self.cfg.retry_seconds * 2 ** (attempts - 1), self.cfg.retry_max_seconds)
        self.conn.execute("UPDATE outbox_queue SET attempts = ?, next_at = ?, refused = ?, last_error = ? "
                          "WHERE id = ?", (attempts, now + delay, refused, error, row_id))
        NOTIFICATIONS.labels(ch.name, "retried").inc()
        if ch.name not in self._down:
            self._down.add(ch.name)
            log.warning("alerts: %s did not take notification %s (%s); retrying with back-off",
                        ch.name, key, error)

    def _resend(self, ch: Channel, now: float) -> None:
        """Post the alerts still firing again (those with no notification pending), many per
        request; a refused request is split into single posts, and an alert refused alone is
        not posted again (Alertmanager refuses, e.g., an invalid label name every time)."""
        if self._resend_after.get(ch.name, 0.0) > now:
            return
        rows = self.conn.execute(
            "SELECT fingerprint, body FROM outbox_firing f WHERE channel = ? AND next_at <= ? AND NOT "
            "EXISTS (SELECT 1 FROM outbox_queue q WHERE q.channel = f.channel AND q.fingerprint = "
            "f.fingerprint AND q.state = 'pending') ORDER BY fingerprint", (ch.name, now)).fetchall()
        post = getattr(ch, "post", None) or (lambda notes: [ch.send(n) for n in notes])
        for i in range(0, len(rows), RESEND_BATCH):
            chunk = [(fp, Notification.from_json(body)) for fp, body in rows[i:i + RESEND_BATCH]]
            try:
                try:
                    post([n for _, n in chunk])
                    done = [fp for fp, _ in chunk]
                except Rejected:
                    done = []
                    for fp, n in chunk:
                        try:
                            ch.send(n)
                            done.append(fp)
                        except Rejected as e:
                            log.warning("alerts: %s refuses firing alert %s (%s): not posted again",
                                        ch.name, n.key, e)
                            self.conn.execute("DELETE FROM outbox_firing WHERE channel = ? AND "
                                              "fingerprint = ?", (ch.name, fp))
            except Exception as e:  # noqa: BLE001 - unavailable: tried again after a back-off
                self._resend_after[ch.name] = now + self.cfg.retry_seconds
                if ch.name not in self._down:
                    self._down.add(ch.name)
                    log.warning("alerts: %s: re-posting %d firing alerts failed (%s); retrying",
                                ch.name, len(chunk), e)
                return
            self.conn.executemany("UPDATE outbox_firing SET next_at = ? WHERE channel = ? AND fingerprint = ?",
                                  [(now + ch.resend_seconds, ch.name, fp) for fp in done])
            NOTIFICATIONS.labels(ch.name, "resent").inc(len(done))

    # ---- for operators ----------------------------------------------------------------------
    def counts(self, conn: sqlite3.Connection | None = None) -> dict[str, dict[str, int]]:
        """Rows per channel and state (every configured channel, and any other with rows)."""
        own = conn is None
        conn = conn or self._connect()
        try:
            out = {ch.name: dict.fromkeys(STATES, 0) for ch in self.channels}
            for name, state, n in conn.execute(
                    "SELECT channel, state, count(*) FROM outbox_queue GROUP BY channel, state"):
                out.setdefault(name, dict.fromkeys(STATES, 0))[state] = n
            return out
        finally:
            if own:
                conn.close()

    def retry_failed(self, channel: str | None = None) -> int:
        """Make failed rows pending again (attempts from zero); returns how many."""
        conn = self._connect()
        try:
            cur = conn.execute(
                "UPDATE outbox_queue SET state = 'pending', attempts = 0, refused = 0, next_at = ?, "
                "done_at = NULL "
                "WHERE state = 'failed' AND (? IS NULL OR channel = ?)", (time.time(), channel, channel))
            n = cur.rowcount
        finally:
            conn.close()
        if n:
            self.kick()
        return n
