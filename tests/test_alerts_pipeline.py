"""Alerts end to end: ``iotlake run`` (a real process on the session's Mosquitto and Kafka), a
real webhook receiver, devices that publish, breach, fall silent and come back.

One scenario, in order (each phase needs the one before; a pipeline start costs most):
a threshold held ``for_seconds`` is one incident, fired and resolved; a device's old readings
(a backlog) never fire; the whole fleet falls silent: every device offline and every site
silent within ``offline_after_seconds`` + 10 s, while the receiver is down and across a restart
of ``iotlake run``; when the receiver is back each notification arrives exactly once and the
silenced device's never; data again resolves them. The ``alerts`` table holds each transition
once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alertmanager_fixture import HttpReceiver
from conftest import TEST_MQTT_LOGIN, TEST_MQTT_PORT
from deltalake import DeltaTable
from fleets import SENSOR

from ingest.mqtt_client import mqtt_client
from lakehouse.kafka.topics import ensure_topics
from lakehouse.settings import load_settings

OFFLINE = 12  # gold.offline_after_seconds (and the sites' silent_seconds)


def _payload(device: str, temperature: float, when: datetime | None = None) -> bytes:
    ts = (when or datetime.now(UTC)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps({"schema_version": 1, "device_id": device, "event_id": uuid.uuid4().hex,
                       "ts": ts, "temperature": temperature, "humidity": 40.0, "battery": 90.0,
                       "status": "ok"}).encode()


class Fleet:
    """Devices publishing every half second from a thread; ``hot`` ones above the threshold."""

    def __init__(self, settings, prefix: str, devices: dict[str, str]) -> None:
        self.prefix, self.devices = prefix, devices  # device -> site
        self.hot: set[str] = set()
        self.on = threading.Event()
        self.stop = threading.Event()
        self.last = 0.0
        self.client = mqtt_client(settings, client_id=f"fleet-{uuid.uuid4().hex[:6]}")
        self.client.username_pw_set(TEST_MQTT_LOGIN["username"], TEST_MQTT_LOGIN["password"])
        self.client.connect("127.0.0.1", TEST_MQTT_PORT)
        self.client.loop_start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def topic(self, device: str) -> str:
        return f"{self.prefix}/{self.devices.get(device, 'north')}/{device}/telemetry"

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.on.is_set():
                for d in self.devices:
                    self.client.publish(self.topic(d), _payload(d, 80.0 if d in self.hot else 21.0), qos=1)
                self.last = time.time()
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.loop_stop()
        self.client.disconnect()


def _alerts(receiver: HttpReceiver, ok_only: bool = True) -> list[tuple[str, str, str, str]]:
    """(alertname, status, subject, idempotency key) of every alert the receiver accepted."""
    out = []
    for r in list(receiver.requests):
        if ok_only and r.status != 200:
            continue
        for a in json.loads(r.body)["alerts"]:
            subject = a["labels"].get("device_id") or a["labels"].get("site") or a["labels"].get("query")
            out.append((a["labels"]["alertname"], a["status"], subject, r.headers.get("Idempotency-Key")))
    return out


def _wait(pred, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text(errors='replace')[-4000:]}")


def _start(cmd, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def _stop(p: subprocess.Popen, log: Path) -> None:
    p.send_signal(signal.SIGINT)
    try:
        assert p.wait(120) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def receiver():
    r = HttpReceiver().start()
    yield r
    r.stop()


def test_silence_threshold_restart_and_a_receiver_down(brokers, services_settings, tmp_path, receiver):
    n = uuid.uuid4().hex[:8]
    prefix = f"a{n}"
    config = tmp_path / "iotlake.json"
    config.write_text(json.dumps({
        "data_root": str(tmp_path / "lake"),
        "telemetry": {**SENSOR.model_dump(mode="json"), "topic_pattern": prefix + "/{site}/{device_id}/telemetry"},
        "kafka": {"bootstrap": services_settings.kafka_bootstrap, "topic": f"alerts-{n}",
                  "dead_letter_topic": f"alerts-dlq-{n}", "partitions": 2},
        "mqtt": {"host": "127.0.0.1", "port": TEST_MQTT_PORT, "client_id": f"bridge-{n}", **TEST_MQTT_LOGIN},
        "spark": {"master": "local[2]", "shuffle_partitions": 2},
        "stream": {"trigger_seconds": 1.0, "graceful_stop_seconds": 120},
        "gold": {"offline_after_seconds": OFFLINE},
        "observability": {"metrics_port": 0},
        "maintenance": {"auto": False},
        "alerts": {"webhook_url": receiver.url, "evaluate_seconds": 0.5, "retry_seconds": 0.5,
                   "max_age_seconds": 120,
                   "retry_max_seconds": 2.0, "rules": [
                       {"name": "DeviceOffline", "kind": "device_offline"},
                       {"name": "SiteSilent", "kind": "site_silent", "severity": "critical"},
                       {"name": "HighTemperature", "kind": "threshold", "metric": "temperature",
                        "above": 60.0, "for_seconds": 2}]},
    }))
    settings = load_settings(config, environ={})
    ensure_topics(settings)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}, "IOTLAKE_CONFIG": str(config)}
    cli = [sys.executable, "-m", "orchestration.cli"]
    silenced = subprocess.run([*cli, "alerts", "silence", "--device", "d3", "--for", "1h"], env=env,
                              capture_output=True, text=True)
    assert silenced.returncode == 0, silenced.stderr
    log = tmp_path / "run.log"
    fleet = Fleet(settings, prefix, {"d1": "north", "d2": "north", "d3": "south"})
    run = _start([*cli, "run"], env, log)
    try:
        fleet.on.set()
        _wait(lambda: Path(settings.table_path("device_current"), "_delta_log").exists(), 240,
              "gold's first batch", log)
        # a backlog: d4's readings from four minutes ago (older than alerts.max_age_seconds, within
        # silver's watermark), far above the threshold: the past, no alert
        for i in range(6):
            fleet.client.publish(fleet.topic("d4"), _payload(
                "d4", 95.0, datetime.now(UTC) - timedelta(minutes=4) + timedelta(seconds=i)), qos=1)
        # a breach held 3 s (>= for_seconds 2): one incident, then resolved
        fleet.hot.add("d1")
        _wait(lambda: ("HighTemperature", "firing", "d1") in [a[:3] for a in _alerts(receiver)], 60,
              "the threshold alert", log)
        fleet.hot.clear()
        _wait(lambda: ("HighTemperature", "resolved", "d1") in [a[:3] for a in _alerts(receiver)], 60,
              "the threshold alert's resolution", log)

        # the whole fleet falls silent while the receiver is down, and iotlake run restarts
        receiver.answer(503)
        fleet.on.clear()
        silent_at = fleet.last
        time.sleep(OFFLINE + 12)
        _stop(run, log)
        run = _start([*cli, "run"], env, log)
        receiver.answer(200)
        expected = {("DeviceOffline", "d1"), ("DeviceOffline", "d2"), ("SiteSilent", "north"),
                    ("SiteSilent", "south")}
        _wait(lambda: expected <= {(a[0], a[2]) for a in _alerts(receiver) if a[1] == "firing"}, 120,
              "the offline and silent-site notifications", log)
        fired = DeltaTable(settings.table_path("alerts")).to_pyarrow_table(
            columns=["rule", "subject", "transition", "changed_at"]).to_pylist()
        when = {(r["rule"], r["subject"]): r["changed_at"].timestamp() for r in fired if r["transition"] == "firing"}
        for key in expected | {("DeviceOffline", "d3")}:
            assert when[key] - silent_at <= OFFLINE + 10, (key, when[key] - silent_at)

        # data again: resolved
        fleet.on.set()
        _wait(lambda: {("DeviceOffline", "d1"), ("DeviceOffline", "d2"), ("SiteSilent", "north")}
              <= {(a[0], a[2]) for a in _alerts(receiver) if a[1] == "resolved"}, 120, "the resolutions", log)
        fleet.on.clear()
        time.sleep(2)
    finally:
        fleet.close()
        if run.poll() is None:
            _stop(run, log)

    got = _alerts(receiver)
    keys = Counter(a[3] for a in got)
    assert [k for k, c in keys.items() if c > 1] == []  # each notification accepted once
    firing = Counter((a[0], a[2]) for a in got if a[1] == "firing")
    assert firing[("HighTemperature", "d1")] == 1
    assert firing[("DeviceOffline", "d1")] == firing[("DeviceOffline", "d2")] == 1
    assert firing[("SiteSilent", "north")] == firing[("SiteSilent", "south")] == 1
    assert not [a for a in got if a[2] == "d3"]  # silenced
    assert not [a for a in got if a[2] == "d4" and a[0] == "HighTemperature"]  # the past
    rows = DeltaTable(settings.table_path("alerts")).to_pyarrow_table(
        columns=["alert_id", "transition"]).to_pylist()
    per = Counter((r["alert_id"], r["transition"]) for r in rows)
    assert max(per.values()) == 1, per
    assert not [r for r in rows if r["transition"] not in ("firing", "resolved", "acknowledged")]
