"""Alert delivery through a real Alertmanager, a real webhook receiver and a real Mosquitto.

The outbox is driven pass by pass (``deliver_due(now)``, ``now`` moved past the back-offs) or by
its thread; receivers count raw requests, so a duplicate or a reordering shows.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import sqlite3
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from alertmanager_fixture import Alertmanager, HttpReceiver
from conftest import TEST_MQTT_LOGIN
from prometheus_client import REGISTRY

from gold.alerts.channels import DeliveryError, MqttChannel, WebhookChannel, channels_for
from gold.alerts.notification import ZERO_TIME, Notification, rfc3339, webhook_body
from gold.alerts.outbox import Outbox
from lakehouse.settings import Settings, SettingsError, load_settings
from orchestration.services import free_port, mosquitto_service

_seq = iter(range(1, 1_000_000))


def make_settings(tmp_path: Path, mqtt_port: int = 0, **alerts) -> Settings:
    """Fast back-offs (the tests move ``now`` past them anyway), short timeouts."""
    return load_settings(
        environ={}, data_root=str(tmp_path / "lake"),
        mqtt={"host": "127.0.0.1", "port": mqtt_port or free_port(), **TEST_MQTT_LOGIN},
        alerts={"retry_seconds": 0.05, "retry_max_seconds": 0.4, "max_attempts": 20,
                "timeout_seconds": 2.0, **alerts})


def firing(tag: str) -> Notification:
    n = next(_seq)
    fp = hashlib.sha256(f"{tag}-{n}".encode()).hexdigest()[:16]
    return Notification(key=f"{fp}:firing:1", fingerprint=fp, status="firing",
                        labels={"alertname": "DeviceOffline", "severity": "warning",
                                "device_id": f"{tag}-{n}"},
                        annotations={"summary": f"{tag}-{n} is offline", "value": "130"},
                        starts_at=datetime.now(UTC) - timedelta(minutes=3))


def resolved(n: Notification) -> Notification:
    return replace(n, key=n.key.replace(":firing:", ":resolved:"), status="resolved",
                   ends_at=datetime.now(UTC))


def commit(outbox: Outbox, notes: list[Notification]) -> None:
    """As the engine does: the outbox rows inside the caller's own transaction."""
    conn = sqlite3.connect(outbox.path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    outbox.enqueue(conn, notes)
    conn.execute("COMMIT")
    conn.close()


def counted(channel: str, status: str) -> float:
    return REGISTRY.get_sample_value("iotlake_alert_notifications_total",
                                     {"channel": channel, "status": status}) or 0.0


@pytest.fixture
def receiver():
    rx = HttpReceiver()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def mqtt_port(tmp_path_factory):
    s = load_settings(environ={}, data_root=str(tmp_path_factory.mktemp("mosquitto")), mqtt=TEST_MQTT_LOGIN)
    broker = mosquitto_service(s, port=free_port()).start()
    yield broker.port
    broker.stop()


def test_webhook_gets_alertmanagers_format_signed_with_its_idempotency_key(tmp_path, receiver):
    receiver.start()
    s = make_settings(tmp_path, webhook_url=f"{receiver.url}/hook", webhook_secret="s3cret")
    outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
    f = firing("web")
    r = resolved(f)
    commit(outbox, [f])
    commit(outbox, [f, r])  # f again: its key is queued already
    assert outbox.counts() == {"webhook": {"pending": 2, "delivered": 0, "failed": 0}}

    assert outbox.deliver_due() == 2
    got = receiver.received("/hook")
    assert [q.headers["Idempotency-Key"] for q in got] == [f.key, r.key]
    for q, n in zip(got, (f, r), strict=True):
        assert q.headers["Content-Type"] == "application/json"
        assert q.headers["X-Iotlake-Signature"] == \
            "sha256=" + hmac.new(b"s3cret", q.body, hashlib.sha256).hexdigest()
        assert q.json() == webhook_body([n])
    first, second = (q.json() for q in got)
    assert {k: first[k] for k in ("version", "status", "receiver", "truncatedAlerts", "groupKey")} == {
        "version": "4", "status": "firing", "receiver": "iotlake", "truncatedAlerts": 0,
        "groupKey": '{}:{alertname="DeviceOffline", device_id="' + f.labels["device_id"]
                    + '", severity="warning"}'}
    assert first["groupLabels"] == first["commonLabels"] == f.labels
    assert first["commonAnnotations"] == f.annotations
    [a] = first["alerts"]
    assert a == {"status": "firing", "labels": f.labels, "annotations": f.annotations,
                 "startsAt": rfc3339(f.starts_at), "endsAt": ZERO_TIME, "generatorURL": "",
                 "fingerprint": f.fingerprint}
    assert second["status"] == second["alerts"][0]["status"] == "resolved"
    assert second["alerts"][0]["endsAt"] == rfc3339(r.ends_at)

    assert outbox.deliver_due() == 0
    assert len(receiver.received(ok=False)) == 2
    assert outbox.counts() == {"webhook": {"pending": 0, "delivered": 2, "failed": 0}}
    outbox.stop()


def test_enqueue_commits_with_the_callers_transaction(tmp_path):
    s = make_settings(tmp_path)
    outbox = Outbox(tmp_path / "alerts.sqlite", [WebhookChannel("http://127.0.0.1:1/x", 1.0)], s.alerts)
    conn = sqlite3.connect(outbox.path, isolation_level=None)
    outbox.init(conn)
    conn.execute("BEGIN IMMEDIATE")
    assert outbox.enqueue(conn, [firing("tx")]) == 1
    conn.execute("ROLLBACK")  # the engine's tick failed: its notifications go with it
    assert outbox.counts() == {"webhook": {"pending": 0, "delivered": 0, "failed": 0}}
    f = firing("tx")
    conn.execute("BEGIN IMMEDIATE")
    assert outbox.enqueue(conn, [f, f]) == 1
    conn.execute("COMMIT")
    assert outbox.counts() == {"webhook": {"pending": 1, "delivered": 0, "failed": 0}}
    conn.close()
    outbox.stop()


def _as_posted(body: dict) -> dict:
    """A webhook body without what differs by sender: its URL and its fingerprints."""
    body = {k: v for k, v in body.items() if k not in ("externalURL", "receiver")}
    body["alerts"] = [{k: v for k, v in a.items() if k != "fingerprint"} for a in body["alerts"]]
    return body


def _near(text: str, t: datetime) -> bool:
    return abs(datetime.fromisoformat(text) - t) < timedelta(milliseconds=1)


def test_alertmanager_shows_routes_and_resolves(tmp_path, receiver):
    receiver.start()
    with Alertmanager(tmp_path / "am", f"{receiver.url}/am") as am:
        s = make_settings(tmp_path, alertmanager_url=am.url, alertmanager_resend_seconds=30)
        outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
        f = firing("am")
        commit(outbox, [f])
        t0 = datetime.now(UTC)
        assert outbox.deliver_due() == 1

        [a] = am.wait_for_alerts(1, device_id=f.labels["device_id"])
        assert (a["labels"], a["annotations"], a["status"]["state"]) == (f.labels, f.annotations, "active")
        assert _near(a["startsAt"], f.starts_at)
        # valid four re-posts from now, as Prometheus posts its alerts
        assert t0 + timedelta(seconds=119) < datetime.fromisoformat(a["endsAt"]) < t0 + timedelta(seconds=125)
        [sent] = receiver.wait_for(1, "/am")  # Alertmanager routed it to its receiver
        assert _as_posted(sent.json()) == _as_posted(webhook_body([f]))

        r = resolved(f)
        commit(outbox, [r])
        assert outbox.deliver_due() == 1
        am.wait_for_alerts(0, device_id=f.labels["device_id"])
        [_, done] = receiver.wait_for(2, "/am")
        assert _as_posted(done.json()) == _as_posted(webhook_body([r]))
        assert done.json()["alerts"][0]["endsAt"] == rfc3339(r.ends_at)
        outbox.stop()


def test_firing_alerts_are_posted_again_until_resolved(tmp_path, receiver):
    """Alertmanager drops an alert its sender stopped posting, and keeps none across its own
    restart: the outbox posts every firing alert again each resend period."""
    receiver.start()
    with Alertmanager(tmp_path / "am", f"{receiver.url}/am") as am:
        s = make_settings(tmp_path, alertmanager_url=am.url, alertmanager_resend_seconds=30)
        outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
        f1, f2 = firing("rp"), firing("rp")
        commit(outbox, [f1, f2])
        now = time.time()
        assert outbox.deliver_due(now) == 2
        am.wait_for_alerts(2, alertname="DeviceOffline")
        resent = counted("alertmanager", "resent")

        assert outbox.deliver_due(now + 10) == 0  # not due yet
        assert counted("alertmanager", "resent") == resent
        am.restart()
        assert am.alerts() == []
        assert outbox.deliver_due(now + 31) == 0
        assert counted("alertmanager", "resent") == resent + 2
        got = am.wait_for_alerts(2, alertname="DeviceOffline")
        assert sorted(a["labels"]["device_id"] for a in got) == sorted(
            n.labels["device_id"] for n in (f1, f2))

        commit(outbox, [resolved(f1)])
        assert outbox.deliver_due(now + 32) == 1
        [a] = am.wait_for_alerts(1, alertname="DeviceOffline")
        assert a["labels"] == f2.labels
        assert outbox.deliver_due(now + 62) == 0  # only f2 still fires
        assert counted("alertmanager", "resent") == resent + 3
        assert outbox.deliver_due(now + 63) == 0
        assert counted("alertmanager", "resent") == resent + 3
        outbox.stop()


def test_an_alert_alertmanager_refuses_is_not_posted_again(tmp_path, caplog):
    """Alertmanager stores the valid alerts of a request and answers 400 for the others: the
    re-post of a refused alert would fail every period, and take the others' along."""
    with Alertmanager(tmp_path / "am", "http://127.0.0.1:1/unused") as am:
        s = make_settings(tmp_path, alertmanager_url=am.url, alertmanager_resend_seconds=30,
                          max_attempts=1)
        outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
        good, bad = firing("ok"), firing("refused")
        bad = replace(bad, labels={**bad.labels, "bad-label": "x"})  # not a Prometheus label name
        commit(outbox, [good, bad])
        now = time.time()
        assert outbox.deliver_due(now) == 1
        assert outbox.counts()["alertmanager"] == {"pending": 0, "delivered": 1, "failed": 1}
        resent = counted("alertmanager", "resent")
        with caplog.at_level(logging.WARNING, logger="gold.alerts.outbox"):
            outbox.deliver_due(now + 31)
            outbox.deliver_due(now + 62)
        assert counted("alertmanager", "resent") == resent + 2  # the good one, twice
        refused = [r for r in caplog.records if "not posted again" in r.getMessage()]
        assert len(refused) == 1 and bad.key in refused[0].getMessage()
        [a] = am.alerts()
        assert a["labels"] == good.labels
        outbox.stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_mqtt_subscriber_gets_the_json_at_qos1(tmp_path, mqtt_port, protocol):
    topic = f"iotlake/alerts/{next(_seq)}"
    got: list[mqtt.MQTTMessage] = []
    subscribed = threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"alerts-sub-{next(_seq)}",
                      protocol=mqtt.MQTTv5 if protocol == "5" else mqtt.MQTTv311)
    sub.username_pw_set(TEST_MQTT_LOGIN["username"], TEST_MQTT_LOGIN["password"])
    sub.on_message = lambda c, u, m: got.append(m)
    sub.on_subscribe = lambda c, u, mid, rc, p: subscribed.set()
    sub.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, qos=1)
    sub.connect("127.0.0.1", mqtt_port)
    sub.loop_start()
    try:
        assert subscribed.wait(10)
        s = make_settings(tmp_path, mqtt_port, mqtt_topic=topic)
        s.mqtt.protocol = protocol
        [channel] = channels_for(s)
        assert isinstance(channel, MqttChannel)
        outbox = Outbox(tmp_path / "alerts.sqlite", [channel], s.alerts)
        f = firing("mq")
        r = resolved(f)
        commit(outbox, [f, r])
        assert outbox.deliver_due() == 2
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [json.loads(m.payload) for m in got] == [webhook_body([f]), webhook_body([r])]
        assert [(m.topic, m.qos) for m in got] == [(topic, 1), (topic, 1)]
        if protocol == "5":  # the key as the webhook's header has it
            assert [m.properties.UserProperty for m in got] == [[("Idempotency-Key", f.key)],
                                                                [("Idempotency-Key", r.key)]]
        outbox.stop()
    finally:
        sub.disconnect()
        sub.loop_stop()

    nobody = MqttChannel(make_settings(tmp_path), topic, timeout=0.5)  # no broker on its port
    with pytest.raises(DeliveryError, match="not connected"):
        nobody.send(firing("mq"))
    nobody.close()


def test_receiver_down_then_back_gets_everything_once_in_order(tmp_path, receiver):
    s = make_settings(tmp_path, webhook_url=f"{receiver.url}/hook")
    outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
    f0, f1, f2 = firing("down"), firing("down"), firing("down")
    ticks = [[f0, f1], [resolved(f0), f2], [resolved(f1)], [resolved(f2)]]
    for notes in ticks:
        commit(outbox, notes)
    order = [n.key for notes in ticks for n in notes]
    retried = counted("webhook", "retried")
    now = time.time()
    for k in range(5):  # nothing listens: one attempt per pass, then the channel waits
        assert outbox.deliver_due(now + k * 100) == 0
    assert counted("webhook", "retried") == retried + 5
    assert outbox.counts()["webhook"] == {"pending": 6, "delivered": 0, "failed": 0}

    receiver.start()  # back, but answering 503 twice first
    receiver.answer(lambda path, headers, body: 503 if len(receiver.requests) < 2 else 200)
    assert sum(outbox.deliver_due(now + 1000 + k * 100) for k in range(4)) == 6
    assert len(receiver.received(ok=False)) == 8  # 2 answered 503, then each notification once
    assert [q.headers["Idempotency-Key"] for q in receiver.received()] == order
    assert outbox.counts()["webhook"] == {"pending": 0, "delivered": 6, "failed": 0}
    outbox.stop()


def test_a_new_outbox_on_the_file_delivers_what_was_pending(tmp_path, receiver):
    s = make_settings(tmp_path, webhook_url=f"{receiver.url}/hook")
    path = tmp_path / "alerts.sqlite"
    first = Outbox(path, channels_for(s), s.alerts)
    before = [firing("restart"), firing("restart")]
    before += [resolved(n) for n in before]
    commit(first, before)
    assert first.deliver_due() == 0  # the receiver is down
    first.stop()  # the process ends

    receiver.start()
    second = Outbox(path, channels_for(s), s.alerts).start()
    receiver.wait_for(4)
    after = [firing("restart")]
    commit(second, after)
    second.kick()
    receiver.wait_for(5)
    second.stop()
    assert [q.headers["Idempotency-Key"] for q in receiver.received(ok=False)] == \
        [n.key for n in before + after]
    assert second.counts()["webhook"] == {"pending": 0, "delivered": 5, "failed": 0}


def test_a_refused_notification_is_kept_failed_after_max_attempts(tmp_path, receiver, caplog):
    receiver.start()
    s = make_settings(tmp_path, webhook_url=f"{receiver.url}/hook", max_attempts=3)
    outbox = Outbox(tmp_path / "alerts.sqlite", channels_for(s), s.alerts)
    bad, good = firing("bad"), firing("good")
    receiver.answer(lambda path, headers, body: 400 if headers["Idempotency-Key"] == bad.key else 200)
    commit(outbox, [bad, good, resolved(bad)])
    failed, retried = counted("webhook", "failed"), counted("webhook", "retried")
    now = time.time()
    with caplog.at_level(logging.WARNING, logger="gold.alerts.outbox"):
        # refused (4xx): the others still go, the refused alert's resolution waits for it
        assert outbox.deliver_due(now) == 1
        assert outbox.deliver_due(now + 100) == 0
        assert outbox.deliver_due(now + 200) == 0  # third refusal: given up
        assert outbox.deliver_due(now + 300) == 1  # then its resolution goes
        assert outbox.deliver_due(now + 400) == 0
    assert [q.headers["Idempotency-Key"] for q in receiver.received(ok=False)] == \
        [bad.key, good.key, bad.key, bad.key, resolved(bad).key]
    assert outbox.counts()["webhook"] == {"pending": 0, "delivered": 2, "failed": 1}
    assert counted("webhook", "failed") == failed + 1
    assert counted("webhook", "retried") == retried + 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and bad.key in errors[0].getMessage()

    receiver.answer(200)  # the receiver fixed: an operator sends it again
    assert outbox.retry_failed() == 1
    assert outbox.deliver_due(now + 500) == 1
    assert outbox.counts()["webhook"] == {"pending": 0, "delivered": 3, "failed": 0}
    outbox.stop()


@pytest.mark.parametrize(("alerts", "message"), [
    ({"webhook_url": "hooks.example.com/iotlake"}, "alerts.webhook_url: 'hooks.example.com/iotlake' "
                                                   "is not an http(s) URL"),
    ({"alertmanager_url": "127.0.0.1:9093"}, "alerts.alertmanager_url: '127.0.0.1:9093' is not an "
                                             "http(s) URL (e.g. http://127.0.0.1:9093)"),
    ({"mqtt_topic": "iotlake/alerts/#"}, "alerts.mqtt_topic: 'iotlake/alerts/#' is not a topic to publish to"),
])
def test_a_bad_receiver_setting_fails_fast(tmp_path, alerts, message):
    with pytest.raises(SettingsError) as e:
        channels_for(make_settings(tmp_path, **alerts))
    assert str(e.value).startswith(message)
