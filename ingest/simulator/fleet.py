"""The simulated fleet: deterministic telemetry (duplicates, malformed payloads, late readings
and labelled faults included) as MQTT messages, not yet published.

The simulated clock is independent of publish speed (device d's k-th reading has
``ts = start + k * devices / rate``), so a seed fully determines the data and tests can assert
exact event times, duplicates, malformed payloads and late arrivals.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ingest.simulator.faults import AnomalyPlan, Injector
from lakehouse.settings import Settings
from lakehouse.telemetry import TelemetryModel, topic_parts

KINDS = ("valid", "duplicate", "malformed", "late")
_MALFORMED = ("not_json", "truncated", "no_event_id", "no_ts")


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
    ``anomalies``: labelled faults on some devices (``ingest.simulator.faults``, drawn from ``seed``)."""

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
    ``anomalies``: labelled faults on some devices' readings (``ingest.simulator.faults``)."""
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
