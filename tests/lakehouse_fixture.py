"""A small, realistic lakehouse written with delta-rs, so query and dashboard tests need no Spark.

Tables are mutually consistent the way the pipeline would write them: readings_scored is silver in
long format, gold windows aggregate silver, anomalies are the scored rows flagged anomalous,
device_current is each device's latest state, quality_log counts what went to quarantine.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
from deltalake import write_deltalake
from fleets import SENSOR

from lakehouse.settings import Settings
from lakehouse.tables import schemas

#: the lakehouse is the example sensor fleet's
SCHEMAS = schemas(SENSOR)
METRICS = SENSOR.metric_names

STATUSES = ("online", "degraded", "offline")
BASE = {"temperature": (21.0, 0.8), "humidity": (45.0, 3.0), "battery": (80.0, 0.5)}
THRESHOLD = 4.0  # |z| above which a reading is an anomaly
ANOMALY_DEVICE_INDEX = 7


def device_ids(n: int) -> list[str]:
    return [f"dev-{i:04d}" for i in range(n)]


def write(settings: Settings, name: str, rows: dict[str, Any] | pa.Table, mode: str = "error") -> None:
    """Write columns (a dict or table) to the logical table ``name`` with its contract schema."""
    table = rows if isinstance(rows, pa.Table) else pa.table(rows, schema=SCHEMAS[name])
    write_deltalake(settings.table_path(name), table.cast(SCHEMAS[name]), mode=mode)


def write_bronze(settings: Settings, messages: list, first_offset: int = 0) -> None:
    """Append simulator messages to bronze as the bronze stream would (one Kafka partition,
    consecutive offsets from ``first_offset``): a lakehouse for the Spark layers without brokers."""
    now = datetime.now(UTC)
    n = len(messages)
    write(settings, "bronze", {
        "key": [m.topic.split("/")[-2].encode() for m in messages],
        "value": [m.payload for m in messages], "topic": [settings.kafka.topic] * n,
        "partition": [0] * n, "offset": list(range(first_offset, first_offset + n)),
        "timestamp": [now] * n, "headers": [[]] * n, "ingest_time": [now] * n}, mode="append")


def build_lakehouse(settings: Settings, devices: int = 50, hours: int = 2, seed: int = 0,
                    now: datetime | None = None) -> dict[str, Any]:
    """Write every table for ``devices`` devices reporting every 20 s for ``hours`` hours.

    Returns the facts tests assert on: fleet counts, per-device status, the known anomaly.
    """
    rng = np.random.default_rng(seed)
    now = (now or datetime.now(UTC)).replace(second=0, microsecond=0)
    start = now - timedelta(hours=hours)
    ids = device_ids(devices)
    registry = registry_rows(ids, now)
    status = [STATUSES[i % 3] if i % 5 else "online" for i in range(devices)]
    anomaly_index = min(ANOMALY_DEVICE_INDEX, devices - 1)
    status[anomaly_index] = "online"
    # Offline devices went silent 20-60 min ago; the others report until now.
    last = {d: now - timedelta(minutes=int(rng.integers(20, 60))) if s == "offline" else now
            for d, s in zip(ids, status, strict=True)}
    anomaly_dev = ids[anomaly_index]
    anomaly_time = now - timedelta(minutes=30)

    # ---- silver: one event per device every 20 s ------------------------------------------
    ev: dict[str, list[Any]] = {k: [] for k in ("device_id", "event_time", *METRICS)}
    for d in ids:
        n = int((last[d] - start).total_seconds() // 20) + 1
        times = [start + timedelta(seconds=20 * k) for k in range(n)]
        ev["device_id"] += [d] * n
        ev["event_time"] += times
        for m in METRICS:
            mu, sd = BASE[m]
            ev[m] += list(mu + sd * np.clip(rng.standard_normal(n), -2, 2))
        if status[ids.index(d)] == "degraded":  # low battery
            ev["battery"][-n:] = list(12.0 + 0.5 * np.clip(rng.standard_normal(n), -2, 2))
    k = next(i for i, (d, t) in enumerate(zip(ev["device_id"], ev["event_time"], strict=True))
             if d == anomaly_dev and t == anomaly_time)
    ev["temperature"][k] = 95.0
    n_ev = len(ev["device_id"])
    ingest = [t + timedelta(seconds=2) for t in ev["event_time"]]
    silver = {
        "event_id": [f"{d}-{int(t.timestamp())}" for d, t in zip(ev["device_id"], ev["event_time"], strict=True)],
        **ev,
        "status": ["ok"] * n_ev, "schema_version": [1] * n_ev, "extra": [None] * n_ev,
        "kafka_partition": [hash(d) % 2 for d in ev["device_id"]],
        "kafka_offset": list(range(n_ev)), "ingest_time": ingest,
    }
    write(settings, "silver", silver)
    payloads = [json.dumps({"device_id": d, "ts": t.isoformat(), **{m: silver[m][i] for m in METRICS}}).encode()
                for i, (d, t) in enumerate(zip(ev["device_id"], ev["event_time"], strict=True))]
    write(settings, "bronze", {
        "key": [d.encode() for d in ev["device_id"]], "value": payloads,
        "topic": ["telemetry"] * n_ev, "partition": silver["kafka_partition"],
        "offset": silver["kafka_offset"], "timestamp": ev["event_time"], "headers": [[]] * n_ev,
        "ingest_time": ingest})

    # ---- quarantine + quality_log: a few out-of-range payloads per batch ------------------
    q_times = [start + timedelta(minutes=10 * b) for b in range(hours * 6)]
    bad = [int(rng.integers(0, 4)) for _ in q_times]
    qrows = [(b, t) for b, t in zip(range(len(q_times)), q_times, strict=True) for _ in range(bad[b])]
    write(settings, "quarantine", {
        "reason": ["temperature_in_range"] * len(qrows),
        "value": [b'{"device_id":"dev-0001","temperature":999}'] * len(qrows),
        "event_id": [f"bad-{i}" for i in range(len(qrows))], "device_id": ["dev-0001"] * len(qrows),
        "event_time": [t for _, t in qrows], "kafka_topic": ["telemetry"] * len(qrows),
        "kafka_partition": [0] * len(qrows), "kafka_offset": list(range(len(qrows))),
        "ingest_time": [t for _, t in qrows], "quarantined_at": [t for _, t in qrows]})
    per_batch = n_ev // len(q_times)
    ql: dict[str, list[Any]] = {f: [] for f in SCHEMAS["quality_log"].names}
    for b, t in enumerate(q_times):
        for exp, col, kind, failed in (("rows_in", None, "counter", 0),
                                       ("device_id_not_null", "device_id", "row", 0),
                                       ("temperature_in_range", "temperature", "row", bad[b])):
            evaluated = per_batch + bad[b]
            for f, v in (("query_id", "silver-q"), ("batch_id", b), ("logged_at", t),
                         ("expectation", exp), ("column", col), ("kind", kind),
                         ("evaluated", evaluated), ("passed", evaluated - failed),
                         ("failed", failed), ("success", failed == 0), ("details", None)):
                ql[f].append(v)
    write(settings, "quality_log", ql)

    # ---- readings_scored / anomalies / gold, derived from silver with DuckDB ---------------
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("silver_t", pa.table(silver, schema=SCHEMAS["silver"]))
    long = " UNION ALL ".join(
        f"SELECT event_id, device_id, event_time, '{m}' AS metric, {m} AS value FROM silver_t"
        for m in METRICS)
    scored = con.sql(f"""
        WITH l AS ({long}),
        b AS (SELECT device_id, metric, median(value) AS baseline, mad(value) * 1.4826 AS sd
              FROM l GROUP BY ALL)
        SELECT l.event_id, l.device_id, l.event_time, l.metric, l.value,
               abs(l.value - b.baseline) / greatest(b.sd, 1e-9) AS score, b.baseline,
               abs(l.value - b.baseline) / greatest(b.sd, 1e-9) > {THRESHOLD} AS is_anomaly,
               'mean_1024' AS anomaly_model, b.baseline - {THRESHOLD} * b.sd AS expected_low,
               b.baseline + {THRESHOLD} * b.sd AS expected_high
        FROM l JOIN b USING (device_id, metric) ORDER BY l.event_time, l.device_id, l.metric
    """).to_arrow_table()
    write(settings, "readings_scored", scored)
    con.register("scored", scored)
    anomalies = con.sql("SELECT * FROM scored WHERE is_anomaly").to_arrow_table()
    write(settings, "anomalies", anomalies)
    for name, minutes in (("gold_metrics_1m", 1), ("gold_metrics_5m", 5)):
        gold = con.sql(f"""
            SELECT device_id, metric, time_bucket(INTERVAL {minutes} MINUTE, event_time) AS window_start,
                   time_bucket(INTERVAL {minutes} MINUTE, event_time) + INTERVAL {minutes} MINUTE AS window_end,
                   count(*) AS count, avg(value) AS mean, min(value) AS min, max(value) AS max,
                   stddev_samp(value) AS stddev, arg_max(value, event_time) AS last
            FROM scored GROUP BY ALL ORDER BY window_start, device_id, metric
        """).to_arrow_table()
        write(settings, name, gold)

    # ---- device_current + device_status_history --------------------------------------------
    since = {d: (last[d] if s == "offline" else now - timedelta(minutes=int(rng.integers(5, 90))))
             if s != "online" else start for d, s in zip(ids, status, strict=True)}
    latest = con.execute("""
        SELECT device_id, arg_max(temperature, event_time) t, arg_max(humidity, event_time) h,
               arg_max(battery, event_time) b FROM silver_t GROUP BY device_id ORDER BY device_id
    """).fetchall()
    max_score = dict(con.execute("SELECT device_id, max(score) FROM scored GROUP BY 1").fetchall())
    reason = {"online": "data", "degraded": "low_battery", "offline": "no_data"}
    current = {
        "device_id": ids, "status": status, "status_since": [since[d] for d in ids],
        "last_seen": [last[d] for d in ids], "temperature": [r[1] for r in latest],
        "humidity": [r[2] for r in latest], "battery": [r[3] for r in latest],
        "anomaly_score": [max_score[d] for d in ids], "updated_at": [now] * devices,
        "last_received": [last[d] + timedelta(seconds=2) for d in ids],
        "status_reason": [reason[s] for s in status],
        **registry_columns(ids, registry)}
    # the columns device_current has in this checkout (older ones lack the later ones)
    write(settings, "device_current", {c: current[c] for c in SCHEMAS["device_current"].names})
    hist: dict[str, list[Any]] = {f: [] for f in SCHEMAS["device_status_history"].names}
    for d, s in zip(ids, status, strict=True):
        changes = [("online", None, start, "first seen")]
        if s != "online":
            changes.append((s, "online", since[d], "no data for 10 min" if s == "offline" else "battery below 15%"))
        for st, prev, at, reason in changes:
            for f, v in (("device_id", d), ("status", st), ("previous_status", prev),
                         ("changed_at", at), ("reason", reason)):
                hist[f].append(v)
    write(settings, "device_status_history", hist)

    # ---- pipeline_metrics: recent micro-batches of each streaming query ---------------------
    pm: dict[str, list[Any]] = {f: [] for f in SCHEMAS["pipeline_metrics"].names}
    for qi, q in enumerate(("bronze", "silver", "gold")):
        for b in range(10):
            rows = 900 + 10 * b + qi
            progress = {"sources": [{"metrics": {"maxOffsetsBehindLatest": str(5 * qi + b)}}]}
            for f, v in (("query_name", q), ("query_id", f"{q}-q"), ("run_id", f"{q}-run"),
                         ("batch_id", b), ("timestamp", now - timedelta(seconds=10 * (9 - b))),
                         ("num_input_rows", rows), ("input_rows_per_second", rows / 10.0),
                         ("processed_rows_per_second", rows / 0.5), ("batch_duration_ms", 400 + 10 * b + qi),
                         ("duration_ms", json.dumps({"triggerExecution": 400 + 10 * b})),
                         ("state_rows", 100 * qi), ("state_memory_bytes", 1024 * qi),
                         ("rows_dropped_by_watermark", 0), ("duplicates_dropped", b % 2),
                         ("watermark", (now - timedelta(minutes=10)).isoformat()),
                         ("lag", 5 * qi + b),
                         ("progress_json", json.dumps(progress))):
                pm[f].append(v)
    write(settings, "pipeline_metrics", pm)

    flagged = anomalies.to_pylist()
    assert len(flagged) == 1 and flagged[0]["device_id"] == anomaly_dev, flagged
    return {
        "now": now, "devices": devices, "silver_rows": n_ev,
        "fleet": {s: status.count(s) for s in STATUSES},
        "status": dict(zip(ids, status, strict=True)),
        "anomaly": {"device_id": anomaly_dev, "event_time": anomaly_time, "metric": "temperature",
                    "value": 95.0},
        "quarantined": len(qrows),
        "quarantine_rate": len(qrows) / sum(per_batch + x for x in bad),
        "registry": registry,
    }


def registry_rows(ids: list[str], now: datetime) -> dict[str, dict[str, Any]]:
    """What the device registry holds of the fleet: every fourth device is not registered, the
    others alternate between two sites with a ``floor`` and a ``zone`` label; one is revoked."""
    rows = {d: {"site": ("north", "south")[i % 2], "labels": {"floor": str(i % 3), "zone": "ab"[i // 30 % 2]},
                "revoked_at": now - timedelta(hours=1) if i == 10 else None}
            for i, d in enumerate(ids) if i % 4 != 3}
    return rows


def registry_columns(ids: list[str], registry: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """device_current's registry columns (``lakehouse.tables.registry_columns``) for ``ids``."""
    reg = [registry.get(d) for d in ids]
    return {"labels": [json.dumps(r["labels"], sort_keys=True) if r else None for r in reg],
            "registered": [r is not None for r in reg],
            "revoked_at": [r["revoked_at"] if r else None for r in reg],
            "site": [r["site"] if r else None for r in reg]}


def write_alerts(settings: Settings, facts: dict[str, Any], flapper: str = "dev-0000",
                 flaps: int = 6) -> dict[str, Any]:
    """``alerts`` and ``alerts_current`` as the engine writes them for ``build_lakehouse``'s fleet,
    and ``flapper`` (an online device) flapping: ``flaps`` times degraded and back in
    ``device_status_history``, each an alert fired and resolved. The open alerts: every offline
    device's ``DeviceOffline`` (fired in one burst, the first one acknowledged), ``PipelineStale``
    on silver, the anomaly's ``HighTemperature`` (silenced). Returns what tests assert on."""
    now, an = facts["now"], facts["anomaly"]
    offline = sorted(d for d, s in facts["status"].items() if s == "offline")
    burst = now - timedelta(minutes=15)
    rows: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []
    ids = iter(range(1, 10_000))

    def alert(rule: str, kind: str, severity: str, subject: str, device: str | None, at: datetime,
              summary: str, value: float | None, ack: bool = False, silenced: bool = False,
              resolved_at: datetime | None = None) -> int:
        a = {"alert_id": next(ids), "fingerprint": f"{rule}|{subject}", "rule": rule, "kind": kind,
             "severity": severity, "subject": subject, "device_id": device, "site": None,
             "starts_at": at, "value": value, "summary": summary,
             "labels": json.dumps({"alertname": rule, "severity": severity,
                                   **({"device_id": device} if device else {"query": subject})})}
        rows.append({**a, "status": "firing", "transition": "firing", "changed_at": at, "ends_at": None})
        if ack:
            rows.append({**a, "status": "firing", "transition": "acknowledged",
                         "changed_at": now - timedelta(minutes=10), "ends_at": None})
        if resolved_at is not None:
            rows.append({**a, "status": "resolved", "transition": "resolved",
                         "changed_at": resolved_at, "ends_at": resolved_at})
        else:
            current.append({**a, "status": "firing", "ends_at": None, "acknowledged": ack,
                            "silenced": silenced, "updated_at": now})
        return a["alert_id"]

    for i, d in enumerate(offline):
        alert("DeviceOffline", "device_offline", "warning", d, d, burst + timedelta(seconds=i / 2),
              f"{d} offline: nothing received for 120 s", 120.0, ack=i == 0)
    alert("PipelineStale", "pipeline_stale", "critical", "silver", None, now - timedelta(minutes=5),
          "query silver: no progress for 75 s", 75.0)
    alert("HighTemperature", "threshold", "info", an["device_id"], an["device_id"], an["event_time"],
          f"{an['device_id']} temperature above 60 for 0 s", an["value"], silenced=True)
    hist: dict[str, list[Any]] = {f: [] for f in SCHEMAS["device_status_history"].names}
    first = now - timedelta(minutes=2 * flaps)  # the last flap ends a minute ago
    for k in range(flaps):
        down, up = first + timedelta(minutes=2 * k), first + timedelta(minutes=2 * k + 1)
        alert("DeviceDegraded", "device_degraded", "warning", flapper, flapper, down,
              f"{flapper} degraded: error", None, resolved_at=up)
        for st, prev, at, reason in (("degraded", "online", down, "error"), ("online", "degraded", up, "data")):
            for f, v in (("device_id", flapper), ("status", st), ("previous_status", prev),
                         ("changed_at", at), ("reason", reason)):
                hist[f].append(v)
    write(settings, "device_status_history", hist, mode="append")
    write(settings, "alerts", pa.Table.from_pylist(rows, schema=SCHEMAS["alerts"]))
    write(settings, "alerts_current", pa.Table.from_pylist(current, schema=SCHEMAS["alerts_current"]))
    return {"offline": offline, "burst": burst, "flapper": flapper, "flaps": flaps,
            "open": len(current), "transitions": len(rows)}
