"""BufferedClient's fast PUBLISH decoding, on hand-built MQTT frames (the broker path is covered
by test_bridge): it must decode exactly what paho would and leave everything else to paho."""

from __future__ import annotations

import paho.mqtt.client as mqtt
from paho.mqtt.enums import _ConnectionState

from ingest.mqtt_client import BufferedClient


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n % 128, n // 128
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def publish(topic: bytes, mid: int, payload: bytes, qos: int = 1, retain: int = 0,
            props: bytes | None = None) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += mid.to_bytes(2, "big")
    if props is not None:
        body += varint(len(props)) + props
    body += payload
    return bytes([0x30 | qos << 1 | retain]) + varint(len(body)) + body


def client(v5: bool, data: bytes) -> BufferedClient:
    c = BufferedClient(mqtt.CallbackAPIVersion.VERSION2, client_id="t",
                       protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
    c._state = _ConnectionState.MQTT_CS_CONNECTED
    c._rbuf, c._rpos = data, 0
    return c


def test_decodes_v5_with_properties_and_large_payloads() -> None:
    user_prop = b"\x26" + (3).to_bytes(2, "big") + b"key" + (5).to_bytes(2, "big") + b"value"
    frames = [publish(b"d/dev-1/t", 7, b'{"a":1}', props=b""),
              publish(b"d/dev-2/t", 65535, b"x" * 20_000, retain=1, props=user_prop),
              publish("d/\u00e9/t".encode(), 1, b"", props=b"")]
    got: list[tuple] = []
    c = client(True, b"".join(frames))
    assert c.drain_publishes(lambda *a: got.append(a), 10) == 3
    assert got == [(b"d/dev-1/t", 7, 0, b'{"a":1}'), (b"d/dev-2/t", 65535, 1, b"x" * 20_000),
                   ("d/\u00e9/t".encode(), 1, 0, b"")]
    assert c.buffered() == 0


def test_stops_at_partial_and_foreign_packets_and_honours_limit() -> None:
    a, b = publish(b"t/1", 1, b"one"), publish(b"t/2", 2, b"two")
    qos0 = publish(b"t/3", 0, b"three", qos=0)
    got: list[tuple] = []
    c = client(False, a + b + qos0 + a)
    assert c.drain_publishes(lambda *x: got.append(x), 1) == 1  # limit
    assert c.drain_publishes(lambda *x: got.append(x), 10) == 1  # stops before the QoS 0 one
    assert [g[1] for g in got] == [1, 2] and c.buffered() == len(qos0) + len(a)
    c = client(False, a + b[:-1])  # the second frame is cut short: left for paho / next read
    assert c.drain_publishes(lambda *x: None, 10) == 1 and c.buffered() == len(b) - 1
    c = client(False, a)
    c._in_packet["command"] = 0x32  # paho is mid-packet: never interleave
    assert c.drain_publishes(lambda *x: None, 10) == 0
