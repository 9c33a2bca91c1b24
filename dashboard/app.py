"""The dashboard's JSON API: reads Delta tables directly with delta-rs (no Spark).

Every answer is aggregated and paged on the server, so the page stays fast with hundreds of
thousands of devices. Opened tables are cached; a background thread reloads one when a new
Delta version is committed, so a request never waits on a table's log, and answers are memoised
per table version. The pipeline panel, whose tables commit every micro-batch, is served from
its last answer while the next one is computed.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from lakehouse.delta.read import arrow_dataset, table_exists
from lakehouse.monitoring.status_file import DEFAULT_MAX_AGE, read_status
from lakehouse.settings import Settings
from lakehouse.tables import SITE

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PIPELINE_COLUMNS = ("query_name", "batch_id", "timestamp", "input_rows_per_second",
                    "processed_rows_per_second", "batch_duration_ms", "num_input_rows", "lag")
MAX_POINTS = 1500  # raw points per metric sent to the browser (anomalies are always kept)
EVENT_HOURS = 6.0  # "Recent events": what changed this long before each table's newest row
SEVERITIES = ("critical", "warning", "info")
_SEVERITY_RANK = "CASE severity " + " ".join(
    f"WHEN '{s}' THEN {i}" for i, s in enumerate(SEVERITIES)) + f" ELSE {len(SEVERITIES)} END"


@dataclass
class Snapshot:
    """One version of a table: its lazy Arrow dataset (file stats let filters skip files) and the
    Delta log's per-file statistics, both taken when the version was opened."""

    version: int
    dataset: ds.Dataset
    stats: pa.Table  # the version's add actions, flattened

    @classmethod
    def of(cls, dt: DeltaTable) -> Snapshot:
        return cls(dt.version(), arrow_dataset(dt), pa.table(dt.get_add_actions(flatten=True)))

    @cached_property
    def table(self) -> pa.Table:
        """Whole table in memory; only for small tables such as device_current."""
        return self.dataset.to_table()

    def max_of(self, column: str) -> Any:
        """Largest value of a column from the Delta log's file statistics (no data read)."""
        name = f"max.{column}"
        return pc.max(self.stats[name]).as_py() if name in self.stats.column_names else None


@dataclass
class _Entry:
    snap: Snapshot
    checked: float = field(default_factory=time.monotonic)


class TableCache:
    """Open Delta tables by logical name. A request gets the table's last snapshot at once; once
    that is ``check_every`` s old, a background thread reads the log's new commits and swaps in
    the new version (one refresh per table at a time), reading the ``preload`` tables whole
    there. Only a table's first open is waited for. Reading the log and the table inside the
    request made it wait longest when the pipeline's jobs held every core (a 628 ms call in the
    hour-long soak, docs/history/benchmarks.md); an answer now lags the table by at most one
    refresh."""

    def __init__(self, settings: Settings, check_every: float = 1.0,
                 preload: tuple[str, ...] = ("device_current", "alerts_current")) -> None:
        self.settings, self.check_every, self.preload = settings, check_every, preload
        self._entries: dict[str, _Entry] = {}
        self._tables: dict[str, DeltaTable] = {}  # each used by its first open, then its refresh
        self._refreshing: set[str] = set()
        self._lock = threading.Lock()

    def get(self, name: str) -> Snapshot | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                if time.monotonic() - entry.checked >= self.check_every and name not in self._refreshing:
                    self._refreshing.add(name)
                    threading.Thread(target=self._refresh, args=(name,), daemon=True,
                                     name=f"dashboard-table-{name}").start()
                return entry.snap
            path = self.settings.table_path(name)
            if not table_exists(path):
                return None
            dt = DeltaTable(path)
            snap = self._snapshot(name, dt)
            self._tables[name], self._entries[name] = dt, _Entry(snap)
            return snap

    def refreshing(self, name: str) -> bool:
        """Whether a background refresh of ``name`` is running."""
        with self._lock:
            return name in self._refreshing

    def versions(self, *names: str) -> tuple[int, ...]:
        return tuple(-1 if (s := self.get(n)) is None else s.version for n in names)

    def _snapshot(self, name: str, dt: DeltaTable) -> Snapshot:
        snap = Snapshot.of(dt)
        if name in self.preload:
            _ = snap.table  # read here, not inside a request
        return snap

    def _refresh(self, name: str) -> None:
        try:
            dt, old = self._tables[name], self._entries[name].snap
            dt.update_incremental()
            snap = old if dt.version() == old.version else self._snapshot(name, dt)
            with self._lock:
                self._entries[name] = _Entry(snap)
        except Exception:  # noqa: BLE001 - the last snapshot stays; the next request tries again
            log.exception("dashboard: refreshing table %s failed", name)
        finally:
            with self._lock:
                self._refreshing.discard(name)


class Memo:
    """Small LRU of answers keyed by (endpoint, params, table versions); ``latest`` for answers
    whose tables change at every micro-batch."""

    def __init__(self, size: int = 512) -> None:
        self._d: OrderedDict[tuple, Any] = OrderedDict()
        self._size, self._lock = size, threading.Lock()
        self._latest: dict[str, tuple[tuple, Any]] = {}  # name -> (versions, answer)
        self._refreshing: set[str] = set()

    def latest(self, name: str, versions: Callable[[], tuple], compute: Callable[[], Any]) -> Any:
        """The last answer; a background thread checks ``versions`` (the tables' Delta versions)
        and recomputes when they moved, one refresh at a time. A request waits only for the very
        first answer, and an answer lags by at most one refresh. For summaries whose tables commit
        every second (pipeline metrics, quality log): reading their logs inside the request made
        it wait the longest exactly when the pipeline kept the cores busy."""
        with self._lock:
            have = self._latest.get(name)
            if have is not None:
                if name not in self._refreshing:
                    self._refreshing.add(name)
                    threading.Thread(target=self._refresh, args=(name, versions, compute),
                                     name=f"dashboard-refresh-{name}", daemon=True).start()
                return have[1]
        seen = versions()
        value = compute()
        with self._lock:
            self._latest[name] = (seen, value)
        return value

    def refreshing(self, name: str) -> bool:
        """Whether a background refresh of ``name`` is running."""
        with self._lock:
            return name in self._refreshing

    def _refresh(self, name: str, versions: Callable[[], tuple], compute: Callable[[], Any]) -> None:
        try:
            seen = versions()
            with self._lock:
                moved = self._latest[name][0] != seen
            if moved:
                value = compute()
                with self._lock:
                    self._latest[name] = (seen, value)
        except Exception:  # noqa: BLE001 - the next request tries again; the old answer stays
            log.exception("dashboard: refreshing %s failed", name)
        finally:
            with self._lock:
                self._refreshing.discard(name)

    def __call__(self, key: tuple, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        value = compute()
        with self._lock:
            self._d[key] = value
            while len(self._d) > self._size:
                self._d.popitem(last=False)
        return value


def _json_value(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(v, float) and v != v:  # NaN is not JSON
        return None
    return v


def _labels(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _equal(t: pa.Table, column: str, value: str) -> pa.ChunkedArray:
    """Per row: ``column`` is ``value`` (False for a table without the column)."""
    if column not in t.column_names:
        return pa.chunked_array([pa.repeat(pa.scalar(False), t.num_rows)])
    return pc.fill_null(pc.equal(t[column], value), False)


def _sites(t: pa.Table) -> list[str]:
    """The fleet's sites (device_current's ``site``: the topic's or the registry's), sorted."""
    if SITE not in t.column_names:
        return []
    return sorted(s for s in pc.unique(t[SITE]).to_pylist() if s is not None)


def label_filter(text: str) -> tuple[str, str] | None:
    """``key=value`` as (key, value); "" as None; 400 without a key or ``=``."""
    if not text:
        return None
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise HTTPException(400, f"label {text!r}: give KEY=VALUE, e.g. label=floor=3")
    return key.strip(), value.strip()


def records(table: pa.Table) -> list[dict[str, Any]]:
    return [{k: _json_value(v) for k, v in row.items()} for row in table.to_pylist()]


def epoch_ms(col: pa.ChunkedArray | pa.Array) -> list[int]:
    return pc.cast(pc.cast(col, pa.timestamp("ms", tz="UTC")), pa.int64()).to_pylist()


def floats(col: pa.ChunkedArray | pa.Array) -> list[float | None]:
    return [None if v is None or v != v else round(v, 4) for v in col.to_pylist()]


class Lake:
    """The dashboard's read model: each method answers one endpoint from the Delta tables."""

    def __init__(self, settings: Settings, check_every: float = 1.0) -> None:
        self.tables = TableCache(settings, check_every)
        self.metrics = [{"name": m.name, "unit": m.unit} for m in settings.telemetry.metrics if m.gold]
        self.topics = list(settings.telemetry.topic_columns)  # device_current's, e.g. site
        self.memo = Memo()
        self._db = duckdb.connect(config={"threads": 2})
        self._db.execute("SET GLOBAL TimeZone = 'UTC'")

    def sql(self, query: str, params: list[Any] | None = None, **tables: Any) -> pa.Table:
        """DuckDB over Arrow data; a cursor per call because requests run on several threads."""
        cur = self._db.cursor()
        try:
            for name, data in tables.items():
                cur.register(name, data)
            return cur.sql(query, params=params).to_arrow_table()
        finally:
            cur.close()

    def _snap(self, name: str) -> Snapshot:
        snap = self.tables.get(name)
        if snap is None:
            raise HTTPException(503, f"table '{name}' has no data yet")
        return snap

    def fleet(self) -> dict[str, Any]:
        snap = self._snap("device_current")

        def compute() -> dict[str, Any]:
            counts = snap.table["status"].value_counts().to_pylist()
            by_status = {c["values"]: c["counts"] for c in sorted(counts, key=lambda c: str(c["values"]))}
            return {"total": snap.table.num_rows, "by_status": by_status,
                    "updated_at": _json_value(pc.max(snap.table["updated_at"]).as_py()),
                    "version": snap.version, "sites": _sites(snap.table)}

        return self.memo(("fleet", snap.version), compute)

    def devices(self, q: str, status: str, page: int, size: int, site: str = "",
                label: tuple[str, str] | None = None) -> dict[str, Any]:
        """A page of devices by id; ``site`` and ``label`` (key, value) filter exactly."""
        snap = self._snap("device_current")

        def compute() -> dict[str, Any]:
            t = snap.table
            masks = [pc.match_substring(t["device_id"], q, ignore_case=True) if q else None,
                     pc.equal(t["status"], status) if status else None,
                     _equal(t, SITE, site) if site else None]
            masks = [m for m in masks if m is not None]
            if masks:
                t = t.filter(functools.reduce(pc.and_, masks))
            if label is not None:
                t = self.labelled(t, *label)
            t = t.sort_by("device_id")
            items = records(t.slice((page - 1) * size, size))
            for x in items:
                if "labels" in x:
                    x["labels"] = _labels(x["labels"])
            return {"total": t.num_rows, "page": page, "size": size, "items": items}

        return self.memo(("devices", q, status, site, label, page, size, snap.version), compute)

    def labelled(self, t: pa.Table, key: str, value: str) -> pa.Table:
        """The rows whose ``labels`` (a JSON object) give ``key`` exactly ``value``: DuckDB's
        JSON functions, vectorised (a JSON Pointer, so any key), rows of bad JSON matching none."""
        if "labels" not in t.column_names:
            return t.slice(0, 0)
        pointer = "/" + key.replace("~", "~0").replace("/", "~1")
        return self.sql("""SELECT * FROM t WHERE json_extract_string(
                               CASE WHEN json_valid(labels) THEN labels END, $1) = $2""",
                        [pointer, value], t=t)

    def device(self, device_id: str, hours: float) -> dict[str, Any]:
        names = ("device_current", "gold_metrics_1m", "readings_scored", "anomalies")
        key = ("device", device_id, hours, self.tables.versions(*names))
        return self.memo(key, lambda: self._device(device_id, hours))

    def _device(self, device_id: str, hours: float) -> dict[str, Any]:
        cur = self._snap("device_current").table
        row = cur.filter(pc.equal(cur["device_id"], device_id))
        if row.num_rows == 0:
            raise HTTPException(404, f"unknown device '{device_id}'")
        info = records(row)[0]
        if "labels" in info:
            info["labels"] = _labels(info["labels"])
        anchor = row["last_seen"][0].as_py() or datetime.now(UTC)
        since = pa.scalar(anchor - timedelta(hours=hours), pa.timestamp("us", tz="UTC"))
        dev = pc.field("device_id") == device_id

        def read(name: str, time_col: str, cols: list[str]) -> pa.Table | None:
            snap = self.tables.get(name)
            if snap is None:
                return None
            t = snap.dataset.to_table(columns=cols, filter=dev & (pc.field(time_col) >= since))
            return t.sort_by(time_col)

        series: dict[str, Any] = {}
        gold = read("gold_metrics_1m", "window_start", ["metric", "window_start", "mean", "min", "max"])
        points: dict[str, Any] = {}
        raw = read("readings_scored", "event_time", ["metric", "event_time", "value"])
        for m in (x["name"] for x in self.metrics):
            if gold is not None:
                g = gold.filter(pc.equal(gold["metric"], m))
                series[m] = {"t": epoch_ms(g["window_start"]), "mean": floats(g["mean"]),
                             "min": floats(g["min"]), "max": floats(g["max"])}
            if raw is not None:
                r = raw.filter(pc.equal(raw["metric"], m))
                if r.num_rows > MAX_POINTS:  # thin evenly; the 1-minute windows keep the shape
                    r = r.take(pa.array(range(0, r.num_rows, -(-r.num_rows // MAX_POINTS))))
                points[m] = {"t": epoch_ms(r["event_time"]), "v": floats(r["value"])}
        an = read("anomalies", "event_time", ["event_id", "metric", "event_time", "value", "score", "baseline"])
        anomalies = [] if an is None else records(an)
        if an is not None:
            for a, ms in zip(anomalies, epoch_ms(an["event_time"]), strict=True):
                a["t"] = ms
        return {"device": info, "hours": hours, "since": _json_value(since.as_py()),
                "topics": [c for c in self.topics if c in info], "metrics": self.metrics, "series": series, "points": points, "anomalies": anomalies}

    def alerts(self, limit: int) -> dict[str, Any]:
        """The open alerts (``alerts_current``), critical first, then newest first."""
        snap = self.tables.get("alerts_current")
        if snap is None:  # no `iotlake run` with alerts has written it yet
            return {"total": 0, "by_severity": {}, "items": [], "version": -1}

        def compute() -> dict[str, Any]:
            t = snap.table
            counts = self.sql("SELECT severity, count(*) AS n FROM t GROUP BY ALL", t=t).to_pylist()
            items = records(self.sql(f"""
                SELECT alert_id, rule, kind, severity, subject, device_id, site, starts_at, value,
                       summary, labels, acknowledged, silenced, updated_at
                FROM t ORDER BY {_SEVERITY_RANK}, starts_at DESC, alert_id DESC LIMIT {limit}""", t=t))
            for a in items:
                a["labels"] = _labels(a["labels"])
            return {"total": t.num_rows, "version": snap.version, "items": items,
                    "by_severity": {c["severity"]: c["n"] for c in sorted(
                        counts, key=lambda c: (SEVERITIES.index(c["severity"])
                                               if c["severity"] in SEVERITIES else 9))}}

        return self.memo(("alerts", limit, snap.version), compute)

    def events(self, limit: int, hours: float = EVENT_HOURS) -> dict[str, Any]:
        names = ("device_status_history", "anomalies", "alerts")
        key = ("events", limit, hours, self.tables.versions(*names))
        return self.memo(key, lambda: self._events(limit, hours))

    def _events(self, limit: int, hours: float) -> dict[str, Any]:
        """What changed in the last ``hours`` before each table's newest row, grouped so that a
        flapping fleet is a few lines: a device's status changes are one line (its latest, and
        how many), an alert's transitions are one (its latest), and the alerts whose latest
        transition is the same, of one rule, in one minute are one (a site's devices going
        offline together); anomalies one line per device and metric."""
        out: dict[str, Any] = {"hours": hours, "status_changes": [], "alert_transitions": [],
                               "anomalies": [], "totals": {}}

        def since(snap: Snapshot, col: str) -> str:
            hi = snap.max_of(col)
            return "TRUE" if hi is None else f"{col} >= TIMESTAMPTZ '{(hi - timedelta(hours=hours)).isoformat()}'"

        if (h := self.tables.get("device_status_history")) is not None:
            window = f"SELECT * FROM h WHERE previous_status IS NOT NULL AND {since(h, 'changed_at')}"
            out["status_changes"] = records(self.sql(f"""
                SELECT device_id, arg_max(status, changed_at) AS status,
                       arg_max(previous_status, changed_at) AS previous_status,
                       arg_max(reason, changed_at) AS reason, max(changed_at) AS changed_at,
                       count(*) AS changes
                FROM ({window}) GROUP BY device_id ORDER BY changed_at DESC, device_id
                LIMIT {limit}""", h=h.dataset))
            n, devices = self.sql(f"SELECT count(*), count(DISTINCT device_id) FROM ({window})",
                                  h=h.dataset).to_pylist()[0].values()
            out["totals"]["status_changes"] = {"changes": n, "devices": devices}
        if (al := self.tables.get("alerts")) is not None:
            window = f"SELECT * FROM al WHERE {since(al, 'changed_at')}"
            out["alert_transitions"] = records(self.sql(f"""
                WITH latest AS (
                    SELECT rule, subject, arg_max(transition, changed_at) AS transition,
                           arg_max(severity, changed_at) AS severity,
                           arg_max(summary, changed_at) AS summary,
                           arg_max(alert_id, changed_at) AS alert_id,
                           arg_max(device_id, changed_at) AS device_id,
                           max(changed_at) AS changed_at, count(*) AS transitions
                    FROM ({window}) GROUP BY rule, subject)
                SELECT rule, transition, any_value(severity) AS severity, max(changed_at) AS changed_at,
                       count(*) AS subjects, sum(transitions)::BIGINT AS transitions,
                       list(subject ORDER BY changed_at DESC, subject)[1:3] AS sample,
                       arg_max(summary, changed_at) AS summary, arg_max(alert_id, changed_at) AS alert_id,
                       arg_max(device_id, changed_at) AS device_id
                FROM latest GROUP BY rule, transition, time_bucket(INTERVAL 1 MINUTE, changed_at)
                ORDER BY changed_at DESC, rule, transition LIMIT {limit}""", al=al.dataset))
            out["totals"]["alert_transitions"] = self.sql(
                f"SELECT count(*) AS n FROM ({window})", al=al.dataset).to_pylist()[0]["n"]
        if (a := self.tables.get("anomalies")) is not None:
            window = f"SELECT * FROM a WHERE {since(a, 'event_time')}"
            out["anomalies"] = records(self.sql(f"""
                SELECT device_id, metric, max(event_time) AS event_time,
                       arg_max(value, event_time) AS value, arg_max(baseline, event_time) AS baseline,
                       max(score) AS score, count(*) AS count
                FROM ({window}) GROUP BY device_id, metric ORDER BY event_time DESC, device_id, metric
                LIMIT {limit}""", a=a.dataset))
            n, devices = self.sql(f"SELECT count(*), count(DISTINCT device_id) FROM ({window})",
                                  a=a.dataset).to_pylist()[0].values()
            out["totals"]["anomalies"] = {"count": n, "devices": devices}
        return out

    def pipeline(self) -> dict[str, Any]:
        return self.memo.latest("pipeline", lambda: self.tables.versions("pipeline_metrics", "quality_log"),
                                self._pipeline)

    def _pipeline(self) -> dict[str, Any]:
        out: dict[str, Any] = {"queries": [], "quality": []}
        if (pm := self.tables.get("pipeline_metrics")) is not None and (hi := pm.max_of("timestamp")):
            # not progress_json: megabytes per 15 minutes, and the writer already took `lag` from it
            recent = pm.dataset.to_table(columns=list(PIPELINE_COLUMNS),
                                         filter=pc.field("timestamp") >= hi - timedelta(minutes=15))
            out["queries"] = records(self.sql("""
                SELECT query_name, arg_max(batch_id, timestamp) AS batch_id,
                       max(timestamp) AS last_batch_at,
                       arg_max(input_rows_per_second, timestamp) AS input_rows_per_second,
                       arg_max(processed_rows_per_second, timestamp) AS processed_rows_per_second,
                       arg_max(batch_duration_ms, timestamp) AS batch_duration_ms,
                       round(avg(batch_duration_ms)) AS avg_batch_duration_ms,
                       arg_max(num_input_rows, timestamp) AS num_input_rows,
                       arg_max(lag, timestamp) AS lag
                FROM recent GROUP BY query_name ORDER BY query_name""", recent=recent))
        if (ql := self.tables.get("quality_log")) is not None and (hi := ql.max_of("logged_at")):
            since = hi - timedelta(hours=24)
            out["quality"] = records(self.sql(f"""
                SELECT expectation, any_value("column") AS "column", sum(evaluated) AS evaluated,
                       sum(failed) AS failed, sum(failed) / nullif(sum(evaluated), 0) AS quarantine_rate
                FROM ql WHERE kind = 'row' AND logged_at >= TIMESTAMPTZ '{since.isoformat()}'
                GROUP BY expectation ORDER BY quarantine_rate DESC, expectation""", ql=ql.dataset))
            out["quality_window_hours"] = 24
        return out


#: Every answer's: the page loads its own script, style and data only, and no other site frames it.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8050`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(settings: Settings, bind: str) -> frozenset[str]:
    """Names a token-less dashboard answers to: loopback, its bind address, the settings' own."""
    own = {bind.lower().strip("[]")} - _WILDCARDS
    return LOOPBACK_NAMES | own | set(settings.dashboard.allowed_hosts)


class Guard:
    """ASGI middleware: the security headers on every answer, and, when ``hosts`` is set (no
    token), 421 to a request whose ``Host`` is not one of them: a page of another site whose
    name was pointed at this address (DNS rebinding) reads nothing. ``/healthz`` stays open to
    probes, whatever name they use, with the verdict only."""

    def __init__(self, app: Any, hosts: frozenset[str] | None) -> None:
        self.app, self.hosts = app, hosts
        self._headers = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    def trusted(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.hosts is None:
            return True
        host = next((v.decode("latin-1") for k, v in headers if k == b"host"), "")
        return host_name(host) in self.hosts

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self._headers]
            await send(message)

        trusted = self.trusted(scope.get("headers", []))
        scope.setdefault("state", {})["trusted_host"] = trusted
        if not trusted and scope["path"] != "/healthz":
            names = ", ".join(sorted(self.hosts or ()))
            answer = PlainTextResponse(
                f"this dashboard answers to {names} (dashboard.allowed_hosts adds names; a token, "
                "IOTLAKE_DASHBOARD_TOKEN, lifts the check)\n", status_code=421)
            await answer(scope, receive, with_headers)
            return
        await self.app(scope, receive, with_headers)


def create_app(settings: Settings, token: str | None = None, check_every: float = 1.0,
               bind: str = "127.0.0.1") -> FastAPI:
    """Build the app; with a ``token`` every /api call needs ``Authorization: Bearer <token>``,
    without one every request needs a ``Host`` of ``allowed_hosts(settings, bind)``."""
    lake = Lake(settings, check_every)
    app = FastAPI(title="iotlake dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lake = lake
    app.add_middleware(Guard, hosts=None if token else allowed_hosts(settings, bind))

    def authorized(request: Request) -> bool:
        if not request.scope.get("state", {}).get("trusted_host", True):
            return False
        given = request.headers.get("authorization", "")
        return not token or hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def auth(request: Request) -> None:
        if not authorized(request):
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    guarded = [Depends(auth)]

    @app.get("/api/fleet", dependencies=guarded)
    def fleet() -> dict[str, Any]:
        return lake.fleet()

    @app.get("/api/devices", dependencies=guarded)
    def devices(q: str = Query("", max_length=100), status: str = Query("", max_length=40),
                site: str = Query("", max_length=100), label: str = Query("", max_length=200),
                page: int = Query(1, ge=1), size: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
        return lake.devices(q, status, page, size, site, label_filter(label))

    @app.get("/api/device/{device_id:path}", dependencies=guarded)  # ids may hold '/'
    def device(device_id: str, hours: float = Query(6, gt=0, le=24 * 7)) -> dict[str, Any]:
        return lake.device(device_id, hours)

    @app.get("/api/events", dependencies=guarded)
    def events(limit: int = Query(50, ge=1, le=500),
               hours: float = Query(EVENT_HOURS, gt=0, le=24 * 7)) -> dict[str, Any]:
        return lake.events(limit, hours)

    @app.get("/api/alerts", dependencies=guarded)
    def alerts(limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
        return lake.alerts(limit)

    @app.get("/api/pipeline", dependencies=guarded)
    def pipeline() -> dict[str, Any]:
        return lake.pipeline()

    @app.get("/healthz")
    def healthz(request: Request, role: str = Query("all", pattern="^[a-z]+$"),
                max_age: float = Query(DEFAULT_MAX_AGE, gt=0)) -> JSONResponse:
        """The pipeline's health as ``iotlake status --format json`` says it: 200 healthy, 503
        unhealthy or not running. Open to probes; with a token set, the details (endpoints,
        paths, errors) only to a request that carries it."""
        status = read_status(settings, max_age, role)
        if not authorized(request):
            status = {k: status.get(k) for k in ("time", "role", "running", "healthy")}
        return JSONResponse(status, status_code=200 if status["healthy"] else 503)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
