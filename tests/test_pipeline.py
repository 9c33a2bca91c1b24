"""End to end on real components: Mosquitto -> bridge -> Kafka -> bronze -> silver -> gold."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable
from fleets import SENSOR

from ingest.simulator import generate, publish
from lakehouse.delta.read import row_count
from lakehouse.settings import Settings
from orchestration.pipeline import Running, start_layers
from orchestration.run import bridge_thread, check_bridge, demo

EXTENDED = bool(os.environ.get("IOTLAKE_EXTENDED_TESTS"))


def rows(settings: Settings, table: str) -> pd.DataFrame:
    return DeltaTable(settings.table_path(table)).to_pandas()


def expected_windows(messages, window: str = "1min") -> pd.DataFrame:
    """Gold computed with pandas straight from what was published (deduplicated, valid only)."""
    recs = []
    for m in messages:
        if m.kind in ("valid", "late"):
            recs.append(json.loads(m.payload))
    df = pd.DataFrame(recs).drop_duplicates("event_id")
    df["event_time"] = pd.to_datetime(df["ts"], utc=True)
    df["window_start"] = df["event_time"].dt.floor(window)
    long = df.melt(id_vars=["device_id", "window_start", "event_time"], value_vars=list(SENSOR.metric_names),
                   var_name="metric").dropna(subset=["value"]).sort_values("event_time")
    g = long.groupby(["device_id", "metric", "window_start"])["value"]
    out = g.agg(["count", "mean", "min", "max", "std", "last"]).reset_index()
    return out


def assert_gold_matches(settings: Settings, messages) -> None:
    gold = rows(settings, "gold_metrics_1m")
    exp = expected_windows(messages)
    assert len(gold) == len(exp)
    m = exp.merge(gold, on=["device_id", "metric", "window_start"], suffixes=("_exp", ""))
    assert len(m) == len(exp)
    assert (m["count_exp"] == m["count"]).all()
    for c in ("mean", "min", "max", "last"):
        assert (m[f"{c}_exp"] - m[c]).abs().max() < 1e-9, c
    std = m[["std", "stddev"]].fillna(-1)
    assert (std["std"] - std["stddev"]).abs().max() < 1e-9


@pytest.mark.parametrize("topology", ["layered", "fused"])
def test_end_to_end_exact_counts_and_gold(settings: Settings, spark, topology: str) -> None:
    """2,000 events with 50 duplicates and 20 malformed: every layer's count to the row, with
    bronze and silver as two queries or as one."""
    settings.stream.topology = topology
    start = datetime.now(UTC).replace(microsecond=0)
    result = demo(settings, events=2000, devices=20, duplicates=50, malformed=20, timeout=300,
                  start=start)
    assert result["published"] == 2000
    assert result["bronze_rows"] == 2000
    assert result["silver_rows"] == 1930
    assert result["quarantine_rows"] == 20
    assert result["duplicates_dropped"] == 50
    assert result["ok"] is True

    silver = rows(settings, "silver")
    assert silver["event_id"].is_unique
    quarantine = rows(settings, "quarantine")
    # structural reason first, then every suite expectation the row failed
    assert set(quarantine["reason"]) <= {"not_json", "missing_event_id,event_id_not_null",
                                         "missing_ts,event_time_not_null",
                                         "missing_event_id,missing_ts,event_id_not_null,event_time_not_null"}
    bronze = rows(settings, "bronze")
    # bronze keeps every payload byte for byte, with its Kafka coordinates
    messages = generate(settings, 2000, devices=20, duplicates=50, malformed=20, start=start)
    assert sorted(bronze["value"]) == sorted(m.payload for m in messages)
    assert not bronze.duplicated(["partition", "offset"]).any()
    # stamped by the sink as it writes each batch
    assert bronze["ingest_time"].notna().all()
    assert start <= bronze["ingest_time"].min() <= bronze["ingest_time"].max() <= datetime.now(UTC)
    assert_gold_matches(settings, messages)


def test_layers_get_fair_scheduler_pools(spark) -> None:
    """bronze and silver tasks take the next free task slot before gold's (fairscheduler.xml)."""
    from lakehouse.streams import pool

    sc = spark.sparkContext
    assert sc.getConf().get("spark.scheduler.mode") == "FAIR"
    pools = {n: sc._jsc.sc().getPoolForName(n) for n in ("bronze", "silver", "gold")}
    assert all(p.isDefined() for p in pools.values())
    assert [pools[n].get().minShare() for n in ("bronze", "silver", "gold")] == [1, 1, 0]
    assert pools["silver"].get().weight() > pools["gold"].get().weight()
    with pool(spark, "gold"):
        with pool(spark, "silver"):
            assert sc.getLocalProperty("spark.scheduler.pool") == "silver"
        assert sc.getLocalProperty("spark.scheduler.pool") == "gold"  # the caller's pool is back
    assert sc.getLocalProperty("spark.scheduler.pool") is None


def _gold_matches(settings: Settings, messages) -> bool:
    try:
        assert_gold_matches(settings, messages)
        return True
    except AssertionError:
        return False


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _count(settings: Settings, table: str) -> int:
    return row_count(settings.table_path(table))


def test_run_notices_a_dead_bridge(settings: Settings) -> None:
    """A fatal producer error ends the bridge thread; `iotlake run`'s loop must fail on it
    rather than idle with healthy-looking streams while messages pile up in MQTT. (Under
    per-round delivery reports the first one only makes the bridge fall back to a report per
    record with a new producer; a fatal error there ends it.)"""
    from confluent_kafka import KafkaError

    with bridge_thread(settings) as bridge:
        check_bridge(bridge)  # alive: nothing raised
        assert bridge._fast
        bridge._fatal = KafkaError(KafkaError._FATAL, "first fatal producer error", fatal=True)
        _wait_for(lambda: not bridge._fast and bridge._fatal is None, 30, "the fallback")
        check_bridge(bridge)  # still alive, with a new producer
        bridge._fatal = KafkaError(KafkaError._FATAL, "injected fatal producer error", fatal=True)
        _wait_for(lambda: not bridge.thread.is_alive(), 30, "the bridge thread to end")
        with pytest.raises(RuntimeError, match="stopped: .*injected fatal producer error"):
            check_bridge(bridge)


def test_restart_streams_graceful_and_hard_kill(settings: Settings, spark) -> None:
    """Stop/restart each stream in-process (long version: then kill -9 a separate streams process
    mid-run; the short suite kills role processes in test_scaleout_roles and test_chaos)."""
    msgs = generate(settings, 1200, devices=12, duplicates=30, malformed=10, seed=7)
    first, second, third = msgs[:400], msgs[400:800], msgs[800:]
    unique_valid = 1200 - 30 - 10
    with bridge_thread(settings):
        running = Running(spark, settings, start_layers(spark, settings))
        publish(settings, first)
        running.wait_caught_up(lambda: _count(settings, "bronze"), 400, timeout=120)
        # graceful stop + restart of each stream (bronze and silver are one, fused)
        for layers in (("bronze", "silver"), ("gold",)):
            for name in [n for n in running.queries if n.startswith(layers)]:
                running.queries.pop(name).stop()
            running.queries.update(start_layers(spark, settings, layers))
        publish(settings, second)
        running.wait_caught_up(lambda: _count(settings, "bronze"), 800, timeout=120)
        if not EXTENDED:  # the short version: the rest in-process (kill -9: test_scaleout_roles)
            publish(settings, third)
            try:
                _converge(settings, msgs, unique_valid)
            finally:
                running.stop()
        else:
            running.stop()
            _kill9_streams_process(settings, third, msgs, unique_valid)
    assert _count(settings, "bronze") == 1200
    bronze = rows(settings, "bronze")
    assert not bronze.duplicated(["partition", "offset"]).any()
    silver = rows(settings, "silver")
    assert len(silver) == unique_valid and silver["event_id"].is_unique
    assert _count(settings, "quarantine") == 10
    assert_gold_matches(settings, msgs)


def _converge(settings: Settings, msgs, unique_valid: int) -> None:
    _wait_for(lambda: _count(settings, "silver") + _count(settings, "quarantine") >= unique_valid + 10
              and _count(settings, "bronze") >= 1200, 180, "silver to catch up")
    _wait_for(lambda: _count(settings, "gold_metrics_1m") >= len(expected_windows(msgs)), 120, "gold")
    _wait_for(lambda: _gold_matches(settings, msgs), 180, "gold contents to converge")


def _kill9_streams_process(settings: Settings, third, msgs, unique_valid: int) -> None:
    """A separate streams process killed -9 mid-run, then restarted, catches up exactly."""
    cfg = settings.save(Path(settings.data_root) / "settings.json")
    env = {**os.environ, "IOTLAKE_CONFIG": str(cfg)}
    cmd = [sys.executable, "-m", "orchestration.cli", "run", "--role", "streams"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    publish(settings, third)
    _wait_for(lambda: _count(settings, "bronze") > 800, 120, "bronze progress in child")
    proc.send_signal(signal.SIGKILL)  # hard kill mid-run
    proc.wait(30)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _converge(settings, msgs, unique_valid)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_sliding_windows_match_pandas(settings: Settings, spark) -> None:
    """5-minute-every-minute windows rolled up from the 1-minute ones equal a direct computation."""
    import pyarrow as pa
    from deltalake import write_deltalake

    import gold.windows
    from lakehouse.tables import silver_schema

    settings = settings.model_copy(deep=True)
    settings.gold.slide_window_seconds = 300  # off by default
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rng = __import__("random").Random(5)
    recs = [dict(event_id=f"{i:032x}", device_id=f"dev-{i % 3:05d}",
                 event_time=start + pd.Timedelta(seconds=7 * i + rng.random()),
                 temperature=rng.gauss(20, 2), humidity=rng.gauss(50, 5), battery=90.0, status="ok",
                 schema_version=1, extra=None, kafka_partition=0, kafka_offset=i, ingest_time=start)
            for i in range(300)]
    for chunk in (recs[:150], recs[150:]):
        write_deltalake(settings.table_path("silver"), pa.Table.from_pylist(chunk, schema=silver_schema(SENSOR)), mode="append")
        q = gold.windows.start(spark, settings, trigger="available_now")
        q.awaitTermination()
    got = rows(settings, "gold_metrics_5m")
    df = pd.DataFrame(recs)
    exp = []
    for s0 in pd.date_range(df.event_time.min().floor("1min") - pd.Timedelta(minutes=4),
                            df.event_time.max().floor("1min"), freq="1min"):
        w = df[(df.event_time >= s0) & (df.event_time < s0 + pd.Timedelta(minutes=5))]
        for (dev, ), g in w.groupby(["device_id"]):
            for m in SENSOR.metric_names:
                v = g.sort_values("event_time")[m]
                exp.append(dict(device_id=dev, metric=m, window_start=s0, count=len(v), mean=v.mean(),
                                min=v.min(), max=v.max(), stddev=v.std(), last=v.iloc[-1]))
    exp = pd.DataFrame(exp)
    assert len(got) == len(exp)
    m = exp.merge(got, on=["device_id", "metric", "window_start"], suffixes=("_exp", ""))
    assert len(m) == len(exp) and (m.count_exp == m["count"]).all()
    for c in ("mean", "min", "max", "last"):
        assert (m[f"{c}_exp"] - m[c]).abs().max() < 1e-9, c
    assert (m.stddev_exp.fillna(-1) - m.stddev.fillna(-1)).abs().max() < 1e-6


def _scrape(port: int, seen: dict[str, float], stop: threading.Event) -> None:
    """Keep the last value of every iotlake series the endpoint serves."""
    while not stop.is_set():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        except OSError:
            pass
        else:
            for line in text.decode().splitlines():
                if line.startswith("iotlake_"):
                    series, value = line.rsplit(" ", 1)
                    seen[series] = float(value)
        stop.wait(0.3)


def test_pipeline_metrics_one_row_per_batch(settings: Settings, spark) -> None:
    """After a demo, pipeline_metrics has one row per micro-batch per query; inputs add up. While
    it runs, the process endpoint (what `iotlake run` serves) has bridge and stream series."""
    from prometheus_client import start_http_server

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1")
    seen: dict[str, float] = {}
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(port, seen, stop), daemon=True)
    scraper.start()
    try:
        demo(settings, events=600, devices=6, duplicates=10, malformed=5, timeout=300)
    finally:
        stop.set()
        scraper.join(10)
        server.shutdown()
        server.server_close()
    bid = settings.mqtt.client_id
    assert seen.get(f'iotlake_bridge_delivered_total{{bridge_id="{bid}"}}') == 600
    assert seen.get(f'iotlake_bridge_delivery_latency_seconds_count{{bridge_id="{bid}"}}') == 600
    assert seen.get('iotlake_stream_input_rows_total{query="bronze_silver"}', 0) > 0
    assert 'iotlake_stream_state_rows{query="gold_health"}' in seen
    pm = rows(settings, "pipeline_metrics")
    assert not pm.duplicated(["query_id", "batch_id"]).any()
    by_query = pm.groupby("query_name")["num_input_rows"].sum()
    assert by_query["bronze_silver"] == 600  # Kafka records read == bronze rows
    assert by_query["gold_metrics_1m"] == _count(settings, "silver")
    assert by_query["gold_health"] == _count(settings, "silver")
    assert pm["batch_duration_ms"].gt(0).all()
    sil = pm[pm.query_name == "bronze_silver"]
    assert sil["duplicates_dropped"].sum() == 10
    assert sil["state_rows"].max() > 0
