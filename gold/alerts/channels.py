"""Receivers of notifications: Alertmanager, a webhook, an MQTT topic.

Each channel's ``send`` delivers one notification or raises (the outbox retries it): a
non-2xx answer, a timeout, no PUBACK. ``Rejected`` means the receiver answered and refused this
notification (HTTP 4xx), so other notifications can still go; any other error means the
receiver is unavailable, and the outbox waits before trying it again at all.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Protocol
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
import requests
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gold.alerts.notification import Notification, rfc3339, webhook_body
from ingest.mqtt_client import mqtt_client
from lakehouse.settings import AlertsSettings, Settings, SettingsError

log = logging.getLogger(__name__)

#: A firing alert posted to Alertmanager is valid this many re-post periods (its ``endsAt``),
#: as Prometheus does (4 x its resend delay): a sender that stopped lets the alert expire.
ALERTMANAGER_VALID_PERIODS = 4


class DeliveryError(RuntimeError):
    """The receiver did not take the notification (unreachable, timed out, 5xx, no PUBACK)."""


class Rejected(DeliveryError):
    """The receiver answered and refused this notification (4xx other than 408/429)."""


class Channel(Protocol):
    """``resend_seconds``: re-post firing alerts this often while they fire (None: never)."""

    name: str
    resend_seconds: float | None

    def send(self, n: Notification) -> None: ...

    def close(self) -> None: ...


def _post(session: requests.Session, url: str, body: bytes, headers: dict[str, str],
          timeout: float) -> None:
    try:
        r = session.post(url, data=body, headers=headers, timeout=timeout)
    except requests.RequestException as e:
        raise DeliveryError(f"POST {url}: {e}") from e
    if 200 <= r.status_code < 300:
        return
    error = Rejected if 400 <= r.status_code < 500 and r.status_code not in (408, 429) else DeliveryError
    raise error(f"POST {url}: HTTP {r.status_code} {r.text[:200]!r}")


class AlertmanagerChannel:
    """Posts alerts to Alertmanager's API (``/api/v2/alerts``), which routes, groups, silences
    and notifies. Alertmanager forgets a firing alert once its ``endsAt`` passes, so the outbox
    posts firing alerts again every ``resend_seconds`` (``post``, all of them at once)."""

    name = "alertmanager"

    def __init__(self, url: str, timeout: float, resend_seconds: float) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.timeout, self.resend_seconds = timeout, resend_seconds
        self.session = requests.Session()

    def alert(self, n: Notification, now: datetime | None = None) -> dict:
        """The postable alert: a resolved one ends at its resolution, a firing one
        ``ALERTMANAGER_VALID_PERIODS`` re-posts from now."""
        if n.status == "resolved":
            ends = n.ends_at
        else:
            now = now or datetime.now(UTC)
            ends = now + timedelta(seconds=ALERTMANAGER_VALID_PERIODS * self.resend_seconds)
        return {"labels": dict(n.labels), "annotations": dict(n.annotations),
                "startsAt": rfc3339(n.starts_at), "endsAt": rfc3339(ends)}

    def post(self, notifications: list[Notification]) -> None:
        body = json.dumps([self.alert(n) for n in notifications], separators=(",", ":")).encode()
        _post(self.session, self.url, body, {"Content-Type": "application/json"}, self.timeout)

    def send(self, n: Notification) -> None:
        self.post([n])

    def close(self) -> None:
        self.session.close()


def signature(secret: str, body: bytes) -> str:
    """The ``X-Iotlake-Signature`` of a body: ``sha256=<hex HMAC-SHA256>`` (as GitHub's)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookChannel:
    """One POST per notification, Alertmanager's webhook body, an ``Idempotency-Key`` header
    (the notification's key) and, with a secret, an HMAC of the exact body bytes."""

    name = "webhook"
    resend_seconds = None

    def __init__(self, url: str, timeout: float, secret: str = "", receiver: str = "iotlake") -> None:
        self.url, self.timeout, self.secret, self.receiver = url, timeout, secret, receiver
        self.session = requests.Session()

    def body(self, n: Notification) -> bytes:
        return json.dumps(webhook_body([n], self.receiver), separators=(",", ":")).encode()

    def send(self, n: Notification) -> None:
        body = self.body(n)
        headers = {"Content-Type": "application/json", "Idempotency-Key": n.key}
        if self.secret:
            headers["X-Iotlake-Signature"] = signature(self.secret, body)
        _post(self.session, self.url, body, headers, self.timeout)

    def close(self) -> None:
        self.session.close()


class MqttChannel:
    """The webhook body on an MQTT topic at QoS 1, sent once the broker acknowledged it
    (PUBACK). One client for the channel's life: paho reconnects it in its own thread. Under
    MQTT 5 (``mqtt.protocol``) the notification's key is the user property ``Idempotency-Key``,
    as the webhook's header, and a PUBACK with an error reason (not authorized) is a failure."""

    name = "mqtt"
    resend_seconds = None

    def __init__(self, settings: Settings, topic: str, timeout: float, receiver: str = "iotlake") -> None:
        self.topic, self.timeout, self.receiver = topic, timeout, receiver
        self.connected = threading.Event()
        self.refused = ""
        self.v5 = settings.mqtt.protocol == "5"
        self.client = mqtt_client(settings, f"iotlake-alerts-{uuid.uuid4().hex[:12]}",
                                  protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311, role="alerts")
        self.client.reconnect_delay_set(1, 30)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self._acks: dict[int, object] = {}  # message id -> the PUBACK's reason code
        self.host, self.port = settings.mqtt_endpoint
        self.client.connect_async(self.host, self.port, keepalive=30)
        self.client.loop_start()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self.refused = str(reason_code)
            log.error("alerts: MQTT broker %s:%d refused the connection: %s", self.host, self.port,
                      reason_code)
            return
        self.refused = ""
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self._acks[mid] = reason_code

    def send(self, n: Notification) -> None:
        deadline = time.monotonic() + self.timeout
        if not self.connected.wait(self.timeout):
            raise DeliveryError(f"MQTT broker {self.host}:{self.port} not connected"
                                + (f" (refused: {self.refused})" if self.refused else ""))
        payload = json.dumps(webhook_body([n], self.receiver), separators=(",", ":")).encode()
        props = None
        if self.v5:
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("Idempotency-Key", n.key)]
            props.ContentType = "application/json"
        info = self.client.publish(self.topic, payload, qos=1, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise DeliveryError(f"MQTT publish to {self.topic}: {mqtt.error_string(info.rc)}")
        try:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
        except (RuntimeError, ValueError) as e:
            raise DeliveryError(f"MQTT publish to {self.topic}: {e}") from e
        if not info.is_published():
            raise DeliveryError(f"MQTT publish to {self.topic}: no PUBACK within {self.timeout:g}s")
        code = self._acks.pop(info.mid, None)
        if code is not None and getattr(code, "is_failure", False):
            raise DeliveryError(f"MQTT publish to {self.topic}: the broker answered {code}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _http_url(key: str, url: str, example: str) -> None:
    p = urlparse(url)
    if p.scheme not in ("http", "https") or not p.netloc:
        raise SettingsError(f"{key}: {url!r} is not an http(s) URL (e.g. {example})")


def channels_for(settings: Settings) -> list[Channel]:
    """The receivers ``[alerts]`` configures (none: notifications are only recorded), each
    setting checked before any channel starts."""
    cfg: AlertsSettings = settings.alerts
    if cfg.alertmanager_url:
        _http_url("alerts.alertmanager_url", cfg.alertmanager_url, "http://127.0.0.1:9093")
    if cfg.webhook_url:
        _http_url("alerts.webhook_url", cfg.webhook_url, "https://hooks.example.com/iotlake")
    if cfg.mqtt_topic and any(c in cfg.mqtt_topic for c in "+#\0"):
        raise SettingsError(f"alerts.mqtt_topic: {cfg.mqtt_topic!r} is not a topic to publish to "
                            "(+ and # are wildcards of filters): name one like iotlake/alerts")
    out: list[Channel] = []
    if cfg.alertmanager_url:
        out.append(AlertmanagerChannel(cfg.alertmanager_url, cfg.timeout_seconds,
                                       cfg.alertmanager_resend_seconds))
    if cfg.webhook_url:
        out.append(WebhookChannel(cfg.webhook_url, cfg.timeout_seconds, cfg.webhook_secret))
    if cfg.mqtt_topic:
        out.append(MqttChannel(settings, cfg.mqtt_topic, cfg.timeout_seconds))
    return out
