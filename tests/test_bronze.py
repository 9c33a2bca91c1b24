"""Bronze on Spark's Kafka source, appended to Delta per micro-batch, against the real broker:
records land byte for byte with their coordinates, once, across restarts, within the trigger
limit."""

from __future__ import annotations

import json
import time
from datetime import datetime

from confluent_kafka import Producer

import bronze.stream
from lakehouse.delta.read import read_table
from lakehouse.kafka.config import client_config
from lakehouse.settings import Settings

#: Record timestamps near now: the broker's time retention would delete older ones at once.
T0_MS = int(time.time() * 1000)


def produce(settings: Settings, start: int, n: int) -> dict[tuple[int, int], tuple]:
    """n records over partitions 0 and 1: keys (some null), binary values (some not UTF-8),
    headers on every third. Returns (partition, offset) -> (key, value, ts_ms, headers)."""
    p = Producer(client_config(settings, **{"linger.ms": 20}))
    sent: dict[tuple[int, int], tuple] = {}
    for i in range(start, start + n):
        headers = [("src", b"test"), ("bin", bytes([i % 256, 0, 255]))] if i % 3 == 0 else None
        key = None if i % 5 == 0 else f"dev-{i % 7}".encode()
        value = f'{{"i":{i}}}'.encode() if i % 4 else b"\xff\x00raw" + i.to_bytes(4, "big")
        rec = (key, value, T0_MS + i, headers)

        def done(err, msg, rec=rec) -> None:
            assert err is None, err
            sent[(msg.partition(), msg.offset())] = rec

        p.produce(settings.kafka.topic, value, key, partition=i % 2, timestamp=rec[2],
                  headers=headers, on_delivery=done)
    assert p.flush(30) == 0
    return sent


def bronze_rows(settings: Settings) -> dict[tuple[int, int], tuple]:
    t = read_table(settings.table_path("bronze")).to_pylist()
    keys = [(r["partition"], r["offset"]) for r in t]
    assert len(keys) == len(set(keys)), "a (partition, offset) was written twice"
    assert {r["topic"] for r in t} <= {settings.kafka.topic}
    assert all(r["ingest_time"] is not None for r in t)
    return {(r["partition"], r["offset"]): (
        r["key"], r["value"], round(r["timestamp"].timestamp() * 1000),
        [(h["key"], h["value"]) for h in r["headers"] or []] or None) for r in t}


def run(spark, settings: Settings, **kw):
    q = bronze.stream.start(spark, settings, "available_now", **kw)
    q.awaitTermination(300)
    assert not q.isActive and q.exception() is None
    return q


def test_empty_table_exists_before_data(settings: Settings, spark) -> None:
    q = bronze.stream.start(spark, settings, "live")
    try:
        assert read_table(settings.table_path("bronze")).num_rows == 0  # readable at once
    finally:
        q.stop()


def test_records_byte_for_byte_limit_per_trigger_and_resume(settings: Settings, spark) -> None:
    sent = produce(settings, 0, 500)
    q = run(spark, settings, max_offsets=100)
    batches = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sum(batches) == 500 and max(batches) <= 100 and len(batches) == 5, \
        [(p["batchId"], p["numInputRows"], p["sources"][0]["startOffset"], p["sources"][0]["endOffset"]) for p in q.recentProgress]
    assert bronze_rows(settings) == sent
    end = q.lastProgress["sources"][0]["endOffset"]
    assert json.loads(end) == {settings.kafka.topic: {"0": 250, "1": 250}}

    late = produce(settings, 500, 60)
    run(spark, settings, max_offsets=100)  # a new query on the same checkpoint: resumes
    assert bronze_rows(settings) == sent | late
    run(spark, settings)  # nothing new: nothing written
    assert bronze_rows(settings) == sent | late


def test_killed_mid_run_restart_loses_nothing_and_duplicates_nothing(settings: Settings, spark) -> None:
    sent = produce(settings, 0, 2000)
    q = bronze.stream.start(spark, settings, "live", max_offsets=50)
    deadline = time.monotonic() + 120
    while (not q.lastProgress or q.lastProgress["batchId"] < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    q.stop()  # mid-stream, possibly mid-batch
    assert 0 < len(bronze_rows(settings)) < 2000
    sent |= produce(settings, 2000, 100)
    run(spark, settings)
    assert set(bronze_rows(settings)) == set(sent)
    assert bronze_rows(settings) == sent


def test_slow_traffic_is_batched_up_to_the_delay(settings: Settings, spark) -> None:
    """``stream.min_offsets_per_trigger``: records trickling in for ~3 s at a 0.2 s trigger land
    in a batch per 2 s delay (two, unless a loaded machine stretches the trickle), not about
    one per trigger."""
    settings.stream.trigger_seconds = 0.2
    settings.stream.min_offsets_per_trigger = 10_000
    settings.stream.max_batch_delay_seconds = 2.0
    q = bronze.stream.start(spark, settings, "live")
    try:
        def landed(n: int) -> None:
            deadline = time.monotonic() + 60
            while len(bronze_rows(settings)) < n and time.monotonic() < deadline:
                time.sleep(0.1)

        def reported() -> list[int]:
            return [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]

        def progressed(n: int) -> None:  # a batch's rows are visible before its progress is posted
            deadline = time.monotonic() + 30
            while sum(reported()) < n and time.monotonic() < deadline:
                time.sleep(0.05)

        sent = produce(settings, 0, 5)
        landed(5)  # the query runs: its first batch is behind it
        progressed(5)
        first = len(reported())
        for k in range(1, 11):
            sent |= produce(settings, k * 5, 5)
            time.sleep(0.3)
        trickled = time.time()
        landed(55)
        progressed(55)
        assert bronze_rows(settings) == sent
        batches = reported()[first:]
        # the delay runs from the last batch's trigger: one batch per delay the trickle spans
        since = datetime.fromisoformat([p for p in q.recentProgress if p["numInputRows"]][first - 1]["timestamp"])
        allowed = 1 + int((trickled - since.timestamp()) // settings.stream.max_batch_delay_seconds)
        assert sum(batches) == 50 and len(batches) <= allowed, (batches, allowed)
    finally:
        q.stop()
