"""Simulator: exact counts per kind, deterministic bytes, simulated clock, real publish."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import paho.mqtt.client as mqtt
import pytest
from fleets import SENSOR

from ingest.mqtt_client import mqtt_client
from ingest.simulator import format_ts, generate, publish

START = datetime(2026, 11, 21, 22, 30, 0, 123000, tzinfo=UTC)


def _parse(m):
    try:
        return json.loads(m.payload)
    except ValueError:
        return None


def test_counts_and_kinds(settings):
    msgs = generate(settings, 1000, devices=7, duplicates=50, malformed=30, late=20, seed=3, start=START)
    assert len(msgs) == 1000
    assert Counter(m.kind for m in msgs) == {"valid": 900, "duplicate": 50, "malformed": 30, "late": 20}
    readings = [m for m in msgs if m.kind in ("valid", "late")]
    assert len({m.event_id for m in readings}) == 920  # unique valid readings
    seen: dict[str, bytes] = {}
    for m in msgs:
        if m.kind in ("valid", "late"):
            seen[m.event_id] = m.payload
        elif m.kind == "duplicate":  # exact re-send of an earlier reading
            assert seen[m.event_id] == m.payload
    flt = settings.mqtt.topic_filter
    assert all(mqtt.topic_matches_sub(flt, m.topic) for m in msgs)
    for m in msgs:
        if m.kind == "malformed":
            rec = _parse(m)
            assert rec is None or "event_id" not in rec or "ts" not in rec
            assert m.event_id == (rec or {}).get("event_id")
    assert {(_parse(m) is None, m.event_id is None) for m in msgs if m.kind == "malformed"} >= {(True, True), (False, True)}


def test_simulated_clock_and_payload(settings):
    msgs = generate(settings, 300, devices=3, late=30, seed=5, start=START, rate=30.0)
    per_device: Counter[str] = Counter()
    interval = timedelta(seconds=3 / 30.0)
    for m in msgs:
        rec = json.loads(m.payload)
        assert set(rec) == {"schema_version", "device_id", "event_id", "ts", "temperature",
                            "humidity", "battery", "status"}
        assert rec["schema_version"] == 1 and len(rec["event_id"]) == 32
        assert m.topic == settings.mqtt.topic_filter.replace("+", rec["device_id"])
        assert 0.0 <= rec["battery"] <= 100.0 and rec["status"] in ("ok", "error")
        k = per_device[rec["device_id"]]
        per_device[rec["device_id"]] += 1
        expected = START + k * interval
        ts = datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        if m.kind == "valid":
            assert rec["ts"] == format_ts(expected)
        else:
            assert timedelta(minutes=1) <= expected - ts <= timedelta(minutes=5)
    assert sorted(per_device) == ["dev-00001", "dev-00002", "dev-00003"]
    assert set(per_device.values()) == {100}


def test_deterministic(settings):
    a = generate(settings, 500, duplicates=10, malformed=10, late=10, seed=42, start=START)
    b = generate(settings, 500, duplicates=10, malformed=10, late=10, seed=42, start=START)
    c = generate(settings, 500, duplicates=10, malformed=10, late=10, seed=43, start=START)
    assert a == b
    assert [m.payload for m in a] != [m.payload for m in c]


def test_bad_arguments(settings):
    with pytest.raises(ValueError):
        generate(settings, 10, duplicates=6, malformed=5)
    with pytest.raises(ValueError):
        generate(settings, 5, duplicates=5)


def test_publish_reaches_broker(settings):
    msgs = generate(settings, 3000, devices=5, seed=1, start=START)
    got: list[bytes] = []
    done = threading.Event()
    sub = mqtt_client(settings, f"{settings.mqtt.client_id}-sub")
    subscribed = threading.Event()
    sub.on_subscribe = lambda *a: subscribed.set()

    def on_message(c, u, m):
        got.append(m.payload)
        if len(got) >= len(msgs):
            done.set()

    sub.on_message = on_message
    sub.connect(*settings.mqtt_endpoint)
    sub.subscribe(settings.mqtt.topic_filter, qos=1)
    sub.loop_start()
    try:
        assert subscribed.wait(10)
        assert publish(settings, msgs, max_inflight=200) == 3000
        assert done.wait(20)
    finally:
        sub.disconnect()
        sub.loop_stop()
    assert Counter(got) == Counter(m.payload for m in msgs)


def test_a_stalled_broker_does_not_keep_a_stopped_simulator_running(settings) -> None:
    """Mosquitto frozen (SIGSTOP) acknowledges nothing: the in-flight window fills and the
    publisher waits for a slot; a stop must still end the run, with what was sent counted."""
    import os
    import signal
    import time

    from ingest.simulator import run_forever
    from lakehouse.settings import load_settings
    from orchestration.services import free_port, mosquitto_service

    port = free_port()
    s = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=settings.data_root,
                      mqtt={"host": "127.0.0.1", "port": port, "topic_filter": "stall/devices/+/telemetry",
                            "username": settings.mqtt.username, "password": settings.mqtt.password})
    broker = mosquitto_service(s, port).start()
    stop, result = threading.Event(), []
    try:
        runner = threading.Thread(target=lambda: result.append(
            run_forever(s, 5000, 10, stop, drain_seconds=1.0)), daemon=True)
        runner.start()
        time.sleep(0.5)
        os.kill(broker.proc.pid, signal.SIGSTOP)
        time.sleep(2.0)  # > the 1,000 slots at 5,000 msg/s: the publisher now waits for acks
        stop.set()
        t0 = time.monotonic()
        runner.join(10)
        assert not runner.is_alive(), "the simulator did not stop while the broker was stalled"
        assert time.monotonic() - t0 < 5
        assert result and result[0] >= 1000  # the in-flight window was filled
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
        broker.stop()
