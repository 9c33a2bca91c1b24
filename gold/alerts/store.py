"""The alert engine's durable state: one SQLite file under the checkpoint root.

It holds what must survive a restart of ``iotlake run`` without a duplicate or a lost
notification: the open alerts, the conditions waiting out their ``for_seconds``, the breaches of
threshold rules, the transitions not yet in the ``alerts`` Delta table (``alerts_log``), the
operators' silences and acknowledgements, and (``gold.alerts.outbox``) the notifications not
yet delivered. A tick's changes and its notifications commit in one SQLite transaction. The
CLI (``iotlake alerts``) writes silences and acknowledgements here from another process; WAL
mode lets it do so while the engine runs.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lakehouse.settings import Settings

_SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_open (fingerprint TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_pending (key TEXT PRIMARY KEY, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alert_breach (key TEXT PRIMARY KEY, since REAL NOT NULL, last REAL NOT NULL,
                                         value REAL);
CREATE TABLE IF NOT EXISTS alerts_log (seq INTEGER PRIMARY KEY, rows TEXT NOT NULL, current TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_silences (id INTEGER PRIMARY KEY AUTOINCREMENT, rule TEXT,
    device_id TEXT, site TEXT, until REAL NOT NULL, comment TEXT, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alert_acks (alert_id INTEGER PRIMARY KEY, by TEXT, at REAL NOT NULL,
    applied INTEGER NOT NULL DEFAULT 0);
"""


def db_path(settings: Settings) -> Path:
    """Where the engine keeps its state: beside the checkpoints (always a filesystem)."""
    return Path(settings.checkpoint_path("alerts"), "alerts.sqlite")


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")  # a committed tick survives a power cut
    conn.executescript(_SCHEMA)
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@dataclass
class Alert:
    """An open alert: one incident of a rule for a subject (device, site or query)."""

    alert_id: int
    fingerprint: str
    rule: str
    kind: str
    severity: str
    subject: str
    labels: dict[str, str]
    summary: str
    starts_at: float  # epoch s
    value: float | None = None
    device_id: str | None = None
    site: str | None = None
    notified: bool = False  # a firing notification was sent (so its resolution is too)
    notifications: int = 0  # how many firing notifications, for the idempotency key
    last_notified: float = 0.0
    acknowledged: bool = False
    silenced: bool = False
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Alert:
        return cls(**json.loads(text))


def meta(conn: sqlite3.Connection, key: str, default: str | None = None) -> str | None:
    row = conn.execute("SELECT value FROM alert_meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row else default


def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT INTO alert_meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                 (key, value))


def next_id(conn: sqlite3.Connection, key: str) -> int:
    n = int(meta(conn, key, "0")) + 1
    set_meta(conn, key, str(n))
    return n


def open_alerts(conn: sqlite3.Connection) -> dict[str, Alert]:
    return {fp: Alert.from_json(body) for fp, body in conn.execute("SELECT fingerprint, body FROM alert_open")}


@dataclass(frozen=True)
class Silence:
    id: int
    rule: str | None
    device_id: str | None
    site: str | None
    until: float
    comment: str | None

    def matches(self, a: Alert, now: float) -> bool:
        return (now < self.until and (self.rule is None or self.rule == a.rule)
                and (self.device_id is None or self.device_id == a.device_id)
                and (self.site is None or self.site == a.site))


def silences(conn: sqlite3.Connection, now: float | None = None) -> list[Silence]:
    now = time.time() if now is None else now
    rows = conn.execute("SELECT id, rule, device_id, site, until, comment FROM alert_silences "
                        "WHERE until > ? ORDER BY id", (now,))
    return [Silence(*r) for r in rows]


def add_silence(conn: sqlite3.Connection, until: float, rule: str | None = None,
                device_id: str | None = None, site: str | None = None, comment: str | None = None) -> int:
    cur = conn.execute("INSERT INTO alert_silences (rule, device_id, site, until, comment, created) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (rule, device_id, site, until, comment, time.time()))
    return int(cur.lastrowid)


def end_silence(conn: sqlite3.Connection, silence_id: int) -> bool:
    cur = conn.execute("UPDATE alert_silences SET until = ? WHERE id = ? AND until > ?",
                       (time.time(), silence_id, time.time()))
    return cur.rowcount > 0


def request_ack(conn: sqlite3.Connection, alert_id: int, by: str) -> None:
    conn.execute("INSERT INTO alert_acks (alert_id, by, at) VALUES (?, ?, ?) "
                 "ON CONFLICT(alert_id) DO NOTHING", (alert_id, by, time.time()))


def pending_acks(conn: sqlite3.Connection) -> list[tuple[int, str]]:
    return list(conn.execute("SELECT alert_id, by FROM alert_acks WHERE applied = 0"))
