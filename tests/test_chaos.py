"""Chaos: kill -9 pipeline processes and stop Mosquitto under load; nothing lost, nothing
duplicated, gold exact (the short version of ``bench/chaos.py``, same harness)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from ingest.simulator import generate
from lakehouse.chaos import ChaosConfig, Publisher, free_port, run_chaos
from lakehouse.run import bridge_thread
from lakehouse.services import mosquitto_service
from lakehouse.settings import Settings


@pytest.mark.slow
def test_chaos_kills_and_mosquitto_outage(tmp_path: Path) -> None:
    """3 kill -9s (bridge, whole run, bridge) and one Mosquitto stop/start under steady load."""
    cfg = ChaosConfig(root=tmp_path, kills=3, rate=40, devices=10, seed=8, roles=("bridge", "streams"),
                      mosquitto_outages=1, interval=(3.0, 6.0), downtime=(0.5, 2.0), ready_timeout=25,
                      warmup_seconds=3, tail_seconds=3, drain_timeout=300, trigger_seconds=0.5)
    t0 = time.monotonic()
    r = run_chaos(cfg)
    print("\nchaos:", json.dumps({k: v for k, v in r.items() if k != "detail"}), json.dumps(r["detail"]))
    assert r["kills"] == 3 and r["whole_run_kills"] == 1
    assert r["kills_by_role"] == {"bridge": 3, "streams": 1}  # whole run kills both
    assert r["broker_outages"] == {"mosquitto": 1}
    assert r["published"] > 0 and r["bronze_rows"] >= r["published"]
    assert (r["lost"], r["duplicated"], r["mismatched_windows"]) == (0, 0, 0), r["detail"]
    assert r["accounting_ok"] and not r["detail"]["missing_files"], r["detail"]
    assert r["stuck"] == [], r
    assert r["ok"]
    # ~2.5 min on an idle 2-core machine; the bound leaves room for a slow Spark start
    assert time.monotonic() - t0 < 480


def _kafka_ids(settings: Settings, expect: int, timeout: float = 60.0) -> list[str]:
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": f"chaos-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 50})
    topic = settings.kafka.topic
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, -2) for p in parts])
        out, deadline, quiet_since = [], time.monotonic() + timeout, time.monotonic()
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                if len(out) >= expect and time.monotonic() - quiet_since > 2.0:
                    break
                continue
            if m.error() is None:
                out.append(json.loads(m.value())["event_id"])
                quiet_since = time.monotonic()
        return out
    finally:
        c.close()


def test_mosquitto_restart_keeps_queued_messages_for_the_bridge(settings: Settings) -> None:
    """Mosquitto stopped mid-load (bridge up) and again while the bridge is down with messages
    queued for its persistent session: after restarts every message reaches Kafka."""
    port = free_port()
    s = Settings.model_validate({**settings.model_dump(), "mqtt": {
        **settings.mqtt.model_dump(), "port": port, "client_id": f"{settings.mqtt.client_id}-mq"}})
    broker = mosquitto_service(s, port).start()
    msgs = generate(s, 1500, devices=10, seed=5)
    first, second, third = msgs[:600], msgs[600:1100], msgs[1100:]
    try:
        with bridge_thread(s):
            pub = Publisher(s, iter(first), rate=200).start()
            time.sleep(1.0)
            broker.stop()  # mid-load, bridge connected
            time.sleep(1.5)
            broker = mosquitto_service(s, port).start()
            assert pub.finish(timeout=60, stop=False) == len(first)
        # bridge down: the broker queues for its session; then the broker restarts too
        pub = Publisher(s, iter(second), rate=500).start()
        assert pub.finish(timeout=60, stop=False) == len(second)
        broker.stop()
        broker = mosquitto_service(s, port).start()
        with bridge_thread(s):
            pub = Publisher(s, iter(third), rate=500).start()
            assert pub.finish(timeout=60, stop=False) == len(third)
            got = _kafka_ids(s, len(msgs))
    finally:
        broker.stop()
    assert set(got) == {m.event_id for m in msgs}  # nothing lost
    assert len(got) >= len(msgs)  # redelivery may duplicate (silver deduplicates by event id)
    print(f"\nmosquitto restarts: {len(msgs)} published, {len(got)} in Kafka "
          f"({len(got) - len(msgs)} redelivered duplicates)")
