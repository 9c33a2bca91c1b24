"""Gold: device status from event-time timeouts, anomaly flags, restart without re-warm-up."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from fleets import SENSOR

from lakehouse.settings import Settings, load_settings
from lakehouse.tables import silver_schema

SILVER = silver_schema(SENSOR)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def gold_settings(tmp_path) -> Settings:
    return load_settings(
        environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path / "lake"),
        spark={"master": "local[2]", "shuffle_partitions": 2},
        stream={"watermark_seconds": 30},
        gold={"offline_after_seconds": 120, "max_files_per_trigger": 1},
    )


def sliding(settings: Settings) -> Settings:
    """``settings`` with the sliding windows on (5 minutes every minute; off by default)."""
    s = settings.model_copy(deep=True)
    s.gold.slide_window_seconds = 300
    return s


def reading(device: str, t: datetime, temp: float = 21.0, battery: float = 80.0, status="ok") -> dict:
    return dict(event_id=uuid.uuid4().hex, device_id=device, event_time=t, temperature=temp,
                humidity=40.0, battery=battery, status=status, schema_version=1, extra=None,
                kafka_partition=0, kafka_offset=0, ingest_time=t)


def append_silver(settings: Settings, rows: list[dict]) -> None:
    write_deltalake(settings.table_path("silver"), pa.Table.from_pylist(rows, schema=SILVER), mode="append")


def run_health(spark, settings: Settings) -> None:
    import gold.health

    q = gold.health.start(spark, settings, trigger="available_now")
    q.awaitTermination()
    assert q.exception() is None


def history(settings: Settings, device: str) -> list[tuple[str, str | None]]:
    h = DeltaTable(settings.table_path("device_status_history")).to_pandas()
    h = h[h.device_id == device].sort_values("changed_at")
    return list(zip(h.status, h.previous_status.where(h.previous_status.notna(), None), strict=True))


def current(settings: Settings, device: str) -> dict:
    c = DeltaTable(settings.table_path("device_current")).to_pandas()
    return c[c.device_id == device].iloc[0].to_dict()


def test_offline_from_other_devices_event_time_then_back_online(spark, gold_settings) -> None:
    s = gold_settings
    # commit 1: both devices report for one minute
    append_silver(s, [reading(d, T0 + timedelta(seconds=10 * i)) for i in range(7) for d in ("dev-00001", "dev-00002")])
    # commits 2 and 3: only dev-00001 keeps reporting; event time moves 6 minutes on
    for first in (1, 4):
        append_silver(s, [reading("dev-00001", T0 + timedelta(minutes=k, seconds=10 * i))
                          for k in range(first, first + 3) for i in range(6)])
    run_health(spark, s)
    assert history(s, "dev-00002") == [("online", None), ("offline", "online")]
    cur = current(s, "dev-00002")
    assert cur["status"] == "offline"
    # offline since last reading + timeout, decided by dev-00001's event time alone
    assert cur["status_since"] == T0 + timedelta(seconds=60 + 120)
    assert current(s, "dev-00001")["status"] == "online"

    append_silver(s, [reading("dev-00002", T0 + timedelta(minutes=7))])
    run_health(spark, s)
    assert history(s, "dev-00002") == [("online", None), ("offline", "online"), ("online", "offline")]
    assert current(s, "dev-00002")["status"] == "online"
    # rerunning with no new data changes nothing (no duplicate status changes)
    run_health(spark, s)
    assert len(history(s, "dev-00002")) == 3


def test_degraded_on_low_battery_and_anomaly_flags_survive_restart(spark, gold_settings) -> None:
    s = gold_settings
    rng = np.random.default_rng(3)
    n = 800  # the detector learns 500 readings before it flags
    temps = 21 + rng.normal(0, 0.2, n)
    temps[700] = 45.0  # an injected spike
    rows = [reading("dev-00003", T0 + timedelta(seconds=15 * i), temp=float(temps[i])) for i in range(n)]
    append_silver(s, rows[:650])
    run_health(spark, s)  # stream stops here: detector state must carry over the restart
    append_silver(s, rows[650:])
    # the battery low from then on: degraded once it held 3 readings and 60 s (the 5th, at 60 s)
    low = [reading("dev-00003", T0 + timedelta(seconds=15 * (n + j)), battery=5.0) for j in range(5)]
    append_silver(s, low)
    run_health(spark, s)
    an = DeltaTable(s.table_path("anomalies")).to_pandas()
    temp_flags = an[an.metric == "temperature"]
    assert list(temp_flags.event_id) == [rows[700]["event_id"]]
    scored = DeltaTable(s.table_path("readings_scored")).to_pandas()
    assert len(scored) == (n + 5) * 3 and scored.event_id.nunique() == n + 5
    assert scored.score.between(0, 1).all()
    cur = current(s, "dev-00003")
    assert cur["status"] == "degraded" and cur["status_since"] == low[4]["event_time"]
    assert cur["status_reason"].split(",")[0] == "battery_low"
    # the spike alone (one anomalous reading) changed no status
    h = DeltaTable(s.table_path("device_status_history")).to_pandas().sort_values("changed_at")
    assert list(zip(h.status, h.changed_at, strict=True)) == [("online", T0), ("degraded", low[4]["event_time"])]


# ---- window aggregates: watermark, late data, final windows ------------------------------------
# Silver quarantines readings at or below its own watermark (reason `late`), so these tests
# write silver directly to exercise gold's watermark on its own. With max_files_per_trigger=1
# every silver commit (one file) is one gold micro-batch; Spark drops a row as late when its event time is
# <= the previous batch's watermark (max event time so far - 30 s).

WKEYS = ["device_id", "metric", "window_start"]


def temp(sec: int, value: float) -> dict:
    """A temperature-only reading (one gold row per window) ``sec`` seconds after T0."""
    return reading("dev-00001", T0 + timedelta(seconds=sec), temp=value) | {"humidity": None, "battery": None}


def run_windows(spark, settings: Settings):
    import gold.windows

    q = gold.windows.start(spark, settings, trigger="available_now")
    q.awaitTermination()
    assert q.exception() is None
    return q


def windows(settings: Settings, table: str) -> dict[int, dict]:
    """Window start (seconds after T0) -> row; fails if any window appears twice."""
    df = DeltaTable(settings.table_path(table)).to_pandas()
    assert not df.duplicated(WKEYS).any(), f"{table} has a window twice"
    df = df.astype(object).where(df.notna(), None)  # null stddev compares equal
    return {int((r["window_start"] - T0).total_seconds()): r for r in df.to_dict("records")}


def stats(values: list[float], last: float) -> dict:
    import statistics

    sd = pytest.approx(statistics.stdev(values)) if len(values) > 1 else None
    return dict(count=len(values), mean=pytest.approx(statistics.fmean(values)), min=min(values),
                max=max(values), stddev=sd, last=last)


def pick(row: dict) -> dict:
    return {k: row[k] for k in ("count", "mean", "min", "max", "stddev", "last")}


def test_late_data_inside_watermark_updates_tumbling_and_sliding_windows(spark, gold_settings) -> None:
    s = sliding(gold_settings)
    append_silver(s, [temp(10, 20.0), temp(50, 22.0)])
    append_silver(s, [temp(70, 30.0)])  # watermark -> 70 - 30 = 40 s
    run_windows(spark, s)
    assert pick(windows(s, "gold_metrics_1m")[0]) == stats([20.0, 22.0], last=22.0)

    append_silver(s, [temp(45, 25.0)])  # 45 s > 40 s: inside the watermark
    run_windows(spark, s)
    one = windows(s, "gold_metrics_1m")
    assert sorted(one) == [0, 60]
    assert pick(one[0]) == stats([20.0, 22.0, 25.0], last=22.0)  # last = latest event time, not arrival
    assert pick(one[60]) == stats([30.0], last=30.0)
    five = windows(s, "gold_metrics_5m")  # 5-minute windows every minute containing minute 0 or 1
    assert sorted(five) == [-240, -180, -120, -60, 0, 60]
    assert pick(five[-240]) == stats([20.0, 22.0, 25.0], last=22.0)
    for start in (-180, -120, -60, 0):
        assert pick(five[start]) == stats([20.0, 22.0, 25.0, 30.0], last=30.0)
    assert five[60]["count"] == 1


def test_late_data_beyond_watermark_is_not_double_counted(spark, gold_settings) -> None:
    s = sliding(gold_settings)
    append_silver(s, [temp(10, 20.0), temp(50, 22.0)])
    append_silver(s, [temp(130, 1.0)])  # watermark -> 100 s from the next batch on
    append_silver(s, [temp(135, 2.0)])
    append_silver(s, [temp(55, 99.0)])  # 55 s <= 100 s: beyond the watermark
    q = run_windows(spark, s)
    assert q.lastProgress["stateOperators"][0]["numRowsDroppedByWatermark"] == 1
    one = windows(s, "gold_metrics_1m")
    assert pick(one[0]) == stats([20.0, 22.0], last=22.0)
    assert pick(windows(s, "gold_metrics_5m")[-240]) == stats([20.0, 22.0], last=22.0)
    final = windows(s, "gold_metrics_1m_final")  # [0, 60) closed once the watermark passed 60 s
    assert sorted(final) == [0] and pick(final[0]) == pick(one[0])


def test_by_default_only_the_tumbling_tables_are_written(spark, gold_settings) -> None:
    s = gold_settings
    assert s.gold.slide_window_seconds == 0
    append_silver(s, [temp(10, 20.0), temp(50, 22.0)])
    append_silver(s, [temp(130, 1.0)])  # watermark -> 100 s: [0, 60) final in the next batch
    run_windows(spark, s)
    assert pick(windows(s, "gold_metrics_1m")[0]) == stats([20.0, 22.0], last=22.0)
    final = windows(s, "gold_metrics_1m_final")
    assert sorted(final) == [0] and pick(final[0]) == stats([20.0, 22.0], last=22.0)
    for table in ("gold_metrics_5m", "gold_metrics_5m_final"):
        assert not Path(s.table_path(table)).exists()


def test_sliding_tables_left_from_before_are_named(tmp_path) -> None:
    """Sliding tables written before they were turned off (or off by default) are the stale ones
    the window stream's start warns about: they keep their rows but stop growing."""
    import gold.windows
    from lakehouse.tables import METRIC_WINDOWS

    s = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path))
    assert gold.windows.stale_tables(s) == []
    write_deltalake(s.table_path("gold_metrics_5m"), METRIC_WINDOWS.empty_table())
    assert gold.windows.stale_tables(s) == ["gold_metrics_5m"]
    assert gold.windows.stale_tables(sliding(s)) == []  # on: written, not stale


def test_final_windows_appended_once_across_crash_restart_and_replay(spark, gold_settings,
                                                                     monkeypatch) -> None:
    import json

    from pyspark.errors import StreamingQueryException

    import gold.windows

    s = sliding(gold_settings)
    ckpt = Path(s.checkpoint_path("gold_metrics_1m"))
    append_silver(s, [temp(10, 20.0), temp(50, 22.0)])
    append_silver(s, [temp(70, 30.0)])
    run_windows(spark, s)  # watermark 40 s: nothing final yet
    assert windows(s, "gold_metrics_1m_final") == {} and windows(s, "gold_metrics_5m_final") == {}

    # batch 4 runs with watermark 100 s, closing [0, 60): crash after its MERGE, before the append
    append_silver(s, [temp(130, 1.0)])
    append_silver(s, [temp(135, 2.0)])
    real_append = gold.windows.append

    def crash(*args, **kwargs):
        raise RuntimeError("crash before the final append")

    monkeypatch.setattr(gold.windows, "append", crash)
    q = gold.windows.start(spark, s, trigger="available_now")
    with pytest.raises(StreamingQueryException):
        q.awaitTermination()
    assert windows(s, "gold_metrics_1m")[120]["count"] == 2  # batch 4 merged
    assert windows(s, "gold_metrics_1m_final") == {}
    monkeypatch.setattr(gold.windows, "append", real_append)

    def check_first_final() -> None:
        final1, final5 = windows(s, "gold_metrics_1m_final"), windows(s, "gold_metrics_5m_final")
        assert sorted(final1) == [0] and pick(final1[0]) == stats([20.0, 22.0], last=22.0)
        assert sorted(final5) == [-240] and pick(final5[-240]) == pick(final1[0])  # [-4 min, +1 min)

    q = run_windows(spark, s)  # restart: Spark replays batch 4, then a no-data batch (105 s)
    assert [p["batchId"] for p in q.recentProgress] == [4, 5]
    check_first_final()
    for f in (ckpt / "commits" / "5", ckpt / "commits" / ".5.crc"):  # replay the last batch
        f.unlink(missing_ok=True)
    q = run_windows(spark, s)
    assert [p["batchId"] for p in q.recentProgress] == [5]
    qid = json.loads((ckpt / "metadata").read_text().splitlines()[0])["id"]
    gold.windows.MergeBatch(s, qid, str(ckpt)).append_final(spark, 4)  # batch 4's append, replayed
    check_first_final()

    # late beyond the watermark (dropped), then event time moves to 400 s: minutes 1 and 2 close
    append_silver(s, [temp(55, 99.0)])
    append_silver(s, [temp(400, 5.0)])
    run_windows(spark, s)
    one, five = windows(s, "gold_metrics_1m"), windows(s, "gold_metrics_5m")
    final1, final5 = windows(s, "gold_metrics_1m_final"), windows(s, "gold_metrics_5m_final")
    assert sorted(final1) == [0, 60, 120]  # watermark 370 s
    assert sorted(final5) == [-240, -180, -120, -60, 0, 60]  # ends <= 370 s
    for final, merged in ((final1, one), (final5, five)):
        for start, row in final.items():
            assert row == merged[start]
    assert pick(final1[0]) == stats([20.0, 22.0], last=22.0)
    assert pick(final1[120]) == stats([1.0, 2.0], last=2.0)
    assert pick(final5[60]) == stats([30.0, 1.0, 2.0], last=2.0)


# ---- exactly once per (query id, batch id); MERGE output read alike by delta-spark and delta-rs --

def versions(settings: Settings, tables: tuple[str, ...]) -> dict[str, int]:
    return {t: DeltaTable(settings.table_path(t)).version() for t in tables}


def same_through_both(spark, settings: Settings, table: str) -> pa.Table:
    """The table's rows through delta-rs and through delta-spark: identical, returned sorted."""
    from lakehouse.tables import schemas

    schema = schemas(settings.telemetry)[table]
    dt = DeltaTable(settings.table_path(table))
    for c in dt.metadata().partition_columns:  # the time bucket retention drops partitions by
        schema = schema.append(pa.field(c, pa.string()))
    order = [(c, "ascending") for c in schema.names]
    rs = dt.to_pyarrow_table().cast(schema).sort_by(order)
    sp = spark.read.format("delta").load(settings.table_path(table)).toArrow().cast(schema).sort_by(order)
    assert rs.num_rows and rs.equals(sp), table
    return rs


def health_output(spark, temperature: float):
    """A micro-batch of the health state function's output: one reading, status change, current."""
    import gold.scoring

    out = gold.scoring.out_schema(SENSOR.gold_metrics)
    base = {c.split()[0]: None for c in out.split(", ")}
    reading = base | dict(kind="reading", device_id="dev-r", event_id="e-r", event_time=T0,
                          temperature=temperature, temperature_score=0.1, temperature_baseline=21.0,
                          temperature_anomaly=False, humidity=40.0, humidity_score=0.97,
                          humidity_baseline=30.0, humidity_anomaly=True, battery_anomaly=False)
    status = base | dict(kind="status", device_id="dev-r", status="online", reason="data", event_time=T0)
    cur = base | dict(kind="current", device_id="dev-r", status="online", status_since=T0,
                      last_seen=T0, temperature=temperature, humidity=40.0, anomaly_score=0.97)
    return spark.createDataFrame([reading, status, cur], out)


def test_replayed_health_batch_writes_nothing_twice(spark, gold_settings) -> None:
    import gold.state_store

    s = gold_settings
    tables = ("readings_scored", "anomalies", "device_status_history", "device_current")
    append_silver(s, [reading(d, T0 + timedelta(seconds=10 * i)) for i in range(3) for d in ("dev-1", "dev-2")])
    run_health(spark, s)
    batch = gold.state_store.HealthBatch(s, "replay-test")
    batch(health_output(spark, 21.5), 7)
    before = versions(s, tables)
    rows = {t: same_through_both(spark, s, t) for t in tables}
    assert current(s, "dev-r")["temperature"] == 21.5
    scored = rows["readings_scored"].filter(pa.compute.equal(rows["readings_scored"]["event_id"], "e-r"))
    assert sorted(scored.column("metric").to_pylist()) == ["humidity", "temperature"]
    assert rows["anomalies"].column("event_id").to_pylist() == ["e-r"]

    batch(health_output(spark, 99.0), 7)  # the replay (even with other rows) writes nothing
    assert versions(s, tables) == before
    assert {t: same_through_both(spark, s, t) for t in tables} == rows

    batch(health_output(spark, 99.0), 8)  # the next batch does
    assert current(s, "dev-r")["temperature"] == 99.0
    assert versions(s, tables) == {t: v + 1 for t, v in before.items()}


def test_replayed_window_batch_writes_nothing_twice(spark, gold_settings, tmp_path) -> None:
    import gold.windows
    from lakehouse.tables import METRIC_WINDOWS

    s = sliding(gold_settings)
    append_silver(s, [temp(10, 20.0), temp(70, 30.0)])
    run_windows(spark, s)

    def batch_rows(mean: float):
        return spark.createDataFrame(pa.table({
            "device_id": ["dev-00001", "dev-00002"], "metric": ["temperature", "humidity"],
            "window_start": [T0 + timedelta(minutes=1), T0 + timedelta(minutes=9)],
            "window_end": [T0 + timedelta(minutes=2), T0 + timedelta(minutes=10)],
            "count": [3, 1], "mean": [mean, 40.0], "min": [1.0, 40.0], "max": [50.0, 40.0],
            "stddev": [2.0, None], "last": [mean, 40.0]}, schema=METRIC_WINDOWS))

    tables = ("gold_metrics_1m", "gold_metrics_5m")
    batch = gold.windows.MergeBatch(s, "replay-test", str(tmp_path / "no-checkpoint"))
    batch(batch_rows(25.0), 3)
    before = versions(s, tables)
    rows = {t: same_through_both(spark, s, t) for t in tables}
    one = windows(s, "gold_metrics_1m")
    assert one[60]["count"] == 3 and one[60]["mean"] == 25.0 and one[540]["count"] == 1
    # [0, 5 min): minute 0 from the stream + the new minute 1 (sum of squares 400 + 2 * 4 + 3 * 625)
    five = windows(s, "gold_metrics_5m")
    assert pick(five[0]) == {"count": 4, "mean": pytest.approx(20.0 / 4 + 25.0 * 3 / 4), "min": 1.0,
                             "max": 50.0, "stddev": pytest.approx((26.75 / 3) ** 0.5), "last": 25.0}

    batch(batch_rows(26.0), 3)
    assert versions(s, tables) == before
    assert {t: same_through_both(spark, s, t) for t in tables} == rows
    batch(batch_rows(26.0), 4)
    assert windows(s, "gold_metrics_1m")[60]["mean"] == 26.0


def test_a_reading_without_a_model_has_no_model_name_compiled_or_not(spark) -> None:
    """Spark takes ``element_at`` at a null index for never null (ANSI): compiled, it gave the
    last model's name (or wrote a null unchecked); the name is null in both modes."""
    import gold.state_store
    from lakehouse.spark import session_confs

    rows = [("e-1", None), ("e-2", 0.0)]
    df = spark.createDataFrame(rows, "event_id string, temperature_model double").selectExpr(
        "event_id", "'dev-1' AS device_id", "TIMESTAMP '2026-01-01 00:00:00' AS event_time",
        "1.0 AS temperature", "0.1 AS temperature_score", "1.0 AS temperature_baseline",
        "false AS temperature_anomaly", "temperature_model", "0.0 AS temperature_low",
        "2.0 AS temperature_high")
    for mode in ("FALLBACK", "NO_CODEGEN"):
        with session_confs(spark, {"spark.sql.codegen.factoryMode": mode}):
            got = {r["event_id"]: r["anomaly_model"] for r in
                   gold.state_store.readings_scored(df, ("temperature",)).collect()}
        assert got == {"e-1": None, "e-2": gold.state_store.MODELS[0]}, mode


# ---- where the health stream keeps device state: the driver or Spark's state store -------------

def with_state(settings: Settings, mode: str, name: str) -> Settings:
    s = settings.model_copy(deep=True)
    s.gold.health_state = mode
    s.data_root = str(Path(settings.data_root).parent / name)
    return s


def comparable(t: pa.Table) -> pa.Table:
    """``t`` without the columns a run stamps (``updated_at``, the partition), in a fixed order."""
    t = t.drop_columns([c for c in ("updated_at", "time_bucket") if c in t.column_names])
    return t.sort_by([(c, "ascending") for c in ("device_id", "event_id", "metric", "changed_at")
                      if c in t.column_names])


def test_both_device_state_modes_write_the_same_gold_tables(spark, gold_settings) -> None:
    rng = np.random.default_rng(5)
    temps = 21 + rng.normal(0, 0.2, 700)
    temps[650] = 45.0  # a spike, after the detector's 500 readings of learning
    commits = [
        [reading(d, T0 + timedelta(seconds=10 * i), temp=float(temps[i])) for i in range(100)
         for d in ("dev-1", "dev-2")],
        # dev-2 falls silent (offline); dev-1 goes on, its battery low at the end: degraded
        # once that held (3 readings, 60 s), across a restart
        [reading("dev-1", T0 + timedelta(seconds=10 * i), temp=float(temps[i])) for i in range(100, 700)],
        [reading("dev-1", T0 + timedelta(seconds=7000 + 20 * i), battery=5.0) for i in range(2)],
        [reading("dev-1", T0 + timedelta(seconds=7000 + 20 * i), battery=5.0) for i in range(2, 4)],
    ]
    runs = {}
    for mode in ("driver", "state_store"):
        s = with_state(gold_settings, mode, mode)
        for rows in commits:
            append_silver(s, rows)
            run_health(spark, s)  # a restart between commits: the state carries over
        runs[mode] = {t: comparable(DeltaTable(s.table_path(t)).to_pyarrow_table())
                      for t in ("readings_scored", "anomalies", "device_status_history", "device_current")}
    assert runs["driver"] == runs["state_store"]
    got = runs["driver"]
    assert got["readings_scored"].num_rows == 804 * 3
    assert commits[1][550]["event_id"] in got["anomalies"].column("event_id").to_pylist()
    # the spike's one anomalous reading changes no status; the battery's fall from 80 to 5 is
    # both low and anomalous
    assert [(r["device_id"], r["status"], r["reason"], r["changed_at"])
            for r in got["device_status_history"].to_pylist()] == [
        ("dev-1", "online", "data", T0),
        ("dev-1", "degraded", "battery_low,anomaly", T0 + timedelta(seconds=7060)),
        ("dev-2", "online", "data", T0), ("dev-2", "offline", "no_data", T0 + timedelta(seconds=990 + 120))]

    s = with_state(gold_settings, "state_store", "driver")  # a checkpoint keeps its mode
    import gold.health

    with pytest.raises(ValueError, match="started with gold.health_state = 'driver'"):
        gold.health.start(spark, s, trigger="available_now")
    legacy = with_state(gold_settings, "driver", "legacy")  # a checkpoint from before the setting
    Path(legacy.checkpoint_path("gold_health"), "offsets").mkdir(parents=True)
    with pytest.raises(ValueError, match="started with gold.health_state = 'state_store'"):
        gold.health.start(spark, legacy, trigger="available_now")


def test_the_driver_unpivots_readings_one_row_per_present_metric() -> None:
    """``readings_scored`` from the driver's output rows: a row per (reading, metric with a
    value), in metric order; no model yet is a null model name and a NaN score a null."""
    from gold.anomaly import MODELS
    from gold.device_state import scored
    from gold.scoring import Rows, out_schema

    metrics = ("a", "b")
    rows = Rows(dict(c.split() for c in out_schema(metrics).split(", ")))
    t_ns = np.array([1, 2, 3]) * 1_000_000_000
    cols = {f"{m}{s}": np.array(v, dtype=float) for m, s, v in (
        ("a", "", [1.0, np.nan, 3.0]), ("b", "", [4.0, 5.0, 6.0]), ("a", "_score", [0.1, 0.0, np.nan]),
        ("b", "_score", [0.2, 0.3, 0.4]), ("a", "_model", [np.nan, 0.0, 1.0]), ("b", "_model", [1.0, 1.0, 0.0]))}
    rows.add(3, kind="reading", device_id=np.array(["d1", "d2", "d1"], dtype=object),
             event_id=np.array(["e1", "e2", "e3"], dtype=object), event_time=t_ns,
             a_anomaly=np.array([False, False, True]), b_anomaly=np.zeros(3, bool), **cols,
             **{f"{m}_{s}": np.full(3, 2.0) for m in metrics for s in ("baseline", "low", "high")})
    rows.add(1, kind="status", device_id=np.array(["d1"], dtype=object), status="offline")
    got = scored(rows.columns("reading"), metrics).to_pylist()
    assert [(r["event_id"], r["metric"], r["value"], r["score"], r["anomaly_model"], r["is_anomaly"])
            for r in got] == [("e1", "a", 1.0, 0.1, None, False), ("e3", "a", 3.0, None, MODELS[1], True),
                              ("e1", "b", 4.0, 0.2, MODELS[1], False), ("e2", "b", 5.0, 0.3, MODELS[1], False),
                              ("e3", "b", 6.0, 0.4, MODELS[0], False)]
    assert got[0]["event_time"] == datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert scored(Rows(rows.out_types).columns("reading"), metrics).num_rows == 0


def test_device_state_comes_back_from_its_changelog_for_a_restart_or_a_replay(tmp_path) -> None:
    from gold.anomaly import DetectorConfig
    from gold.device_state import DeviceStateStore

    metrics, cfg = ("temperature",), DetectorConfig()

    def run(store: DeviceStateStore, batch: int, devices: list[str], value: float) -> None:
        devs = store.begin(batch)
        pos = devs.index(np.array(devices, dtype=object))
        devs.values[pos, 0] = value
        store.save(batch, pos)

    def values(store: DeviceStateStore, batch: int) -> dict[str, float]:
        devs = store.begin(batch)
        return dict(zip(devs.ids.tolist(), devs.values[:, 0].tolist(), strict=True))

    ck = str(tmp_path / "ck")
    one = DeviceStateStore(ck, metrics, cfg)
    run(one, 0, ["a", "b", "c", "d"], 1.0)  # every device: a snapshot
    run(one, 1, ["a"], 2.0)  # changes
    run(one, 2, ["b"], 3.0)
    files = lambda: sorted(p.name for p in Path(ck, "device_state").iterdir())  # noqa: E731
    assert files() == ["0.snapshot.arrow", "1.changes.arrow", "2.changes.arrow"]
    # a restart after batch 2 committed; a replay of batch 2 (it did not commit)
    assert values(DeviceStateStore(ck, metrics, cfg), 3) == {"a": 2.0, "b": 3.0, "c": 1.0, "d": 1.0}
    replay = DeviceStateStore(ck, metrics, cfg)
    assert values(replay, 2) == {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}
    assert files() == ["0.snapshot.arrow", "1.changes.arrow"]
    run(replay, 2, ["c", "d"], 4.0)  # 1 + 2 changed rows since the snapshot: not yet 4
    run(replay, 3, ["a"], 5.0)  # 4: a snapshot; the files before the last snapshot stay
    assert files() == ["0.snapshot.arrow", "1.changes.arrow", "2.changes.arrow", "3.snapshot.arrow"]
    run(replay, 4, ["a", "b", "c", "d"], 6.0)  # the next snapshot: batch 3's is the one before
    assert files() == ["3.snapshot.arrow", "4.snapshot.arrow"]
    # batch 4 replayed: from batch 3's snapshot
    assert values(DeviceStateStore(ck, metrics, cfg), 4) == {"a": 5.0, "b": 1.0, "c": 4.0, "d": 4.0}


def test_device_current_is_rewritten_from_the_driver_until_another_commit(spark, gold_settings) -> None:
    from gold.device_state import CurrentTable
    from lakehouse.delta.tables import ensure_named_table
    from lakehouse.tables import device_current_schema

    schema = device_current_schema(gold_settings.telemetry)
    ensure_named_table(spark, gold_settings, "device_current", schema)
    path = gold_settings.table_path("device_current")
    cur = CurrentTable(path, schema, "health-app")

    def rows(devices: str, temperature: float) -> pa.Table:
        return pa.Table.from_pylist([dict(device_id=d, status="online", status_since=T0, last_seen=T0,
                                          temperature=temperature, updated_at=T0) for d in devices],
                                    schema=schema)

    def table() -> dict[str, float]:
        t = DeltaTable(path).to_pyarrow_table()
        return dict(zip(t.column("device_id").to_pylist(), t.column("temperature").to_pylist(), strict=True))

    cur.write(spark, rows("abc", 1.0), 0)
    cur.write(spark, rows("cd", 2.0), 1)
    assert table() == {"a": 1.0, "b": 1.0, "c": 2.0, "d": 2.0}
    assert cur.rows is not None and cur.version == DeltaTable(path).version()
    assert DeltaTable(path).history()[0]["operation"] == "WRITE" and len(DeltaTable(path).file_uris()) == 1

    spark.sql(f"OPTIMIZE delta.`{path}`")  # another commit: the next batch upserts and reloads
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('iotlake.test' = 'x')")
    cur.write(spark, rows("ae", 3.0), 2)
    assert table() == {"a": 3.0, "b": 1.0, "c": 2.0, "d": 2.0, "e": 3.0}
    assert cur.rows is None
    version = DeltaTable(path).version()
    cur.write(spark, rows("ae", 9.0), 2)  # a replayed batch: committed already
    assert DeltaTable(path).version() == version and cur.rows is None
    cur.write(spark, rows("b", 4.0), 3)  # reloaded, then rewritten from the driver again
    assert table() == {"a": 3.0, "b": 4.0, "c": 2.0, "d": 2.0, "e": 3.0}
    assert cur.version == DeltaTable(path).version() == version + 1


# ---- liveness by the wall clock, debounced status ----------------------------------------------
# Live, a device the pipeline received nothing from (silver's ingest_time) for
# offline_after_seconds goes offline even with no data at all (gold/ticks.py); a backfill keeps
# the event-time rule. A status changes between online and degraded once held.

SITE_MODEL = SENSOR.model_copy(update={"topic_pattern": "plant/{site}/{device_id}/telemetry"})


def settings_at(settings: Settings, name: str, model=SENSOR, **gold) -> Settings:
    """``settings`` under a data root of its own, for ``model``, with these gold settings."""
    return load_settings(environ={}, telemetry=model.model_dump(mode="json"),
                         data_root=str(Path(settings.data_root).parent / name),
                         spark={"master": "local[2]", "shuffle_partitions": 2},
                         stream={"watermark_seconds": 30, "gold_trigger_seconds": 0.5},
                         gold={"offline_after_seconds": 120, "max_files_per_trigger": 1} | gold)


def append_rows(settings: Settings, rows: list[dict]) -> None:
    schema = silver_schema(settings.telemetry)
    write_deltalake(settings.table_path("silver"), pa.Table.from_pylist(rows, schema=schema), mode="append")


def history_rows(settings: Settings) -> list[tuple]:
    """(device, status, previous, changed_at, reason) of every status change, in time order."""
    h = DeltaTable(settings.table_path("device_status_history")).to_pyarrow_table()
    rows = [(r["device_id"], r["status"], r["previous_status"], r["changed_at"], r["reason"]) for r in h.to_pylist()]
    return sorted(rows, key=lambda r: (r[0], r[3]))


def wait_for(what: str, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def now_ms() -> datetime:
    """The wall clock to the millisecond (the precision of a device's state)."""
    t = datetime.now(UTC)
    return t.replace(microsecond=t.microsecond // 1000 * 1000)


def status_now(settings: Settings, device: str) -> dict | None:
    if not Path(settings.table_path("device_current"), "_delta_log").exists():
        return None
    rows = [r for r in DeltaTable(settings.table_path("device_current")).to_pyarrow_table().to_pylist()
            if r["device_id"] == device]
    return rows[0] if rows else None


def test_a_device_without_any_data_goes_offline_by_the_wall_clock_then_back_online(spark, gold_settings) -> None:
    import gold.health

    s = settings_at(gold_settings, "wall-clock", offline_after_seconds=3)
    append_silver(s, [reading("dev-warm", datetime.now(UTC))])
    q = gold.health.start(spark, s)
    try:
        wait_for("a first batch", lambda: status_now(s, "dev-warm"), 120)  # the stream runs
        sent = now_ms()
        append_silver(s, [reading("dev-w", sent - timedelta(seconds=1 - 0.5 * i)) for i in range(3)])
        last = sent  # the last reading's ingest_time (= its event time here)
        cur = wait_for("offline", lambda: (c := status_now(s, "dev-w")) and c["status"] == "offline" and c, 60)
        took = (datetime.now(UTC) - last).total_seconds()
        assert took < 3 + 8, took  # offline_after_seconds, a trigger, a batch
        assert cur["status_reason"] == "no_data" and cur["last_received"] == last
        assert cur["status_since"] == last + timedelta(seconds=3)
        wait_for("offline in the history", lambda: [r[1] for r in history_rows(s) if r[0] == "dev-w"][-1] == "offline", 30)
        assert [r for r in history_rows(s) if r[0] == "dev-w"] == [
            ("dev-w", "online", None, last - timedelta(seconds=1), "data"),
            ("dev-w", "offline", "online", last + timedelta(seconds=3), "no_data")]
        # every device offline: no deadline, no ticks; the query idles
        assert status_now(s, "dev-warm")["status"] == "offline"
        batch = q.lastProgress["batchId"]
        time.sleep(3)
        assert q.lastProgress["batchId"] == batch and not q.status["isDataAvailable"]

        back = now_ms()
        append_silver(s, [reading("dev-w", back)])
        cur = wait_for("online", lambda: (c := status_now(s, "dev-w")) and c["status"] == "online" and c, 60)
        assert cur["status_reason"] == "data" and cur["last_received"] == back
        wait_for("online in the history", lambda: [r[1] for r in history_rows(s) if r[0] == "dev-w"][-1] == "online", 30)
        assert [r[1:4] for r in history_rows(s) if r[0] == "dev-w"][-1] == ("online", "offline", back)
    finally:
        q.stop()


def held(settings: Settings) -> list[dict]:
    """400 readings 10 s apart of one device: it reports its error status on 1% of them and
    breaches the battery rule in two single readings (no status change for either), its error
    status for readings 300-349 (degraded once held: at 306, 60 s after 300, the 7th) and then
    no more (online at 356); its site changes at reading 200."""
    site = "plant/north" if "site" in settings.telemetry.topic_columns else None
    rows = []
    for i in range(400):
        r = reading("dev-h", T0 + timedelta(seconds=10 * i), temp=21.0 + 0.1 * (i % 3),
                    battery=5.0 if i in (100, 200) else 80.0,
                    status="error" if i in (50, 150, 250, 390) or 300 <= i < 350 else "ok")
        r["event_id"] = f"h-{i}"  # the same in every run
        if site:
            r["site"] = "north" if i < 200 else "south"
        rows.append(r)
    return rows


def test_a_status_changes_once_it_held_not_on_single_readings(spark, gold_settings) -> None:
    s = settings_at(gold_settings, "held", SITE_MODEL)
    rows = held(s)
    append_rows(s, rows)
    run_health(spark, s)
    at = [r["event_time"] for r in rows]
    assert [r[1:] for r in history_rows(s)] == [
        ("online", None, at[0], "data"), ("degraded", "online", at[306], "error"),
        ("online", "degraded", at[356], "data")]
    cur = current(s, "dev-h")
    assert (cur["status"], cur["status_reason"], cur["status_since"]) == ("online", "data", at[356])
    assert cur["site"] == "south" and cur["last_received"] == rows[-1]["ingest_time"]


def test_status_history_is_the_same_however_the_readings_are_split(spark, gold_settings) -> None:
    """The hold's state survives restarts and batch boundaries: one batch, a batch per 7
    readings, or a restart within each hold (after readings 303 and 353) write the same tables."""
    runs = []
    for name, cuts, restarts in (("one", [0, 400], False), ("sevens", [*range(0, 400, 7), 400], False),
                                 ("restarts", [0, 150, 303, 353, 400], True)):
        s = settings_at(gold_settings, f"split-{name}", SITE_MODEL)
        rows = held(s)
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            append_rows(s, rows[lo:hi])
            if restarts:
                run_health(spark, s)
        run_health(spark, s)
        runs.append({t: comparable(DeltaTable(s.table_path(t)).to_pyarrow_table())
                     for t in ("device_status_history", "device_current", "readings_scored")})
    assert runs[0]["device_status_history"].num_rows == 3
    assert runs[0] == runs[1] == runs[2]


def test_a_backfill_never_takes_a_device_offline_by_the_wall_clock(spark, gold_settings) -> None:
    import gold.health

    s = settings_at(gold_settings, "backfill", offline_after_seconds=5)
    old = [reading("dev-old", T0 + timedelta(seconds=10 * i)) for i in range(3)]  # received in January
    append_silver(s, old)
    run_health(spark, s)
    assert history_rows(s) == [("dev-old", "online", None, T0, "data")]
    assert current(s, "dev-old")["last_received"] == old[-1]["ingest_time"]

    # live: dev-old was received long ago, its silence counts from the run's start (its data
    # could be waiting upstream of a pipeline that was down)
    before = now_ms()
    q = gold.health.start(spark, s)
    after = now_ms()
    try:
        wait_for("offline", lambda: (c := status_now(s, "dev-old")) and c["status"] == "offline", 60)
        # a batch writes its tables at once: device_current may commit before the history
        wait_for("offline in the history", lambda: history_rows(s)[-1][1] == "offline", 30)
    finally:
        q.stop()
    *_, (device, status, previous, gone, reason) = history_rows(s)
    assert (device, status, previous, reason) == ("dev-old", "offline", "online", "no_data")
    assert before + timedelta(seconds=5) <= gone <= after + timedelta(seconds=5)

    # a backfill on the live checkpoint (same sources) of more old data: its device stays online
    append_silver(s, [reading("dev-2", T0 + timedelta(seconds=10 * i)) for i in range(3)])
    run_health(spark, s)
    assert [r for r in history_rows(s) if r[0] == "dev-2"] == [("dev-2", "online", None, T0, "data")]
    assert current(s, "dev-2")["status"] == "online"


def test_a_checkpoint_from_before_the_ticks_runs_without_them(spark, gold_settings, caplog) -> None:
    """A checkpoint whose batches read silver alone (as before the ticks), a device_current of
    the first schema and device states without the later columns: the stream runs on, warns
    how to rebuild, and the tables gain the new columns."""
    import gold.health
    import gold.scoring
    from gold.device_state import DriverHealthBatch, driver_frame
    from gold.windows import silver_stream
    from lakehouse.delta.tables import ensure_named_table
    from lakehouse.streams import foreach_batch, query_id
    from lakehouse.tables import device_current_schema

    s = settings_at(gold_settings, "legacy", SITE_MODEL)
    first = device_current_schema(SENSOR)  # without last_received, status_reason, site, registry's
    first = pa.schema([f for f in first if f.name not in (
        "last_received", "status_reason", "labels", "registered", "revoked_at", "site")])
    ensure_named_table(spark, s, "device_current", first)
    ensure_named_table(spark, s, "device_status_history", gold.health.DEVICE_STATUS_HISTORY)
    for name, schema in (("readings_scored", gold.health.READINGS_SCORED), ("anomalies", gold.health.ANOMALIES)):
        ensure_named_table(spark, s, name, schema)
    rows = held(s)
    append_rows(s, rows[:100])
    ckpt = s.checkpoint_path("gold_health")
    silver = silver_stream(spark, s, columns=gold.scoring.health_input(s.telemetry))
    q = (foreach_batch(driver_frame(silver, s), "gold_health",
                       DriverHealthBatch(s, ckpt, query_id(ckpt), first.names))
         .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    q.awaitTermination()
    assert q.exception() is None
    # the device states as the first version wrote them
    from gold.device_state import state_files

    for _, _, f in state_files(Path(ckpt, "device_state")):
        t = pa.ipc.open_file(pa.memory_map(str(f))).read_all()
        keep = [c for c in t.column_names if c not in (
            "last_received", "status_reason", "pending_status", "pending_count", "pending_since", "topic.site")]
        with pa.OSFile(str(f), "wb") as out, pa.ipc.new_file(out, t.select(keep).schema) as w:
            w.write_table(t.select(keep))
    Path(ckpt, "iotlake_health_state_mode").write_text("driver\n")

    append_rows(s, rows[100:350])
    with caplog.at_level(logging.WARNING, logger="gold.health"):
        run_health(spark, s)
        q = gold.health.start(spark, s)  # live, without ticks
        try:
            append_rows(s, rows[350:])
            wait_for("the live batch", lambda: (c := status_now(s, "dev-h")) and c["last_received"]
                     == rows[-1]["ingest_time"], 60)
        finally:
            q.stop()
    assert sum("started before the health stream's ticks" in r.getMessage() for r in caplog.records) == 2
    assert [len(x.splitlines()) - 2 for x in (Path(ckpt, "offsets", b.name).read_text()
            for b in Path(ckpt, "offsets").glob("[0-9]*"))] == [1] * len(list(Path(ckpt, "offsets").glob("[0-9]*")))
    at = [r["event_time"] for r in rows]
    cur = current(s, "dev-h")
    # the hold from the first state on (a state without one holds nothing yet), the new columns
    assert [r[1:] for r in history_rows(s)] == [
        ("online", None, at[0], "data"), ("degraded", "online", at[306], "error"),
        ("online", "degraded", at[356], "data")]
    assert (cur["status"], cur["status_reason"], cur["site"]) == ("online", "data", "south")
    assert cur["last_received"] == rows[-1]["ingest_time"]
    row = status_now(s, "dev-h")
    assert (row["registered"], row["labels"], row["revoked_at"]) == (False, None, None)  # no registry


def test_a_replayed_batch_counts_silence_from_the_start_its_first_run_did(tmp_path) -> None:
    from gold.ticks import LiveStarts

    ck = tmp_path / "ck"
    offsets = ck / "offsets"
    offsets.mkdir(parents=True)
    LiveStarts(str(ck)).begin(1_000)  # a fresh checkpoint: from batch 0
    for b in range(3):
        (offsets / str(b)).write_text("v1\n{}\n{}\n")
    # batch 2 planned, not committed: the next run replays it as the first run counted
    again = LiveStarts(str(ck))
    again.begin(9_000)
    assert [again.since(b) for b in range(5)] == [1_000, 1_000, 1_000, 9_000, 9_000]
    LiveStarts(str(ck)).begin(12_000)  # a run that planned nothing: the next one replaces its entry
    assert LiveStarts(str(ck)).entries == [[0, 1_000], [3, 12_000]]


# ---- the device registry on device_current ------------------------------------------------------

def register(settings: Settings, rows: list[dict]) -> None:
    """Registry rows (device_id, site, labels as a dict, revoked) as `iotlake devices` writes them."""
    import json

    from lakehouse import device_registry
    from lakehouse.tables import DEVICES

    device_registry.upsert(settings, pa.Table.from_pylist(
        [{"created": T0, "revoked": None, "site": None, **r, "labels": json.dumps(r.get("labels", {}), sort_keys=True)}
         for r in rows], schema=DEVICES))


def metadata(settings: Settings) -> dict[str, tuple]:
    """(site, labels, registered, revoked_at) per device on device_current."""
    t = DeltaTable(settings.table_path("device_current")).to_pyarrow_table()
    return {r["device_id"]: (r["site"], r["labels"], r["registered"], r["revoked_at"]) for r in t.to_pylist()}


@pytest.mark.parametrize("mode", ["driver", "state_store"])
def test_device_current_carries_the_registry_and_follows_its_changes(spark, gold_settings, mode) -> None:
    """A registered device's site and labels on its row, an unregistered one's none, a revoked
    one's revocation; a registry change reaches the rows of devices that sent nothing since, at
    the stream's next batch (in both device state modes)."""
    import gold.health

    s = with_state(settings_at(gold_settings, f"registry-{mode}"), mode, f"registry-{mode}")
    revoked = T0 + timedelta(hours=1)
    register(s, [{"device_id": "dev-a", "site": "north", "labels": {"floor": "3"}},
                 {"device_id": "dev-r", "site": "south", "revoked": revoked}])
    append_silver(s, [reading(d, T0 + timedelta(seconds=i)) for i in range(3) for d in ("dev-a", "dev-r", "dev-u")])
    run_health(spark, s)
    assert metadata(s) == {"dev-a": ("north", '{"floor": "3"}', True, None),
                           "dev-r": ("south", "{}", True, revoked),
                           "dev-u": (None, None, False, None)}

    q = gold.health.start(spark, s)  # live: the registry changes while it runs
    try:
        append_silver(s, [reading("dev-r", T0 + timedelta(seconds=10))])
        wait_for("a live batch", lambda: status_now(s, "dev-r")["last_seen"] == T0 + timedelta(seconds=10), 60)
        register(s, [{"device_id": "dev-u", "site": "west", "labels": {"zone": "b"}},
                     {"device_id": "dev-a", "site": "north", "labels": {"floor": "4"}}])
        append_silver(s, [reading("dev-r", T0 + timedelta(seconds=11))])  # a batch; dev-a, dev-u send nothing
        wait_for("the registry's change", lambda: metadata(s)["dev-u"][2], 60)
    finally:
        q.stop()
    assert metadata(s) == {"dev-a": ("north", '{"floor": "4"}', True, None),
                           "dev-r": ("south", "{}", True, revoked),
                           "dev-u": ("west", '{"zone": "b"}', True, None)}
    assert status_now(s, "dev-a")["last_seen"] == T0 + timedelta(seconds=2)  # the rest as it was


def test_the_topics_site_wins_and_the_registrys_fills_in(spark, gold_settings) -> None:
    """A topic that names the site: device_current's ``site`` is the topic's; the registry's
    only for a device whose readings carry none."""
    s = settings_at(gold_settings, "registry-site", SITE_MODEL)
    register(s, [{"device_id": "dev-t", "site": "registry-site"}, {"device_id": "dev-n", "site": "registry-site"}])
    rows = [reading("dev-t", T0) | {"site": "topic-site"}, reading("dev-n", T0) | {"site": None},
            reading("dev-u", T0) | {"site": "topic-site"}]
    append_rows(s, rows)
    run_health(spark, s)
    assert {d: m[0] for d, m in metadata(s).items()} == {
        "dev-t": "topic-site", "dev-n": "registry-site", "dev-u": "topic-site"}


def test_a_registry_read_only_at_a_new_version_and_a_refresh_of_the_changed_devices(tmp_path, monkeypatch) -> None:
    """The driver's registry join: no read while the registry's version stays; after a change,
    the positions of exactly the devices it changed (every device at the first batch)."""
    from gold.registry import RegistryJoin

    s = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path / "lake"))
    register(s, [{"device_id": d, "site": "x"} for d in ("a", "b", "c")])
    from lakehouse import device_registry

    reads = []
    read = device_registry.delta_read.read_table
    monkeypatch.setattr(device_registry.delta_read, "read_table", lambda *a, **k: reads.append(a) or read(*a, **k))
    registry = RegistryJoin(s)
    ids = np.array(["a", "b", "c", "d"], dtype=object)
    assert registry.changed_among(ids).tolist() == [0, 1, 2, 3]  # the first batch: every device
    version = registry.metadata.version
    for _ in range(3):
        assert registry.changed_among(ids).tolist() == [] and registry.metadata.version == version
    assert len(reads) == 1
    register(s, [{"device_id": "b", "site": "y"}, {"device_id": "d", "site": "x"}, {"device_id": "c", "site": "x"}])
    assert registry.changed_among(ids).tolist() == [1, 3]  # c's row is rewritten the same
    assert len(reads) == 2
    got = registry.arrays(np.array(["d", "e"], dtype=object))
    assert got["site"].tolist() == ["x", None] and got["registered"].tolist() == [True, False]
