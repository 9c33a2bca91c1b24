"""Chaos: kill -9 pipeline processes and stop Mosquitto and Kafka under load; nothing lost, nothing
duplicated, gold exact (the short version of ``bench/chaos.py``, same harness)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from chaos_harness import Publisher, final_window_problems, missing_files, snapshot_files
from confluent_kafka import Consumer, TopicPartition
from deltalake import write_deltalake

from bench.chaos import main as chaos_bench
from ingest.simulator import generate
from lakehouse.settings import Settings, load_settings
from lakehouse.tables import METRIC_WINDOWS
from orchestration.run import bridge_thread
from orchestration.services import free_port, mosquitto_service


@pytest.mark.slow
def test_chaos_kills_and_broker_outages(tmp_path: Path, capsys: pytest.CaptureFixture[str], spark) -> None:
    """``bench/chaos.py --smoke`` (so the bench cannot rot): 3 kill -9s (bridge, whole run,
    bridge), one Mosquitto and one Kafka stop/start and one compaction (bronze, silver, a gold
    MERGE target) under steady load. The compaction runs in this process, on the worker's own
    session (``spark``): started here, it would be a short-lived JVM's (C1 only, a batch
    process's mode) that the worker's later tests then share.

    Event time runs 20x faster than the clock, so a one-minute run closes windows under the 10 min
    watermark and the final-window tables are checked with rows in them."""
    t0 = time.monotonic()
    rc = chaos_bench(["--smoke", "--dir", str(tmp_path)])
    out, err = capsys.readouterr()
    r = json.loads(out.strip().splitlines()[-1])
    detail = next(json.loads(line) for line in reversed(err.splitlines())
                  if line.startswith("{") and "tables_checked" in line)
    print("\nchaos:", json.dumps(r), json.dumps(detail))
    assert r["kills"] == 3 and r["whole_run_kills"] == 1
    assert r["kills_by_role"] == {"bridge": 3, "streams": 1}  # whole run kills both
    assert r["broker_outages"] == {"mosquitto": 1, "kafka": 1}
    assert len(r["compacted_files"]) == 1 and r["compacted_files"][0] > 0  # it rewrote files
    assert r["published"] > 0 and r["bronze_rows"] >= r["published"]
    assert (r["lost"], r["duplicated"], r["mismatched_windows"]) == (0, 0, 0), detail
    assert r["accounting_ok"] and not detail["missing_files"], detail
    assert detail["tables_checked"] >= 8 and detail["files_checked"] > 0, detail
    assert r["final_windows_bad"] == 0, detail["final_window_problems"]
    assert all(n > 0 for n in r["final_windows"].values()), r["final_windows"]  # not vacuous
    assert r["stuck"] == [], r
    assert r["ok"] and rc == 0
    # ~4 min on a 2-core machine shared with other jobs; the bound leaves room for a slow Spark start
    assert time.monotonic() - t0 < 480


def _windows(rows: list[tuple[int, float]]) -> pa.Table:
    """1-minute windows of dev-00001's temperature: (minute, mean) each."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return pa.Table.from_pylist([
        {"device_id": "dev-00001", "metric": "temperature", "window_start": t0 + timedelta(minutes=m),
         "window_end": t0 + timedelta(minutes=m + 1), "count": 2, "mean": v, "min": v - 1, "max": v + 1,
         "stddev": None, "last": v} for m, v in rows], schema=METRIC_WINDOWS)


def test_end_of_run_checks_catch_bad_final_windows_and_missing_files(tmp_path: Path) -> None:
    """The chaos verification is not vacuous: a final window appended twice, one that differs
    from its merged row, one the merged table lacks, merged windows that never became final
    and a deleted data file are each reported; a correct copy reports nothing."""
    s = load_settings(environ={}, data_root=str(tmp_path), gold={"slide_window_seconds": 300})
    merged = [(0, 20.0), (1, 21.0), (2, 22.0), (3, 23.0)]
    tables = {"gold_metrics_1m": [merged], "gold_metrics_1m_final": [[(0, 20.0), (2, 22.5)], [(0, 20.0), (9, 1.0)]],
              "gold_metrics_5m": [merged], "gold_metrics_5m_final": [merged[:2]]}
    for name, batches in tables.items():
        for rows in batches:
            write_deltalake(s.table_path(name), _windows(rows), mode="append")
    assert final_window_problems(s) == {
        "gold_metrics_1m_final": {"rows": 4, "duplicate_keys": 1, "not_in_merged": 1, "differ": 1,
                                  "never_final": 2},  # minutes 1 and 3 end before minute 9 does
        "gold_metrics_5m_final": {"rows": 2, "duplicate_keys": 0, "not_in_merged": 0, "differ": 0,
                                  "never_final": 0}}
    off = load_settings(environ={}, data_root=str(tmp_path))  # the default: no sliding tables
    assert list(final_window_problems(off)) == ["gold_metrics_1m_final"]
    assert missing_files(s) == {}
    victim = snapshot_files(s)["gold_metrics_5m"][0]
    victim.unlink()
    assert missing_files(s) == {"gold_metrics_5m": 1}


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
