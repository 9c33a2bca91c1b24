"""MQTT -> Kafka bridge that loses nothing.

A message is acknowledged to the MQTT broker only after Kafka confirmed it (paho manual acks,
idempotent producer with ``acks=all``); until then the broker keeps it in our persistent
session, so a crash or restart re-delivers instead of losing (duplicates are removed downstream
by ``event_id``). Everything runs on one thread: paho's socket is driven by hand and the
producer's delivery callbacks are served in the same loop, so acks need no locks, and reading
simply stops while ``bridge.max_inflight`` messages are unacknowledged (backpressure).

Kafka confirms a read round's records with one delivery report per partition (the producer's
gapless guarantee makes that report vouch for the records before it); after any unexpected
Kafka error the bridge switches to a report per record and re-reads what it had not acked.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import select
import threading
import time
import zlib
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
from confluent_kafka import KafkaError, KafkaException, Producer
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from ingest.bridge_metrics import BridgeCollector, LatencyHistogram, serve
from ingest.mqtt_client import BufferedClient, mqtt_client
from lakehouse.kafka.config import client_config
from lakehouse.mqtt.sparkplug import NAMESPACE, parse_topic, rebirth_request
from lakehouse.mqtt.sparkplug import Topic as SparkplugTopic
from lakehouse.settings import Settings, SettingsError

log = logging.getLogger(__name__)

#: Dead-lettered payloads are cut to this size only if they could not fit in a Kafka message.
DLQ_MAX_VALUE = 900 * 1024
RECEIVE_MAXIMUM_CAP = 65_535  # MQTT v5 Receive Maximum is 16-bit
_QOS = tuple(("qos", b"%d" % q) for q in range(3))
_RETAIN = (("retain", b"0"), ("retain", b"1"))


class _Entry:
    """One received MQTT message until Kafka confirmed it and its ack went out; it is also its
    own delivery callback (no closure to build per message).

    ``pkey`` is set on a round's last record of a (topic, partition): its delivery report
    confirms every earlier record of that partition (see ``Bridge._flush_round``).
    """

    __slots__ = ("bridge", "mid", "qos", "gen", "t0", "done", "topic", "payload", "headers", "dlq",
                 "pkey")

    def __init__(self, bridge: Bridge, mid: int, qos: int, gen: int, t0: float, topic: str,
                 payload: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.bridge, self.mid, self.qos, self.gen, self.t0 = bridge, mid, qos, gen, t0
        self.topic, self.payload, self.headers = topic, payload, headers
        self.done = False
        self.dlq = False
        self.pkey = None

    def __call__(self, err: KafkaError | None, msg: Any) -> None:
        b = self.bridge
        if err is not None or b._closing:
            b._on_delivery(self, err, msg)
            return
        if self.pkey is not None:
            b._confirm_partition(self)
            return
        self.done = True  # the common case inline: one Python call per delivery report
        b._last_confirm = time.monotonic()
        b._c["dead_lettered" if self.dlq else "delivered"] += 1
        b.latency.observe(time.monotonic() - self.t0)
        b._ack_due = True  # acked in one write after this poll round (_poll)


def device_index(topic_filter: str, pattern_level: int | None = None) -> int | None:
    """Topic level holding the device id: the telemetry model's ``{device_id}`` level, else the
    (last) ``+`` of the subscription filter."""
    if pattern_level is not None:
        return pattern_level
    levels = topic_filter.split("/")
    plus = [i for i, lv in enumerate(levels) if lv == "+"]
    return plus[-1] if plus else None


class Bridge:
    """Moves MQTT messages to Kafka; ``run(stop)`` blocks until ``stop`` is set (once per
    instance: stopping releases the Kafka producer)."""

    def __init__(self, settings: Settings, bridge_id: str | None = None) -> None:
        b = settings.bridge
        if b.instances > 1 and not bridge_id:
            raise SettingsError(
                "bridge.instances > 1 needs a stable, distinct bridge id per instance "
                "(python -m ingest.bridge --bridge-id NAME-i, or `iotlake bridge --instances K`)")
        self.settings = settings
        self.bridge_id = bridge_id or settings.mqtt.client_id
        self._bid = self.bridge_id.encode()
        self._bid_header = ("bridge_id", self._bid)
        self._topics: dict[bytes, tuple[str, str | None, bytes | None, tuple]] = {}
        self._stamp()
        self._max = b.max_inflight
        self._max_payload = b.max_payload_bytes
        self._topic_map = dict(b.topic_map)
        self._routes: dict[str, str | None] = {}
        self._default_topic = settings.kafka.topic
        self._dlq_topic = settings.kafka.dead_letter_topic
        self._dev_level = device_index(settings.mqtt.topic_filter, settings.telemetry.device_level
                                       if settings.subscribes_to_model else None)
        # Sparkplug edge nodes whose NBIRTH this bridge saw (since it started), and when each
        # node without one was last asked for a rebirth
        self._rebirth = settings.telemetry.sparkplug and b.sparkplug_rebirth
        self._rebirth_every = b.sparkplug_rebirth_interval_seconds
        self._born: set[str] = set()
        self._asked: dict[str, float] = {}
        filters = (settings.mqtt.topic_filter, *settings.telemetry.sparkplug_filters)
        self.subscriptions = [f"$share/{b.share_group}/{f}" if b.instances > 1 else f for f in filters]
        self.subscription = ", ".join(self.subscriptions)
        self._pending: deque[_Entry] = deque()
        # Per-round delivery reports (``_flush_round``): unconfirmed records per (topic,
        # partition), partition counts of the target topics, the round being read.
        self._fast = not b.per_message_delivery_reports
        self._parts: defaultdict[tuple[str, int], deque[_Entry]] = defaultdict(deque)
        self._nparts: dict[str, int] = {}
        self._round: list[tuple[bytes, int, int, bytes]] = []
        self._degrade: str | None = None
        self._last_confirm = time.monotonic()
        self._retry: list[tuple[float, _Entry, str]] = []
        self._gen = 0
        self._connected = False
        self._ever_connected = False
        self._delay = 0.0
        self._fatal: KafkaError | None = None
        self._ack_due = False
        self._closing = False
        self.latency = LatencyHistogram()
        #: Set once the broker confirmed the subscription (messages published before that
        #: are only kept if an earlier session of this bridge id subscribed).
        self.subscribed = threading.Event()
        #: Set once Kafka can take records: the idempotent producer has its producer id. Until
        #: then a produced record waits (until the producer id is granted), so MQTT messages
        #: taken off the broker's queue earlier would only sit unacknowledged in the bridge.
        self.kafka_ready = threading.Event()
        #: Set when the broker rejected the credentials (bad user name / password, not
        #: authorized): retrying cannot help, so a caller waiting for ``subscribed`` can stop.
        self.credentials_refused = threading.Event()
        self._c = dict.fromkeys(("received", "delivered", "dead_lettered", "failed", "acked",
                                 "reconnects"), 0)
        self._v5 = settings.mqtt.protocol == "5"
        self._producer = Producer(self._producer_config())
        self._client = self._mqtt_client()

    # ---- setup ---------------------------------------------------------------------------
    def _producer_config(self) -> dict[str, Any]:
        b = self.settings.bridge
        conf: dict[str, Any] = {
            "client.id": self.bridge_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": b.linger_ms,
            "compression.type": b.compression,
            # Never give up on a message: while Kafka is down we stop acking MQTT instead.
            "message.timeout.ms": 0,
            "queue.buffering.max.messages": max(100_000, 2 * self._max),
            "message.max.bytes": max(1_000_000, b.max_payload_bytes + 65_536),
            # statistics carry the idempotence state: how the bridge learns Kafka is ready
            "statistics.interval.ms": 100,
            "stats_cb": self._on_stats,
            # per-round delivery reports rely on this: a record that cannot be delivered makes
            # the producer fail (the bridge then falls back) instead of leaving a gap behind
            # records delivered after it
            "enable.gapless.guarantee": self._fast,
        }
        conf.update(client_config(self.settings))  # bootstrap + SASL/SSL pass-through win
        return conf

    def _on_stats(self, stats: str) -> None:
        if not self.kafka_ready.is_set() and json.loads(stats).get("eos", {}).get(
                "idemp_state") == "Assigned":
            self.kafka_ready.set()

    def _await_kafka(self, stop: threading.Event, timeout: float) -> None:
        """Connect to MQTT only once Kafka can take records (or after ``timeout``: with Kafka
        down the bridge still subscribes, and backpressure holds the broker's queue)."""
        deadline = time.monotonic() + timeout
        while not self.kafka_ready.is_set() and not stop.is_set() and time.monotonic() < deadline:
            self._poll(0.02)
        if not self.kafka_ready.is_set() and not stop.is_set():
            log.warning("bridge %s: Kafka not ready after %.0fs; taking MQTT messages anyway "
                        "(unacknowledged until Kafka confirms them)", self.bridge_id, timeout)

    def _mqtt_client(self) -> mqtt.Client:
        if self._v5:
            c = mqtt_client(self.settings, self.bridge_id, protocol=mqtt.MQTTv5, manual_ack=True,
                            client_class=BufferedClient, role="bridge")
        else:
            c = mqtt_client(self.settings, self.bridge_id, protocol=mqtt.MQTTv311, manual_ack=True,
                            clean_session=False, client_class=BufferedClient, role="bridge")
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_subscribe = self._on_subscribe
        return c

    def _connect_kwargs(self) -> dict[str, Any]:
        if not self._v5:  # v3.1.1: the session persists through clean_session=False
            return {}
        p = Properties(PacketTypes.CONNECT)
        p.SessionExpiryInterval = self.settings.bridge.session_expiry_seconds
        # The broker sends no more than this many unacked messages: backpressure at the source.
        p.ReceiveMaximum = min(self._max, RECEIVE_MAXIMUM_CAP)
        return {"clean_start": False, "properties": p}

    # ---- paho callbacks (same thread as run) ---------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker refused the connection: %s", reason_code)
            if reason_code.value in (134, 135):  # bad user name or password / not authorized
                self.credentials_refused.set()
            return
        self._connected = True
        self._delay = 0.0
        if self._ever_connected:
            self._c["reconnects"] += 1
        self._ever_connected = True
        if not flags.session_present:
            log.info("bridge %s: new MQTT session (nothing was queued for us)", self.bridge_id)
        if self._v5:  # retainHandling=1: retained messages only for a new subscription
            opts = SubscribeOptions(qos=self.settings.mqtt.qos, retainHandling=1)
            client.subscribe([(f, opts) for f in self.subscriptions])
        else:
            client.subscribe([(f, self.settings.mqtt.qos) for f in self.subscriptions])

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        bad = [rc for rc in reason_codes if rc.is_failure]
        if bad:
            log.error("subscription to %s refused: %s", self.subscription, bad)
        else:
            log.info("bridge %s subscribed to %s", self.bridge_id, self.subscription)
            self.subscribed.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self._connected:
            log.warning("bridge %s: MQTT connection lost (%s)", self.bridge_id, reason_code)
        self._connected = False
        # Acks for messages of the old connection must never be sent on a new one: the broker
        # re-delivers them (same ids) and a stale ack could hit a re-used id.
        self._gen += 1

    def _on_message(self, client, userdata, msg: mqtt.MQTTMessage) -> None:
        """paho's path (packets the fast path leaves to it, QoS 0/2)."""
        self._stamp()
        self._handle(msg._topic, msg.mid, msg.qos, msg.retain, msg.payload)

    def _on_publish_fast(self, *packet: Any) -> None:
        """BufferedClient's path for QoS-1 PUBLISH packets: collected into a round
        (``_flush_round``), stamped once per socket read."""
        self._round.append(packet)

    def _flush_round(self) -> None:
        """Produce a round of QoS-1 messages with a delivery report only on the last record per
        (topic, partition): with idempotence and the gapless guarantee, Kafka writes a
        partition's records in order and a failure stops the producer, so that report confirms
        the partition's earlier records too. A delivery report per record (a Python object
        with copies of value and headers) cost more than the rest of the bridge together."""
        rows, self._round = self._round, []
        if not rows:
            return
        self._c["received"] += len(rows)
        topics, pending, gen, t0, rx_at = self._topics, self._pending, self._gen, self._rx_t0, self._rx_at
        fast, max_payload = self._fast, self._max_payload
        entries = []
        last: dict[tuple[str, int], int] = {}
        for i, (topic_raw, mid, retain, payload) in enumerate(rows):
            info = topics.get(topic_raw) or self._topic_info(topic_raw)
            if info[5] is not None:
                self._sparkplug_node(info[5])
            headers = [info[3], _QOS[1], _RETAIN[1 if retain else 0], rx_at, self._bid_header]
            e = _Entry(self, mid, 1, gen, t0, info[0], payload, headers)
            pending.append(e)
            entries.append((e, info))
            if fast and info[4] is not None and len(payload) <= max_payload:
                last[info[4]] = i
        parts = self._parts
        for i, (e, info) in enumerate(entries):
            target, pkey = info[1], info[4]
            if target is None:
                self._dead_letter(e, "unmapped_topic")
            elif len(e.payload) > max_payload:
                self._dead_letter(e, "payload_too_large")
            elif fast and pkey is not None:
                parts[pkey].append(e)
                if last[pkey] == i:
                    e.pkey = pkey
                self._produce(e, target, info[2], e.payload, e.headers, pkey[1], last[pkey] == i)
            else:
                self._produce(e, target, info[2], e.payload, e.headers, pkey[1] if pkey else -1)

    def _confirm_partition(self, marker: _Entry) -> None:
        """A round's last record of a partition is in Kafka: so is everything before it there."""
        q = self._parts[marker.pkey]
        n = 0
        while q:
            e = q.popleft()
            e.done = True
            n += 1
            if e is marker:
                break
        self._c["delivered"] += n
        self._last_confirm = now = time.monotonic()
        self.latency.observe(now - marker.t0, n)  # the round shares one stamp
        self._ack_due = True

    def _refresh_partitions(self, timeout: float) -> None:
        """Partition counts of the target topics (a count change re-keys the topic cache)."""
        targets = {self._default_topic, *self._topic_map.values()}
        try:
            md = self._producer.list_topics(timeout=timeout)
        except KafkaException:
            return
        n = {t: len(md.topics[t].partitions) for t in targets
             if t in md.topics and md.topics[t].error is None and md.topics[t].partitions}
        if n != self._nparts:
            self._nparts = n
            self._topics.clear()

    def _fall_back(self, reason: str, per_record: bool = True) -> None:
        """Start over with a new producer and a reconnect, so the MQTT broker re-delivers
        everything not yet acknowledged (duplicates are removed downstream). After an unexpected
        Kafka error the new producer reports every record (a bad record is dead-lettered again);
        after a stall (``per_record=False``) the delivery mode stays."""
        if per_record:
            log.warning("bridge %s: %s; now confirming every Kafka delivery separately and "
                        "re-reading unacknowledged messages from MQTT", self.bridge_id, reason)
        else:
            log.warning("bridge %s: %s; starting over with a new Kafka producer and re-reading "
                        "unacknowledged messages from MQTT", self.bridge_id, reason)
        self._fast = self._fast and not per_record
        self._closing = True
        old = self._producer
        self._discard(old)
        self._closing = False
        self._fatal = self._degrade = None
        self._producer = Producer(self._producer_config())
        self._pending.clear()
        self._parts.clear()
        self._retry.clear()
        self._round.clear()
        self._gen += 1  # no ack of a message taken before this point may go out
        self._last_confirm = time.monotonic()
        self._refresh_partitions(1.0)
        if self._client.socket() is not None:
            self._connected = False
            self._client.disconnect()

    def _stalled(self, now: float, limit: float) -> bool:
        """Messages wait longer than ``limit`` and nothing was confirmed for as long, while Kafka
        answers: its producer state is gone (e.g. a broker that came back empty answers every
        produce with UNKNOWN_PRODUCER_ID, which librdkafka retries for ever)."""
        if not self._pending or now - self._pending[0].t0 < limit or now - self._last_confirm < limit:
            return False
        try:
            self._producer.list_topics(timeout=1.0)
        except KafkaException:  # Kafka is away: waiting is all there is to do
            return False
        return True

    def _stamp(self) -> None:
        """Receive time of what the next handled messages arrived with (one socket read)."""
        self._rx_t0 = time.monotonic()
        self._rx_at = ("received_at", b"%d" % (time.time_ns() // 1_000_000))

    def _topic_info(self, topic_raw: bytes) -> tuple:
        """(topic, Kafka topic or None, key, mqtt_topic header, (Kafka topic, partition) or None)
        of an MQTT topic, cached. The partition is librdkafka's own choice for the key (CRC32
        modulo the partition count), made here so per-round delivery reports know it."""
        if len(self._topics) > 65_536:
            self._topics.clear()
        # invalid UTF-8 (brokers should reject it) must not crash the bridge
        topic = topic_raw.decode("utf-8", "replace")
        target, key = self._route(topic), self._key(topic)
        n = self._nparts.get(target) if target else None
        pkey = (target, zlib.crc32(key) % n) if n and key is not None else None
        sp = parse_topic(topic) if self._rebirth else None
        info = (topic, target, key, ("mqtt_topic", topic_raw), pkey, sp)
        self._topics[topic_raw] = info
        return info

    def _handle(self, topic_raw: bytes, mid: int, qos: int, retain: int, payload: bytes) -> None:
        self._c["received"] += 1
        info = self._topics.get(topic_raw) or self._topic_info(topic_raw)
        if info[5] is not None:
            self._sparkplug_node(info[5])
        headers = [info[3], _QOS[qos], _RETAIN[1 if retain else 0], self._rx_at, self._bid_header]
        e = _Entry(self, mid, qos, self._gen, self._rx_t0, info[0], payload, headers)
        self._pending.append(e)
        target = info[1]
        if target is None:
            self._dead_letter(e, "unmapped_topic")
        elif len(payload) > self._max_payload:
            self._dead_letter(e, "payload_too_large")
        else:  # a report of its own; the same partition as the per-round path would choose
            self._produce(e, target, info[2], payload, headers, info[4][1] if info[4] else -1)

    def _sparkplug_node(self, sp: SparkplugTopic) -> None:
        """Track an edge node's births; ask a node that sends without one for a rebirth."""
        key = sp.node_key
        if sp.type == "NBIRTH":
            self._born.add(key)
        elif sp.type == "NDEATH":
            self._born.discard(key)
        elif key not in self._born:
            now = time.monotonic()
            if now - self._asked.get(key, -self._rebirth_every) >= self._rebirth_every:
                self._asked[key] = now
                self._client.publish(f"{NAMESPACE}/{sp.group}/NCMD/{sp.node}",
                                     rebirth_request(int(time.time() * 1000)), qos=0)
                log.info("bridge %s: asked Sparkplug node %s for a rebirth (%s before any birth)",
                         self.bridge_id, key, sp.type)

    # ---- routing -------------------------------------------------------------------------
    def _route(self, topic: str) -> str | None:
        """Kafka topic for an MQTT topic: first matching ``bridge.topic_map`` pattern (cached)."""
        if not self._topic_map:
            return self._default_topic
        try:
            return self._routes[topic]
        except KeyError:
            pass
        if len(self._routes) > 65_536:
            self._routes.clear()
        target = next((t for pattern, t in self._topic_map.items()
                       if mqtt.topic_matches_sub(pattern, topic)), None)
        self._routes[topic] = target
        return target

    def _key(self, topic: str) -> bytes | None:
        sp = parse_topic(topic)
        if sp is not None:  # an edge node's messages keep their order: one key (partition) per node
            return sp.node_key.encode()
        if self._dev_level is None:
            return None
        levels = topic.split("/")
        return levels[self._dev_level].encode() if len(levels) > self._dev_level else None

    # ---- Kafka ---------------------------------------------------------------------------
    def _produce(self, e: _Entry, topic: str, key: bytes | None, value: bytes,
                 headers: list[tuple[str, bytes]], partition: int = -1, report: bool = True) -> None:
        while True:
            try:
                if report:
                    self._producer.produce(topic, value, key, partition, headers=headers,
                                           on_delivery=e)
                else:  # confirmed by a later record's report (_flush_round)
                    self._producer.produce(topic, value, key, partition, headers=headers)
                return
            except BufferError:  # local queue full: serve callbacks, then retry
                self._poll(0.05)
            except KafkaException as ex:  # rejected before sending (e.g. too large)
                if self._fast:  # its partition's round can no longer vouch for it
                    self._degrade = f"produce_error:{ex.args[0].name()}"
                    return
                if e.dlq:
                    self._schedule_retry(e, f"produce_error:{ex.args[0].name()}")
                else:
                    self._dead_letter(e, f"produce_error:{ex.args[0].name()}")
                return

    def _dead_letter(self, e: _Entry, reason: str) -> None:
        e.dlq = True
        value = e.payload
        headers = [*e.headers, ("dlq_reason", reason.encode()),
                   ("payload_bytes", str(len(value)).encode())]
        if len(value) > DLQ_MAX_VALUE:
            value = value[:DLQ_MAX_VALUE]
            headers.append(("truncated", b"1"))
        log.debug("dead-letter %s: %s", e.topic, reason)
        self._produce(e, self._dlq_topic, self._key(e.topic), value, headers)

    def _schedule_retry(self, e: _Entry, reason: str) -> None:
        log.error("dead-letter delivery failed (%s); retrying in 1s, message stays unacked", reason)
        self._retry.append((time.monotonic() + 1.0, e, reason))

    def _on_delivery(self, e: _Entry, err: KafkaError | None, msg: Any) -> None:
        if self._closing:
            return
        if err is None:
            e.done = True
            self._last_confirm = time.monotonic()
            self._c["dead_lettered" if e.dlq else "delivered"] += 1
            self.latency.observe(time.monotonic() - e.t0)
            self._ack_due = True  # acked in one write after this poll round (_poll)
            return
        self._c["failed"] += 1
        if self._fast and (e.pkey is not None or err.fatal()):
            self._degrade = f"Kafka error {err.name()}"  # handled by the run loop
            return
        if err.fatal():
            self._fatal = err
            return
        log.warning("Kafka delivery failed for %s: %s", e.topic, err)
        if e.dlq:
            self._schedule_retry(e, err.name())
        else:
            self._dead_letter(e, f"kafka_error:{err.name()}")

    def _poll(self, timeout: float) -> None:
        """Serve Kafka's delivery callbacks, then ack what they confirmed."""
        self._producer.poll(timeout)
        if self._ack_due:
            self._ack_ready()

    def _ack_ready(self) -> None:
        """Ack in receive order (MQTT requires it) every message Kafka has confirmed, as one
        write (QoS 2 messages, which the bridge does not subscribe with, one by one)."""
        self._ack_due = False
        if self._degrade is not None or (self._fatal is not None and self._fast):
            return  # a record may be missing behind a confirmed one: nothing is acked now
        p, gen = self._pending, self._gen
        mids: list[int] = []
        while p and p[0].done:
            e = p.popleft()
            if e.mid and e.gen == gen and self._connected:
                if e.qos == 1:
                    mids.append(e.mid)
                else:
                    self._client.ack(e.mid, e.qos)
                self._c["acked"] += 1
        if mids:
            self._client.ack_many(mids)

    # ---- main loop -----------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        return {**self._c, "in_flight": len(self._pending), "connected": int(self._connected)}

    def run(self, stop: threading.Event) -> None:
        """Bridge until ``stop`` is set, then flush Kafka, ack what it confirmed, disconnect."""
        b = self.settings.bridge
        stop_metrics = (serve(b.metrics_port, BridgeCollector(self.bridge_id, lambda: self.stats,
                                                              self.latency),
                              self.settings.observability.metrics_bind)
                        if b.metrics_port else None)
        next_log = time.monotonic() + (b.log_interval_seconds or float("inf"))
        last, last_t = dict(self._c), time.monotonic()
        next_connect = 0.0
        paused_read = 0.0
        client = self._client
        host, port = self.settings.mqtt_endpoint
        try:
            self._await_kafka(stop, b.kafka_ready_timeout_seconds)
            self._refresh_partitions(5.0 if self.kafka_ready.is_set() else 0.2)
            next_refresh = time.monotonic() + 30.0
            next_stall_check = time.monotonic() + 1.0
            while not stop.is_set():
                if self._degrade is not None or (self._fatal is not None and self._fast):
                    self._fall_back(self._degrade or f"Kafka error {self._fatal.name()}")
                if self._fatal is not None:
                    raise KafkaException(self._fatal)
                now = time.monotonic()
                if now >= next_refresh:  # new topics or partitions
                    self._refresh_partitions(0.5)
                    next_refresh = now + 30.0
                if now >= next_stall_check:
                    next_stall_check = now + 1.0
                    if self._stalled(now, b.delivery_stall_seconds):
                        self._fall_back(f"Kafka is reachable but confirmed nothing for "
                                        f"{b.delivery_stall_seconds:.0f}s", per_record=False)
                if client.socket() is None:
                    if now >= next_connect:
                        self._delay = min(max(self._delay * 2, 0.25), 10.0)
                        next_connect = now + self._delay
                        try:
                            client.connect(host, port, keepalive=b.keepalive_seconds,
                                           **self._connect_kwargs())
                        except OSError as ex:
                            log.warning("MQTT %s:%d unreachable (%s); retrying in %.1fs",
                                        host, port, ex, self._delay)
                    self._poll(0.05)
                    continue
                if len(self._pending) < self._max:
                    self._pump(0.001 if self._pending else 0.05)
                else:  # backpressure: keep acking and pinging, stop reading
                    self._poll(0.01)
                    client.loop_write()
                    client.loop_misc()
                    if now - paused_read > 1.0:  # PINGRESP must still be read
                        paused_read = now
                        client.loop_read()
                self._poll(0)
                if self._retry:
                    self._run_retries(now)
                if now >= next_log:
                    self._log_progress(last, now - last_t)
                    last, last_t = dict(self._c), now
                    next_log = now + b.log_interval_seconds
        finally:
            self._shutdown(b.shutdown_timeout_seconds)
            if stop_metrics:
                stop_metrics()

    def _pump(self, timeout: float) -> None:
        """Select on paho's socket ourselves (its documented external-loop API; ``loop()`` would
        add a wake-up socket pair costing two syscalls per ack), then read what is buffered."""
        client, c = self._client, self._c
        sock = client.socket()
        # Bytes already read (by us, or decrypted by TLS) are invisible to select().
        buffered = client.buffered() > 0 or (hasattr(sock, "pending") and sock.pending() > 0)
        try:
            readable, writable, _ = select.select(
                [sock], [sock] if client.want_write() else [], [], 0 if buffered else timeout)
        except (OSError, ValueError):  # socket closed under us: let paho notice
            readable, writable = [sock], []
        rc = client.loop_write() if writable else mqtt.MQTT_ERR_SUCCESS
        n = 0
        while (readable or buffered) and rc == mqtt.MQTT_ERR_SUCCESS and n < 1000 \
                and len(self._pending) < self._max and client.socket() is not None:
            before = c["received"]
            self._stamp()
            rc = client.loop_read()  # one packet by paho (refills the read buffer) ...
            # ... then every complete QoS-1 PUBLISH behind it without paho's per-packet cost
            client.drain_publishes(self._on_publish_fast, self._max - len(self._pending))
            self._flush_round()
            if c["received"] == before and n:
                break
            n += 1
            self._poll(0)
        if client.socket() is not None:
            client.loop_misc()

    def _run_retries(self, now: float) -> None:
        due = [r for r in self._retry if r[0] <= now]
        self._retry = [r for r in self._retry if r[0] > now]
        for _, e, reason in due:
            e.dlq = False
            self._dead_letter(e, reason)

    def _log_progress(self, last: dict[str, int], elapsed: float) -> None:
        s = self.stats
        rate = (s["received"] - last["received"]) / max(elapsed, 1e-3)
        log.info("bridge %s: %.0f msg/s received=%d delivered=%d dead_lettered=%d failed=%d "
                 "in_flight=%d reconnects=%d p99<=%.3fs", self.bridge_id, rate, s["received"],
                 s["delivered"], s["dead_lettered"], s["failed"], s["in_flight"], s["reconnects"],
                 self.latency.quantile(0.99))

    def _shutdown(self, timeout: float) -> None:
        client, producer = self._client, self._producer
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline and self._fatal is None:
            self._poll(0.05)
            if client.socket() is not None:
                client.loop_write()
        left = len(self._pending)
        if left:
            log.warning("bridge %s: %d messages unconfirmed at shutdown; the broker will "
                        "re-deliver them", self.bridge_id, left)
        if client.socket() is not None:
            self._connected = False
            client.disconnect()
            end = time.monotonic() + 5
            while client.socket() is not None and time.monotonic() < end:
                client.loop(0.05)
        producer.flush(min(timeout, 5.0))
        # Drop what Kafka did not confirm (it is unacked, so the broker re-delivers it) and
        # release the producer: a stopped bridge must not keep reconnecting to Kafka.
        self._closing = True
        self._discard(producer)
        log.info("bridge %s stopped: %s", self.bridge_id, self.stats)

    def _discard(self, producer: Producer) -> None:
        """Drop what the producer holds (unacked, so MQTT re-delivers it) and release it. Purging
        records in flight is a fatal error under gap-less ordering, raised by ``close``: harmless
        for a producer being thrown away, so it must not stop the bridge."""
        try:
            producer.purge()
            producer.poll(0)
            if hasattr(producer, "close"):  # not in older confluent-kafka
                producer.close()
        except KafkaException as e:
            log.info("bridge %s: discarded producer ended with %s", self.bridge_id, e)


@contextlib.contextmanager
def tuned_gc() -> Iterator[None]:
    """For a process that is only a bridge: the hot path allocates a few objects per message
    while up to ``max_inflight`` entries stay alive, so CPython's default (a collection every 700
    allocations) kept rescanning them (capacity bench: ~7% of the drain rate). Entries are freed
    by reference counting; cycles are rare and collected every 50k allocations instead. Not for
    ``iotlake run``, whose bridge thread shares its process with the Spark driver."""
    before = gc.get_threshold()
    gc.freeze()  # what start-up loaded is never garbage: out of every future scan
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:  # frozen objects are never freed: extension modules would report leaks at exit
        gc.set_threshold(*before)
        gc.unfreeze()
