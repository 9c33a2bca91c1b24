"""The embedded Apache Kafka: durable across restarts, configured from settings."""

from __future__ import annotations

import os
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from lakehouse.kafka.topics import ensure_topics
from lakehouse.runtime import native_memory
from lakehouse.settings import Settings, load_settings
from orchestration.services import free_port, java_binary, kafka_service


def _records(settings: Settings) -> dict[tuple[int, int], bytes]:
    """(partition, offset) -> value of every record of the telemetry topic."""
    topic = settings.kafka.topic
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "durability",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 50})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: dict[tuple[int, int], bytes] = {}
        while sum(ends.values()) > len(out):
            m = c.poll(5)
            assert m is not None, f"read {len(out)} of {sum(ends.values())} records"
            assert m.error() is None, m.error()
            out[(m.partition(), m.offset())] = m.value()
        return out
    finally:
        c.close()


def test_records_and_offsets_survive_broker_restarts(tmp_path: Path) -> None:
    """SIGTERM (a controlled shutdown), then a start on the same log dir: every record is there
    at its offset, and new records follow the old ones; the same after kill -9 (what Kafka
    acknowledged is in its log files, which it recovers at start)."""
    port = free_port(pair=True)
    s = load_settings(environ={}, data_root=str(tmp_path),
                      kafka={"embedded_port": port, "partitions": 2})
    broker = kafka_service(s).start()
    try:
        # the options of every long-running JVM (lakehouse.runtime.native_memory)
        cmdline = Path(f"/proc/{broker.proc.pid}/cmdline").read_text().split("\0")
        assert set(native_memory.jvm_options(java_binary())) <= set(cmdline)
        ensure_topics(s)
        p = Producer({"bootstrap.servers": s.kafka_bootstrap, "acks": "all",
                      "enable.idempotence": True, "linger.ms": 5})
        for i in range(500):
            p.produce(s.kafka.topic, key=f"d{i % 7}".encode(), value=f"r{i}".encode())
        assert p.flush(30) == 0
        before = _records(s)
    finally:
        broker.stop()
    assert broker.proc.returncode == 143  # stopped by SIGTERM, not killed
    assert len(before) == 500
    broker = kafka_service(s).start()  # no second format: meta.properties is there
    try:
        ensure_topics(s)
        after = _records(s)
        p = Producer({"bootstrap.servers": s.kafka_bootstrap, "acks": "all"})
        p.produce(s.kafka.topic, key=b"d0", value=b"new", partition=0)
        assert p.flush(30) == 0
        newest = _records(s)
    finally:
        broker.proc.kill()  # kill -9
        broker.proc.wait(10)
    assert after == before
    ends = {part: max(o for (q, o) in before if q == part) for part in (0, 1)}
    assert newest[(0, ends[0] + 1)] == b"new" and len(newest) == 501
    broker = kafka_service(s).start()
    try:
        assert _records(s) == newest
    finally:
        broker.stop()


def test_retention_settings_reach_the_broker(brokers, services_settings: Settings) -> None:
    admin = AdminClient({"bootstrap.servers": services_settings.kafka_bootstrap})
    res = ConfigResource(ConfigResource.Type.BROKER, "1")
    conf = admin.describe_configs([res])[res].result(timeout=20)
    k = services_settings.kafka
    assert conf["log.retention.hours"].value == str(k.embedded_retention_hours)
    assert conf["log.retention.bytes"].value == str(k.embedded_retention_bytes)
    assert conf["log.segment.bytes"].value == str(k.embedded_segment_bytes)
    assert conf["auto.create.topics.enable"].value == "false"
    # ...and apply to the topics ensure_topics created (no topic-level override)
    topic = ConfigResource(ConfigResource.Type.TOPIC, k.topic)
    tconf = admin.describe_configs([topic])[topic].result(timeout=20)
    assert tconf["retention.bytes"].value == str(k.embedded_retention_bytes)
    assert tconf["retention.ms"].value == str(k.embedded_retention_hours * 3_600_000)
    assert tconf["segment.bytes"].value == str(k.embedded_segment_bytes)


def test_a_broker_left_running_by_a_killed_run_is_stopped_at_the_next_start(tmp_path: Path) -> None:
    """Brokers run in their own session, so kill -9 of `iotlake run` leaves them running: the
    next start stops that one (it holds the ports and the data) instead of failing. Shown with
    Mosquitto, which starts in milliseconds; Kafka uses the same code."""
    from orchestration.services import mosquitto_service

    port = free_port()
    s = load_settings(environ={}, data_root=str(tmp_path))
    old = mosquitto_service(s, port).start()  # its owner "dies": nobody stops it
    new = mosquitto_service(s, port).start()
    try:
        assert old.proc.wait(10) == 0  # stopped by SIGTERM
        assert new.running and new.proc.pid != old.proc.pid
    finally:
        new.stop()


def test_the_broker_maps_its_class_archive(brokers) -> None:
    """`make test` records the broker's class archive; the session's broker maps it (a broker
    without one, or with a stale one, starts as before)."""
    from lakehouse.runtime import jars

    archive = jars.kafka_class_archive()
    kafka = next(s for s in brokers if s.name == "kafka")
    maps = Path(f"/proc/{kafka.proc.pid}/maps").read_text()
    assert (str(archive) in maps) == archive.is_file(), archive
    if os.environ.get("CI"):  # `make test` built it: CI must not pass without it
        assert archive.is_file()
