"""Device simulator: deterministic telemetry (with injected faults) published to MQTT.

The simulated clock is independent of publish speed (device d's k-th reading has
``ts = start + k * devices / rate``), so a seed fully determines the data and tests can assert
exact event times, duplicates, malformed payloads and late arrivals.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import paho.mqtt.client as mqtt

from ingest.faults import AnomalyPlan, Injector
from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.settings import Settings
from lakehouse.telemetry import TelemetryModel, topic_parts

log = logging.getLogger(__name__)

KINDS = ("valid", "duplicate", "malformed", "late")
_MALFORMED = ("not_json", "truncated", "no_event_id", "no_ts")
#: Pacing sleeps only once this far ahead of schedule, then publishes what is due in a burst.
_PACE_SLACK = 0.002
#: How often a publisher waiting for a free in-flight slot checks for a stop, and when it warns.
_SLOT_WAIT = 0.5
_STALL_WARNING = 10.0


@dataclass(frozen=True)
class Message:
    """One MQTT publish. ``event_id`` is what a parser can recover (None when absent/unparsable)."""

    topic: str
    payload: bytes
    event_id: str | None
    kind: str


#: The payloads ``Fleet``'s own fast path writes (the environmental sensor): a model of this
#: shape (``examples/sensor.toml``) is simulated by it, any other by ``ModelPayloads``.
SENSOR = TelemetryModel(metrics=[
    {"name": "temperature", "unit": "°C", "min": -40.0, "max": 125.0},
    {"name": "humidity", "unit": "%", "min": 0.0, "max": 100.0},
    {"name": "battery", "unit": "%", "min": 0.0, "max": 100.0},
])


def device_id(index: int) -> str:
    return f"dev-{index + 1:05d}"


def device_topic(settings: Settings, device: str, index: int = 0) -> str:
    """The MQTT topic a device publishes to: the telemetry model's topic pattern with the device
    and its other parts filled in (``site-0`` .. ``site-2``), or, when ``mqtt.topic_filter`` is
    set apart from the pattern, the filter with its ``+`` replaced."""
    pattern, flt = settings.telemetry.topic_pattern, settings.mqtt.topic_filter
    parts = topic_parts(pattern)
    if settings.subscribes_to_model and parts:
        return pattern.format_map({n: device if n == "device_id" else f"{n}-{index % 3}" for n in parts})
    if flt.count("+") != 1 or "#" in flt:
        raise ValueError(f"mqtt.topic_filter {flt!r} must contain exactly one '+' (the device id) and no '#'")
    return flt.replace("+", device)


def format_ts(dt: datetime) -> str:
    """ISO-8601 UTC with millisecond precision and a ``Z`` suffix."""
    dt = dt.astimezone(UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


class Fleet:
    """Per-device state (clock, sensor random walks) shared by batch and continuous modes;
    ``anomalies``: labelled faults on some devices (``ingest.faults``, drawn from ``seed``)."""

    def __init__(self, settings: Settings, devices: int, rng: random.Random,
                 start: datetime | None, rate: float, anomalies: AnomalyPlan | None = None,
                 seed: int = 0) -> None:
        if devices < 1:
            raise ValueError("devices must be >= 1")
        if rate <= 0:
            raise ValueError("rate must be > 0")
        start = start or datetime.now(UTC)
        if start.tzinfo is None:
            start = start.replace(tzinfo=UTC)
        self.start = start.replace(microsecond=start.microsecond // 1000 * 1000)
        self.interval = timedelta(seconds=devices / rate)
        self.rng = rng
        # the sensor's model takes the fast path below; any other, ModelPayloads
        model = settings.telemetry.require_metrics()
        self.custom = None if _shape(model) == _shape(SENSOR) else \
            ModelPayloads(model, rng, devices, settings.simulator.device_prefix)
        self.ids = self.custom.ids if self.custom else [device_id(d) for d in range(devices)]
        self.topics = [device_topic(settings, i, d) for d, i in enumerate(self.ids)]
        self.count = [0] * devices
        self.temp = [rng.uniform(15.0, 30.0) for _ in range(devices)]
        self.hum = [rng.uniform(30.0, 70.0) for _ in range(devices)]
        self.battery = [rng.uniform(80.0, 100.0) for _ in range(devices)]
        self._next = 0
        self._start_us = (self.start - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
        self._interval_us = self.interval // timedelta(microseconds=1)
        self._minute, self._prefix = -1, ""
        self.injector = Injector(anomalies, model, self.ids, seed, self._start_us, self._interval_us) \
            if anomalies is not None and anomalies.fraction > 0 else None

    def new_event_id(self) -> str:
        return f"{self.rng.getrandbits(128):032x}"

    def reading(self, late: bool = False) -> tuple[str, bytes, str]:
        """Next reading (round-robin over devices): (topic, JSON payload, event_id).

        The payload is formatted directly (the bytes ``json.dumps`` gives for the same record:
        ASCII ids, ``repr`` floats): the simulator is the benchmarks' load generator and shares
        their cores with the pipeline, so its cost per message is kept small.
        """
        rng, d = self.rng, self._next
        self._next = (d + 1) % len(self.ids)
        k = self.count[d]
        self.count[d] += 1
        ts_us = self._start_us + k * self._interval_us
        if late:
            ts_us -= rng.randint(60_000, 300_000) * 1000
        inj = self.injector if self.injector is not None and self.injector.faulted(d) else None
        if self.custom is not None:
            adjust = None if inj is None else lambda i, v: inj.value(d, k, i, v)
            return self.topics[d], *self.custom.reading(d, ts_us, adjust)
        self.temp[d] += rng.gauss(0.0, 0.2)
        self.hum[d] = min(100.0, max(0.0, self.hum[d] + rng.gauss(0.0, 0.5)))
        self.battery[d] = max(0.0, self.battery[d] - rng.uniform(0.0, 0.02))
        event_id = self.new_event_id()
        status = "error" if rng.random() < 0.01 else "ok"
        if inj is not None:
            values = (inj.value(d, k, i, v) for i, v in enumerate((self.temp[d], self.hum[d], self.battery[d])))
            fields = "".join(f'"{m.name}":{round(v, 2)!r},' for m, v in zip(SENSOR.metrics, values, strict=True)
                             if v is not None)
            payload = (f'{{"schema_version":1,"device_id":"{self.ids[d]}","event_id":"{event_id}",'
                       f'"ts":"{self._ts_text(ts_us)}",{fields}"status":"{status}"}}')
            return self.topics[d], payload.encode(), event_id
        payload = (f'{{"schema_version":1,"device_id":"{self.ids[d]}","event_id":"{event_id}",'
                   f'"ts":"{self._ts_text(ts_us)}","temperature":{round(self.temp[d], 2)!r},'
                   f'"humidity":{round(self.hum[d], 2)!r},"battery":{round(self.battery[d], 2)!r},'
                   f'"status":"{status}"}}')
        return self.topics[d], payload.encode(), event_id

    def _ts_text(self, us: int) -> str:
        """``format_ts`` of an epoch-microsecond time, the minute's prefix cached."""
        minute, rest = divmod(us, 60_000_000)
        if minute != self._minute:
            self._minute = minute
            self._prefix = format_ts(datetime.fromtimestamp(minute * 60, UTC))[:-7]
        return f"{self._prefix}{rest // 1_000_000:02d}.{rest // 1000 % 1000:03d}Z"

    def message(self, kind: str, sent: list[Message]) -> Message:
        """One message of ``kind``; duplicates re-send a random earlier reading from ``sent``."""
        if kind == "duplicate":
            m = self.rng.choice(sent)
            return Message(m.topic, m.payload, m.event_id, "duplicate")
        if kind == "malformed":
            return self._malformed()
        topic, payload, eid = self.reading(late=kind == "late")
        return Message(topic, payload, eid, kind)

    def _malformed(self) -> Message:
        rng = self.rng
        variant = rng.choice(_MALFORMED)
        d = rng.randrange(len(self.topics))
        topic = self.topics[d]
        if self.custom is not None:
            return Message(topic, self.custom.malformed(d, variant, self._start_us), None, "malformed")
        # A record that does not advance any device clock: bad input is not a reading.
        record = {"schema_version": 1, "device_id": self.ids[d], "event_id": self.new_event_id(),
                  "ts": format_ts(self.start), "temperature": 0.0, "humidity": 0.0,
                  "battery": 0.0, "status": "ok"}
        if variant == "not_json":
            return Message(topic, b"\xffnot json " + rng.randbytes(8).hex().encode(), None, "malformed")
        if variant == "truncated":
            raw = encode(record)
            return Message(topic, raw[: rng.randrange(1, len(raw) - 1)], None, "malformed")
        if variant == "no_event_id":
            del record["event_id"]
            return Message(topic, encode(record), None, "malformed")
        del record["ts"]
        return Message(topic, encode(record), record["event_id"], "malformed")


class ModelPayloads:
    """Readings shaped by any telemetry model: fields at their paths (nested objects built),
    the event time in the model's format, each metric a random walk inside its range. Device
    ids look like ``pump-7f3a`` (the prefix is ``simulator.device_prefix``)."""

    def __init__(self, model: TelemetryModel, rng: random.Random, devices: int,
                 prefix: str = "dev") -> None:
        if devices > 0xFFFF:
            raise ValueError("at most 65535 simulated devices")
        self.model, self.rng = model, rng
        # an odd multiplier is a bijection mod 2^16: distinct, scattered 4-hex-digit ids
        self.ids = [f"{prefix}-{(d + 1) * 0x9E37 & 0xFFFF:04x}" for d in range(devices)]
        self.values = [[self._start(m) for m in model.metrics] for _ in range(devices)]

    def _start(self, m) -> float:
        lo, hi = m.min, m.max
        if lo is not None and hi is not None:
            return self.rng.uniform(lo + 0.3 * (hi - lo), lo + 0.7 * (hi - lo))
        return self.rng.uniform(10.0, 50.0) + (lo or 0.0) if hi is None else hi - self.rng.uniform(10.0, 50.0)

    def _time(self, ts_us: int) -> object:
        fmt = self.model.event_time_format
        if fmt == "epoch_s":
            return ts_us // 1000 / 1000 if ts_us % 1_000_000 else ts_us // 1_000_000
        if fmt == "epoch_ms":
            return ts_us // 1000
        if fmt == "epoch_us":
            return ts_us
        return format_ts(datetime.fromtimestamp(ts_us / 1e6, UTC))

    def record(self, d: int, ts_us: int, adjust=None) -> tuple[dict, str | None]:
        """Device ``d``'s next record; ``adjust(metric_index, value)``: the value to send
        (None: leave the metric out), for injected faults."""
        m, rng = self.model, self.rng
        rec: dict = {}
        event_id = None
        if m.event_id_path:
            event_id = f"{rng.getrandbits(128):032x}"
            set_field(rec, m.event_id_path, event_id)
        if m.device_id_path:
            set_field(rec, m.device_id_path, self.ids[d])
        if m.schema_version_path:
            set_field(rec, m.schema_version_path, 1)
        set_field(rec, m.event_time_path, self._time(ts_us))
        vals = self.values[d]
        for i, metric in enumerate(m.metrics):
            lo, hi = metric.min, metric.max
            span = (hi - lo) if lo is not None and hi is not None else 20.0
            v = vals[i] + rng.gauss(0.0, 0.005 * span)
            v = min(hi, v) if hi is not None else v
            v = max(lo, v) if lo is not None else v
            vals[i] = v
            if adjust is not None and (v := adjust(i, v)) is None:
                continue
            set_field(rec, metric.source, int(round(v)) if metric.type == "long" else round(v, 3))
        if m.status_path:
            set_field(rec, m.status_path, m.error_status if m.error_status and rng.random() < 0.01 else "ok")
        return rec, event_id

    def reading(self, d: int, ts_us: int, adjust=None) -> tuple[bytes, str | None]:
        rec, event_id = self.record(d, ts_us, adjust)
        payload = encode(rec)
        if event_id is None:  # the id silver derives: device and raw payload
            event_id = hashlib.md5(self.ids[d].encode() + b"\x00" + payload).hexdigest()
        return payload, event_id

    def malformed(self, d: int, variant: str, ts_us: int) -> bytes:
        if variant == "not_json":
            return b"\xffnot json " + self.rng.randbytes(8).hex().encode()
        rec, _ = self.record(d, ts_us)
        if variant == "truncated":
            raw = encode(rec)
            return raw[: self.rng.randrange(1, len(raw) - 1)]
        path = self.model.event_id_path if variant == "no_event_id" and self.model.event_id_path \
            else self.model.event_time_path
        drop_field(rec, path)
        return encode(rec)


def _shape(model: TelemetryModel) -> dict:
    """What of a model shapes payloads and topics (not its rules or suite)."""
    return model.model_dump(exclude={"suite", "on_device_mismatch", "device_id_max_length",
                                     "status_rules"})


def set_field(rec: dict, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        rec = rec.setdefault(p, {})
    rec[leaf] = value


def drop_field(rec: dict, path: str) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        rec = rec.get(p, {})
    rec.pop(leaf, None)


def encode(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def generate(
    settings: Settings,
    events: int,
    devices: int = 10,
    duplicates: int = 0,
    malformed: int = 0,
    late: int = 0,
    seed: int = 0,
    start: datetime | None = None,
    rate: float = 100.0,
    anomalies: AnomalyPlan | None = None,
) -> list[Message]:
    """``events`` messages in total; unique valid readings = events - duplicates - malformed
    (``late`` of them with ts 1-5 min behind the simulated clock). Same seed+start, same bytes.
    ``anomalies``: labelled faults on some devices' readings (``ingest.faults``)."""
    if min(events, duplicates, malformed, late) < 0:
        raise ValueError("counts must be >= 0")
    readings = events - duplicates - malformed
    if readings < late or readings < 0:
        raise ValueError(f"events={events} too small for duplicates+malformed+late")
    if duplicates and not readings:
        raise ValueError("duplicates need at least one valid reading to duplicate")
    rng = random.Random(seed)
    fleet = Fleet(settings, devices, rng, start, rate, anomalies, seed)
    kinds = (["valid"] * (readings - late) + ["late"] * late
             + ["duplicate"] * duplicates + ["malformed"] * malformed)
    rng.shuffle(kinds)
    if duplicates:  # a duplicate needs an earlier reading: move the first reading to the front
        first = next(i for i, k in enumerate(kinds) if k in ("valid", "late"))
        kinds[0], kinds[first] = kinds[first], kinds[0]
    out: list[Message] = []
    sent: list[Message] = []
    for kind in kinds:
        m = fleet.message(kind, sent)
        if kind in ("valid", "late"):
            sent.append(m)
        out.append(m)
    return out


# ---- publishing ------------------------------------------------------------------------------


def mqtt_client(settings: Settings, client_id: str = "", protocol: int = mqtt.MQTTv311,
                client_class: type[mqtt.Client] = mqtt.Client, role: str = "simulator",
                **kwargs) -> mqtt.Client:
    """A paho 2.x client with TLS and the credential of iotlake's client ``role`` applied
    (``lakehouse.mqtt_auth.login``: the settings' user, or the role's own on the embedded
    broker; never logged)."""
    c = client_class(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                     **kwargs)
    mqtt_auth.configure_client(c, settings, role)
    return c


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
    ``profile``: ``json`` or ``sparkplug`` (edge nodes, ``ingest.sparkplug_sim``); default:
    Sparkplug when the telemetry model takes it, else JSON. On stop it waits up to
    ``drain_seconds`` for acknowledgements, then returns the count sent (a warning names the
    unacknowledged ones). ``anomalies``: labelled faults on some devices' readings
    (``ingest.faults``; JSON only), drawn from the same seed."""
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
        from ingest.sparkplug_sim import SparkplugFleet

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
