"""The alert engine's lifecycle on real inputs: a ``device_current`` Delta table, silver-shaped
Arrow batches and status snapshots, its SQLite state file and outbox, across restarts."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from alertmanager_fixture import HttpReceiver
from deltalake import write_deltalake

from gold.alerts import store
from gold.alerts.channels import WebhookChannel
from gold.alerts.engine import AlertEngine
from gold.alerts.outbox import Outbox
from lakehouse.settings import load_settings

T0 = 1_800_000_000.0  # a wall clock the tests drive


def _settings(tmp_path, **alerts):
    rules = alerts.pop("rules", None)
    cfg = {"rules": rules} if rules is not None else {}
    return load_settings(environ={}, data_root=str(tmp_path / "data"),
                         telemetry={"topic_pattern": "plant/{site}/{device_id}/telemetry",
                                    "device_id_path": "", "event_id_path": "",
                                    "event_time_path": "ts", "event_time_format": "epoch_s",
                                    "metrics": [{"name": "pressure", "path": "p"}]},
                         alerts={**cfg, "renotify_seconds": 0, **alerts})


def _devices(settings, rows):
    ts = pa.timestamp("us", tz="UTC")
    t = pa.table({
        "device_id": [r[0] for r in rows], "status": [r[1] for r in rows],
        "status_reason": [r[2] for r in rows], "site": [r[3] for r in rows],
        "last_received": pa.array([datetime.fromtimestamp(r[4], UTC) for r in rows], ts),
    })
    write_deltalake(settings.table_path("device_current"), t, mode="overwrite")


def _readings(device, site, times, values, received):
    ts = pa.timestamp("us", tz="UTC")
    return pa.table({
        "device_id": [device] * len(times), "site": [site] * len(times),
        "event_time": pa.array([datetime.fromtimestamp(t, UTC) for t in times], ts),
        "pressure": pa.array(values, pa.float64()),
        "ingest_time": pa.array([datetime.fromtimestamp(received, UTC)] * len(times), ts),
    })


@pytest.fixture
def receiver():
    r = HttpReceiver().start()
    yield r
    r.stop()


def _engine(settings, snapshot=None, receiver=None):
    channels = [WebhookChannel(receiver.url, 2.0)] if receiver is not None else []
    outbox = Outbox(store.db_path(settings), channels, settings.alerts)
    return AlertEngine(settings, outbox, (lambda: snapshot) if snapshot is not None else None)


def _delivered(engine, receiver) -> list[tuple[str, str]]:
    """(status, subject label) of every alert the receiver got, after a delivery pass."""
    engine.outbox.deliver_due()
    out = []
    for req in receiver.requests:
        for a in json.loads(req.body)["alerts"]:
            out.append((a["status"], a["labels"].get("device_id") or a["labels"].get("site")
                        or a["labels"].get("query")))
    return out


def test_device_offline_fires_once_and_resolves_across_restart(tmp_path, receiver):
    s = _settings(tmp_path)
    _devices(s, [("d1", "online", "data", "north", T0), ("d2", "online", "data", "north", T0)])
    e = _engine(s, receiver=receiver)
    assert e.tick(T0 + 1) == []
    _devices(s, [("d1", "offline", "no_data", "north", T0), ("d2", "online", "data", "north", T0 + 100)])
    rows = e.tick(T0 + 130)
    assert [(r["rule"], r["subject"], r["transition"]) for r in rows] == [("DeviceOffline", "d1", "firing")]
    assert e.tick(T0 + 131) == []  # still offline: no second alert
    assert _delivered(e, receiver) == [("firing", "d1")]
    e.close()
    e = _engine(s, receiver=receiver)  # a restart while firing: the alert stays open, nothing new
    assert e.tick(T0 + 132) == []
    assert _delivered(e, receiver) == [("firing", "d1")]
    assert [a.subject for a in e.open.values()] == ["d1"]
    _devices(s, [("d1", "online", "data", "north", T0 + 140), ("d2", "online", "data", "north", T0 + 140)])
    rows = e.tick(T0 + 141)
    assert [(r["subject"], r["transition"]) for r in rows] == [("d1", "resolved")]
    assert e.open == {}
    assert _delivered(e, receiver) == [("firing", "d1"), ("resolved", "d1")]
    log = [json.loads(r[0]) for r in e.conn.execute("SELECT rows FROM alerts_log ORDER BY seq")]
    assert [[x["transition"] for x in entry] for entry in log] == [["firing"], ["resolved"]]


def test_site_silent_by_wall_clock(tmp_path):
    s = _settings(tmp_path, rules=[{"name": "SiteSilent", "kind": "site_silent", "silent_seconds": 60}])
    _devices(s, [("d1", "online", "data", "north", T0), ("d2", "online", "data", "south", T0 + 50)])
    e = _engine(s)
    assert e.tick(T0 + 59) == []
    rows = e.tick(T0 + 61)
    assert [(r["subject"], r["transition"]) for r in rows] == [("north", "firing")]
    e.observe_readings(_readings("d1", "north", [T0 + 100], [4.0], T0 + 100))
    rows = e.tick(T0 + 111)
    assert [(r["subject"], r["transition"]) for r in rows] == [("north", "resolved")]
    # while batches arrive a site is judged by the latest reception they carry, not the wall clock
    e.observe_readings(_readings("d1", "north", [T0 + 150], [4.0], T0 + 150))
    rows = e.tick(T0 + 200)  # a late batch (received at +150): south's 100 s, north's none
    assert [(r["subject"], r["transition"]) for r in rows] == [("south", "firing")]
    rows = e.tick(T0 + 261)  # nothing arrived for the bound: the wall clock again
    assert [(r["subject"], r["transition"]) for r in rows] == [("north", "firing")]


def test_a_site_is_late_not_silent_while_kafka_holds_records(tmp_path):
    """Records waiting in Kafka (a saturated machine between batches): the site is judged by
    the batches' latest reception, so it does not fire, resolve and fire again."""
    s = _settings(tmp_path, rules=[{"name": "SiteSilent", "kind": "site_silent", "silent_seconds": 60}])
    query = {"active": True, "in_batch": False, "lag": 500, "source": "kafka",
             "last_progress_age_s": 1.0, "last_batch_age_s": 1.0}
    snap = {"queries": {"bronze_silver": query}}
    e = _engine(s, snapshot=snap)
    e.observe_readings(_readings("d1", "north", [T0], [4.0], T0))
    assert e.tick(T0 + 1) == []  # the batch arrives
    assert e.tick(T0 + 100) == []  # 100 s since the last batch, but 500 records still in Kafka
    query["lag"] = 0
    rows = e.tick(T0 + 101)  # nothing owed and nothing arrived for the bound: silent
    assert [(r["subject"], r["transition"]) for r in rows] == [("north", "firing")]


def test_threshold_for_a_duration_is_one_alert_however_batched(tmp_path):
    rule = {"name": "HighPressure", "kind": "threshold", "metric": "pressure", "above": 10.0,
            "for_seconds": 5, "severity": "critical", "labels": {"team": "ops"}}
    outcomes = []
    for split in (1, 3, 10):
        s = _settings(tmp_path / str(split), rules=[rule])
        e = _engine(s)
        times = [T0 + i for i in range(20)]
        values = [5.0] * 5 + [12.0] * 8 + [5.0] * 7  # breach from t+5 to t+12: 7 s >= 5 s
        rows = []
        for i in range(0, 20, split):
            e.observe_readings(_readings("d1", "north", times[i:i + split], values[i:i + split], T0))
            rows += e.tick(T0 + 21)
        outcomes.append([(r["transition"], r["value"]) for r in rows])
        labels = json.loads(rows[0]["labels"])
        assert labels == {"alertname": "HighPressure", "device_id": "d1", "metric": "pressure",
                          "severity": "critical", "site": "north", "team": "ops"}
    assert outcomes[0] == outcomes[1] == outcomes[2] == [("firing", 12.0), ("resolved", 12.0)]


def test_short_breach_and_old_readings_do_not_fire(tmp_path):
    rule = {"name": "HighPressure", "kind": "threshold", "metric": "pressure", "above": 10.0, "for_seconds": 5}
    s = _settings(tmp_path, rules=[rule])
    e = _engine(s)
    e.observe_readings(_readings("d1", "north", [T0, T0 + 1, T0 + 2], [12.0, 12.0, 5.0], T0))  # 1 s
    assert e.tick(T0 + 3) == []
    # a backfill's (or catch-up's) readings from an hour ago: past, never alerted on
    e.observe_readings(_readings("d2", "north", [T0 - 3600 + i for i in range(30)], [50.0] * 30, T0))
    assert e.tick(T0 + 4) == []


def test_pipeline_stale_and_silence_and_ack(tmp_path, receiver):
    snap = {"queries": {"gold_health": {"active": True, "last_progress_age_s": 1.0}}}
    s = _settings(tmp_path, rules=[{"name": "PipelineStale", "kind": "pipeline_stale", "stale_seconds": 30},
                                   {"name": "DeviceOffline", "kind": "device_offline"}],
                  renotify_seconds=60)
    _devices(s, [("d1", "offline", "no_data", "north", T0), ("d2", "offline", "no_data", "south", T0)])
    conn = store.connect(store.db_path(s))
    with store.transaction(conn):
        store.add_silence(conn, until=T0 + 10_000, device_id="d2")
    e = _engine(s, snap, receiver)
    rows = e.tick(T0)
    assert sorted((r["subject"], r["transition"]) for r in rows) == [("d1", "firing"), ("d2", "firing")]
    assert {a.subject: a.silenced for a in e.open.values()} == {"d1": False, "d2": True}
    assert _delivered(e, receiver) == [("firing", "d1")]  # d2 is silenced
    snap["queries"]["gold_health"]["last_progress_age_s"] = 45.0
    rows = e.tick(T0 + 1)
    assert [(r["rule"], r["subject"]) for r in rows] == [("PipelineStale", "gold_health")]
    d1 = next(a for a in e.open.values() if a.subject == "d1")
    with store.transaction(conn):
        store.request_ack(conn, d1.alert_id, "ops")
    rows = e.tick(T0 + 2)
    assert [(r["subject"], r["transition"]) for r in rows] == [("d1", "acknowledged")]
    e.tick(T0 + 100)  # past renotify_seconds: the unacknowledged stale query again, not d1
    assert _delivered(e, receiver) == [("firing", "d1"), ("firing", "gold_health"), ("firing", "gold_health")]
    with store.transaction(conn):
        store.end_silence(conn, next(x.id for x in store.silences(conn, T0)))
    e.tick(T0 + 101)  # the silence ended while d2 is still offline: notified now
    assert _delivered(e, receiver)[-1] == ("firing", "d2")


@pytest.mark.parametrize("bad", [
    {"name": "x", "kind": "threshold", "metric": "nope", "above": 1},
    {"name": "x", "kind": "anomaly", "metric": "nope", "above": 0.9},
])
def test_rule_with_unknown_metric_fails_naming_the_key(tmp_path, bad):
    from lakehouse.settings import SettingsError

    with pytest.raises(SettingsError, match=r"alerts\.rules\[0\]\.metric: unknown metric 'nope'"):
        _settings(tmp_path, rules=[bad])
