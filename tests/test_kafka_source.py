"""The Kafka source on a real Tansu: offsets, trigger limits, splitting, the high-watermark quirk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from deltalake import DeltaTable
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

import bronze.stream
from lakehouse.delta_source import commit_adds, latest_version
from lakehouse.kafka_config import client_config
from lakehouse.kafka_source import (
    CLUSTER,
    KafkaRange,
    KafkaStreamReader,
    cap_offsets,
    partition_offsets,
    read_range,
)
from lakehouse.settings import Settings
from lakehouse.streams import query_id

T0_MS = 1_714_521_600_000  # 2024-05-01T00:00:00Z


def produce(settings: Settings, start: int, n: int, flushes: int = 3) -> dict[tuple[int, int], tuple]:
    """n records over partitions 0 and 1, in ``flushes`` record batches per partition (so Tansu's
    reported end lags the true end). Returns (partition, offset) -> (key, value, ts_ms, headers)."""
    p = Producer(client_config(settings, **{"linger.ms": 200, "batch.num.messages": 100_000}))
    sent: dict[tuple[int, int], tuple] = {}
    for chunk in range(flushes):
        for i in range(start + chunk * n // flushes, start + (chunk + 1) * n // flushes):
            headers = [("src", b"test"), ("i", str(i).encode())] if i % 3 == 0 else None
            rec = (f"dev-{i % 7}".encode(), f'{{"i":{i}}}'.encode(), T0_MS + i, headers)

            def done(err, msg, rec=rec) -> None:
                assert err is None, err
                sent[(msg.partition(), msg.offset())] = rec

            p.produce(settings.kafka.topic, rec[1], rec[0], partition=i % 2, timestamp=rec[2],
                      headers=headers, on_delivery=done)
        assert p.flush(30) == 0
    return sent


def options(settings: Settings, **extra: str) -> dict[str, str]:
    return {"bootstrap": settings.kafka_bootstrap, "topic": settings.kafka.topic, **extra}


def options_for_unit(**extra: str) -> dict[str, str]:
    return {"bootstrap": "127.0.0.1:1", "topic": "t", **extra}


def bronze_rows(path: str) -> dict[tuple[int, int], tuple]:
    t = DeltaTable(path).to_pyarrow_table().to_pylist()
    keys = [(r["partition"], r["offset"]) for r in t]
    assert len(keys) == len(set(keys)), "a (partition, offset) was written twice"
    return {(r["partition"], r["offset"]): (
        r["key"], r["value"], round(r["timestamp"].timestamp() * 1000),
        [(h["key"], h["value"]) for h in r["headers"]] or None) for r in t}


def test_cap_offsets_shares_fairly_and_never_overshoots() -> None:
    assert cap_offsets({"0": 5}, {"0": 9, "1": 3}, 100) == {"0": 9, "1": 3}
    assert cap_offsets({"0": 0, "1": 0}, {"0": 100, "1": 10}, 50) == {"0": 40, "1": 10}
    assert cap_offsets({"0": 10, "1": 20, "2": 0}, {"0": 110, "1": 120, "2": 100}, 31) == {
        "0": 20, "1": 30, "2": 11}
    capped = cap_offsets({"0": 7}, {"0": 1007, "1": 2}, 1)
    assert sum(capped[p] - {"0": 7}.get(p, 0) for p in capped) == 1


def test_partitions_split_into_contiguous_chunks() -> None:
    start, end = {"0": 0, "1": 5, "2": 9}, {"0": 20, "1": 12, "2": 9}
    whole = KafkaStreamReader(options_for_unit()).partitions(start, end)
    assert [(r.partition, r.start, r.end) for r in whole] == [(0, 0, 20), (1, 5, 12)]
    split = KafkaStreamReader(options_for_unit(split_records="7")).partitions(start, end)
    assert [(r.partition, r.start, r.end) for r in split] == [(0, 0, 6), (0, 6, 13), (0, 13, 20),
                                                              (1, 5, 12)]


def test_last_records_visible_despite_tansu_high_watermark(settings: Settings) -> None:
    sent = produce(settings, 0, 60)
    reader = KafkaStreamReader(options(settings))
    try:
        initial = reader.initialOffset()
        assert partition_offsets(initial) == {"0": 0, "1": 0}
        assert initial[CLUSTER].startswith("iotlake-embedded-")  # the suite's embedded Tansu
        assert reader._true_ends() == {"0": 30, "1": 30}
        # The reported end may lag (Tansu) but never exceeds the true end.
        c = Consumer(client_config(settings, **{"group.id": "t"}))
        assert c.get_watermark_offsets(TopicPartition(settings.kafka.topic, 0), timeout=10)[1] <= 30
        c.close()
        tail = read_range(options(settings), KafkaRange(settings.kafka.topic, 0, 27, 30))
        rows = [r for b in tail for r in b.to_pylist()]
        assert [(r["offset"], r["value"]) for r in rows] == [(o, sent[(0, o)][1]) for o in (27, 28, 29)]
    finally:
        reader.stop()


def test_available_now_target_is_fixed_at_start(settings: Settings) -> None:
    produce(settings, 0, 40)
    reader = KafkaStreamReader(options(settings))
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        produce(settings, 40, 20)  # arrives after the trigger started: not part of this run
        assert partition_offsets(reader.latestOffset(start, ReadAllAvailable())) == {"0": 20, "1": 20}
        offs, batches = start, 0
        while (nxt := reader.latestOffset(offs, ReadMaxRows(7))) != offs:
            n, o = partition_offsets(nxt), partition_offsets(offs)
            assert sum(n[p] - o[p] for p in n) <= 7
            offs, batches = nxt, batches + 1
        assert partition_offsets(offs) == {"0": 20, "1": 20} and batches == 6
        assert reader.reportLatestOffset() == {"0": 30, "1": 30}
    finally:
        reader.stop()


def test_offsets_behind_the_checkpoint_fail_as_data_loss(settings: Settings) -> None:
    """A checkpoint ahead of the topic (topic recreated, broker storage lost) or naming a
    partition the topic lacks fails with a message that says what happened and how to go on;
    with kafka_fail_on_data_loss = false the stream resumes at the topic's current end."""
    produce(settings, 0, 10)
    reader = KafkaStreamReader(options(settings))
    try:
        now = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
        ahead = {**now, "0": now["0"] + 1000}
        with pytest.raises(RuntimeError, match=r"data loss.*partition 0 ends at .*before the "
                                               r"checkpoint's .*kafka_fail_on_data_loss"):
            reader.latestOffset(ahead, ReadAllAvailable())
        with pytest.raises(RuntimeError, match="partition 99 is gone"):
            reader.latestOffset({**now, "99": 5}, ReadAllAvailable())
    finally:
        reader.stop()
    lenient = KafkaStreamReader(options(settings, fail_on_data_loss="false"))
    try:
        assert lenient.latestOffset(ahead, ReadAllAvailable())["0"] == now["0"]
    finally:
        lenient.stop()


def test_bronze_small_batches_exactly_once_then_resume(settings: Settings, spark) -> None:
    sent = produce(settings, 0, 500)
    q = bronze.stream.start(spark, settings, "available_now", max_offsets=100)
    deadline = time.monotonic() + 120
    while q.lastProgress is None and q.isActive and time.monotonic() < deadline:
        time.sleep(0.05)
    late = produce(settings, 500, 50)  # after the run's end offsets were fixed
    still_running = q.isActive
    q.awaitTermination(300)
    assert q.exception() is None
    assert still_running, "the run finished before the late records were produced"
    batches = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert len(batches) == 5 and max(batches) <= 100
    assert bronze_rows(settings.table_path("bronze")) == sent
    # small batches (< stream.task_rows): both partitions read by one task, one file per batch
    path = settings.table_path("bronze")
    files = [len(commit_adds(path, v)) for v in range(latest_version(path) + 1)]
    assert [n for n in files if n] == [1] * 5

    q = bronze.stream.start(spark, settings, "available_now", max_offsets=100)  # resumes
    q.awaitTermination(300)
    assert q.exception() is None
    assert bronze_rows(settings.table_path("bronze")) == sent | late


def test_split_records_gives_the_same_rows(settings: Settings, spark) -> None:
    sent = produce(settings, 0, 300)
    path, ckpt = settings.table_path("bronze_split"), settings.checkpoint_path("bronze_split")
    kafka = spark.readStream.format("iotlake_kafka").options(
        **options(settings, split_records="37", max_offsets_per_trigger="200")).load()
    q = (kafka.writeStream.format("iotlake_delta").option("ingest_time_column", "ingest_time")
         .option("path", path).option("app_id", query_id(ckpt)).option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None
    assert bronze_rows(path) == sent


def test_embedded_kafka_restarted_empty_is_a_new_cluster(settings: Settings, services_settings,
                                                         spark) -> None:
    """The embedded Tansu keeps records in memory: after a restart it is a new cluster (new
    cluster id) whose offsets start at 0 again. Bronze's checkpoint names the cluster its offsets
    belong to, so a batch planned before the restart and replayed after it reads nothing (it
    waited 60 s for records that are gone, then failed), and every record of the new broker is
    read, those below the old offsets too. Against a broker that is not the embedded one, the
    same change fails with a message that says what to do."""
    from lakehouse.services import port_in_use, tansu_service

    port = services_settings.kafka.embedded_port + 9
    if port_in_use(port):
        pytest.skip(f"port {port} busy")
    s = settings.model_copy(deep=True)
    s.kafka.bootstrap = ""  # the embedded broker, on this test's own port
    s.kafka.embedded_port = port
    broker = s.model_copy(deep=True)
    broker.data_root = f"{s.data_root}-broker"
    from lakehouse.services import ensure_topics

    def run_bronze() -> None:
        q = bronze.stream.start(spark, s, "available_now")
        q.awaitTermination(300)
        assert q.exception() is None, q.exception()

    def values() -> list[bytes]:
        return sorted(DeltaTable(s.table_path("bronze")).to_pyarrow_table().column("value").to_pylist())

    tansu = tansu_service(broker, port).start()
    try:
        ensure_topics(s)
        first = produce(s, 0, 100) | produce(s, 100, 50)
        run_bronze()
        ckpt = Path(s.checkpoint_path("bronze"))
        last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
        for f in (str(last), f".{last}.crc"):  # planned, not committed: replayed at restart
            (ckpt / "commits" / f).unlink(missing_ok=True)
        old = json.loads((ckpt / "offsets" / str(last)).read_text().splitlines()[2])
    finally:
        tansu.stop()
    tansu = tansu_service(broker, port).start()  # empty, a new cluster id
    try:
        ensure_topics(s)
        second = produce(s, 1000, 40)  # offsets 0..19 per partition, below the checkpoint's 75
        strict = KafkaStreamReader(options(s))  # the same broker, not known to be in memory
        try:
            with pytest.raises(RuntimeError, match=r"Kafka is now cluster 'iotlake-embedded-.*"
                                                   r"from cluster .*kafka_fail_on_data_loss"):
                strict.latestOffset(old, ReadAllAvailable())
        finally:
            strict.stop()
        t0 = time.monotonic()
        run_bronze()
        assert time.monotonic() - t0 < 55  # the replayed batch did not wait for gone records
    finally:
        tansu.stop()
    assert old[CLUSTER] != json.loads(
        max((p for p in (ckpt / "offsets").iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name)).read_text()
        .splitlines()[2])[CLUSTER]
    assert values() == sorted(r[1] for r in [*first.values(), *second.values()])
