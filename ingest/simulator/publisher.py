"""Publishing the simulated fleet to MQTT: a bounded QoS-1 publisher, a list of messages at a
pace (``publish``) or the fleet continuously until stopped (``run_forever``)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable

import paho.mqtt.client as mqtt

from ingest.mqtt_client import mqtt_client
from ingest.simulator.faults import AnomalyPlan
from ingest.simulator.fleet import Fleet, Message
from lakehouse.settings import Settings

log = logging.getLogger(__name__)

#: Pacing sleeps only once this far ahead of schedule, then publishes what is due in a burst.
_PACE_SLACK = 0.002
#: How often a publisher waiting for a free in-flight slot checks for a stop, and when it warns.
_SLOT_WAIT = 0.5
_STALL_WARNING = 10.0


class _Publisher:
    """QoS-1 publisher with a bound on unacknowledged publishes.

    paho assigns 16-bit message ids at ``publish()`` time, so more than ~65k unacked publishes
    would collide; the semaphore keeps the number in flight below ``max_inflight``.
    """

    def __init__(self, settings: Settings, max_inflight: int, qos: int = 1) -> None:
        if not 1 <= max_inflight <= 60_000:
            raise ValueError("max_inflight must be in 1..60000 (paho message ids are 16-bit)")
        self.qos, self.max_inflight = qos, max_inflight
        self.slots = threading.BoundedSemaphore(max_inflight)
        self.acked = 0
        self.connected = threading.Event()
        self.refused = ""
        self.client = mqtt_client(settings, protocol=mqtt.MQTTv311)
        # 0 = paho's own limit off (the semaphore is the bound): with a limit, paho walks every
        # unacknowledged message on each PUBACK (15% of the simulator's CPU at 5,000 msg/s)
        self.client.max_inflight_messages_set(0)
        self.client.max_queued_messages_set(0)
        self.client.on_publish = self._on_publish
        self.client.on_connect = self._on_connect
        host, port = settings.mqtt_endpoint
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()
        if not self.connected.wait(30) or self.refused:
            self.close()
            raise ConnectionError(f"MQTT broker {host}:{port} refused the connection: "
                                  f"{self.refused or 'no answer within 30s'}")

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.refused = str(reason_code) if reason_code.is_failure else ""
        self.connected.set()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self.acked += 1
        self.slots.release()

    def send(self, topic: str, payload: bytes, stop: threading.Event | None = None) -> bool:
        """Publish once a slot is free; False, unsent, if ``stop`` is set while the broker
        acknowledges nothing (a stalled broker must not keep a stopping simulator alive)."""
        waited = 0.0
        while not self.slots.acquire(timeout=_SLOT_WAIT):
            waited += _SLOT_WAIT
            if stop is not None and stop.is_set():
                return False
            if waited == _STALL_WARNING:
                log.warning("no MQTT acknowledgement for %.0fs (%d publishes in flight)",
                            waited, self.max_inflight)
        info = self.client.publish(topic, payload, qos=self.qos)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued, resent
            self.slots.release()
            raise RuntimeError(f"MQTT publish failed: {mqtt.error_string(info.rc)}")
        return True

    def drain(self, sent: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.acked < sent:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.acked}/{sent} publishes acknowledged")
            time.sleep(0.005)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish(settings: Settings, messages: Iterable[Message], rate: float | None = None,
            max_inflight: int = 1000) -> int:
    """Publish QoS 1 (optionally paced at ``rate`` msg/s); returns the count acknowledged."""
    pub = _Publisher(settings, max_inflight)
    sent = 0
    t0 = time.monotonic()
    try:
        for m in messages:
            if rate:
                delay = t0 + sent / rate - time.monotonic()
                if delay > _PACE_SLACK:
                    time.sleep(delay)
            pub.send(m.topic, m.payload)
            sent += 1
        pub.drain(sent)
    finally:
        pub.close()
    return sent


def run_forever(settings: Settings, rate: float, devices: int, stop: threading.Event,
                faults: dict | None = None, profile: str | None = None,
                drain_seconds: float = 30.0, anomalies: AnomalyPlan | None = None) -> int:
    """Continuous mode: publish ``rate`` msg/s until ``stop``. ``faults`` gives the fractions
    of ``duplicates``, ``malformed`` and ``late`` messages (e.g. ``{"duplicates": 0.01}``).
    ``profile``: ``json`` or ``sparkplug`` (edge nodes, ``ingest.simulator.sparkplug``); default:
    Sparkplug when the telemetry model takes it, else JSON. On stop it waits up to
    ``drain_seconds`` for acknowledgements, then returns the count sent (a warning names the
    unacknowledged ones). ``anomalies``: labelled faults on some devices' readings
    (``ingest.simulator.faults``; JSON only), drawn from the same seed."""
    faults = dict(faults or {})
    unknown = set(faults) - {"duplicates", "malformed", "late", "seed"}
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; use duplicates, malformed, late")
    p_dup, p_bad, p_late = (float(faults.get(k, 0.0)) for k in ("duplicates", "malformed", "late"))
    seed = int(faults.get("seed", 0))
    rng = random.Random(seed)
    use_sparkplug = profile == "sparkplug" or (profile is None and settings.telemetry.sparkplug)
    if use_sparkplug and anomalies is not None and anomalies.fraction > 0:
        raise ValueError("--anomalies needs JSON devices (--profile json): Sparkplug devices "
                         "keep no simulated clock to label faults by")
    fleet = Fleet(settings, devices, rng, None, rate, anomalies, seed)
    recent: list[Message] = []
    sparkplug = None
    if use_sparkplug:
        from ingest.simulator.sparkplug import SparkplugFleet

        sparkplug = SparkplugFleet(settings, devices, rng).messages()
    pub = _Publisher(settings, max_inflight=1000)
    sent = 0
    t0 = time.monotonic()
    log.info("simulating %d devices at %.0f msg/s on %s", devices, rate, settings.mqtt.topic_filter)
    try:
        while not stop.is_set():
            delay = t0 + sent / rate - time.monotonic()
            if delay > _PACE_SLACK:  # sleep in ticks, not per message: a wake-up per message
                stop.wait(min(delay, 0.5))  # cost more CPU than the publish itself
                continue
            if sparkplug is not None:
                m = next(sparkplug)
                sent += pub.send(m.topic, m.payload, stop)
                continue
            x = rng.random()
            kind = ("duplicate" if x < p_dup else "malformed" if x < p_dup + p_bad
                    else "late" if x < p_dup + p_bad + p_late else "valid")
            if kind == "duplicate" and not recent:
                kind = "valid"
            m = fleet.message(kind, recent)
            if kind in ("valid", "late"):
                recent.append(m)
                if len(recent) > 1000:
                    del recent[:500]
            sent += pub.send(m.topic, m.payload, stop)
        try:
            pub.drain(sent, timeout=drain_seconds)
        except TimeoutError as e:
            log.warning("stopping with publishes unacknowledged: %s", e)
    finally:
        pub.close()
    log.info("simulator published %d messages", sent)
    return sent
