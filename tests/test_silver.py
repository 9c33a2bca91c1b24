"""Silver on a bronze table written directly (no Kafka): routing, dedup, late rows, accounting.

Every test drives ``silver.stream.start`` with ``trigger=available_now`` and checks exact rows:
which bronze offsets land in silver, which in quarantine with which reason, and that the
quality log's counters account for every bronze row.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from fleets import SENSOR
from pyspark.sql import functions as F

import silver.stream
from lakehouse.delta.read import read_table
from lakehouse.settings import Settings, load_settings
from lakehouse.spark import session_confs
from lakehouse.tables import BRONZE
from orchestration.pipeline import delta_caught_up
from silver.expectations import arrow_quality, failed_expectations, load_suite, quality_summary
from silver.validate import validate_table
from tests.test_expectations import CASES, SCHEMA, SENSOR_SUITE

T = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
_DROP = object()


def payload(i: int, at: datetime | str = T, **over) -> bytes:
    """A valid v1 payload for event ``i``; ``over`` replaces fields (``_DROP`` removes one)."""
    ts = at if isinstance(at, str) else at.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    rec = {"schema_version": 1, "device_id": f"dev-{i % 50 + 1:05d}", "event_id": f"{i:032x}",
           "ts": ts, "temperature": 20.0 + i % 10, "humidity": 40.0, "battery": 90.0,
           "status": "ok"}
    rec.update(over)
    return json.dumps({k: v for k, v in rec.items() if v is not _DROP}).encode()


class Bronze:
    """Appends payloads to the bronze table as one commit each, with increasing offsets."""

    def __init__(self, settings: Settings) -> None:
        self.path, self.offset, self.payloads = settings.table_path("bronze"), 0, {}
        write_deltalake(self.path, BRONZE.empty_table())  # version 0: the empty table

    def append(self, *payloads: bytes) -> list[int]:
        offsets = list(range(self.offset, self.offset + len(payloads)))
        self.offset += len(payloads)
        self.payloads.update(zip(offsets, payloads, strict=True))
        write_deltalake(self.path, pa.table({
            "key": [None] * len(payloads), "value": list(payloads), "topic": ["telemetry"] * len(payloads),
            "partition": [0] * len(payloads), "offset": offsets,
            "timestamp": [T] * len(payloads), "headers": [[]] * len(payloads),
            "ingest_time": [T] * len(payloads)}, schema=BRONZE), mode="append")
        return offsets


def _naive(v):
    """A timestamp as naive UTC (Spark's collect gives naive local times, delta-rs aware UTC)."""
    if isinstance(v, datetime):
        return v.astimezone(UTC).replace(tzinfo=None) if v.tzinfo else \
            v.astimezone().astimezone(UTC).replace(tzinfo=None)
    return v


def _json(p: bytes) -> dict | None:
    try:
        return json.loads(p)
    except ValueError:
        return None


@pytest.fixture
def lake(tmp_path: Path, request) -> Settings:
    dedup = getattr(request, "param", "index")
    return load_settings(environ={}, data_root=str(tmp_path / "lake"),
                         spark={"master": "local[2]", "shuffle_partitions": 2},
                         stream={"watermark_seconds": 600, "dedup": dedup},
                         telemetry={**SENSOR.model_dump(mode="json"), "suite": str(SENSOR_SUITE)})


#: Both dedup implementations must give the same rows, counts and re-reads.
both_dedups = pytest.mark.parametrize("lake", ["index", "state_store"], indirect=True)


def run(spark, settings: Settings, files: int | None = None, **kwargs) -> None:
    """Silver with availableNow; ``files``: bronze files per batch (one commit = one file here)."""
    if files:
        settings = settings.model_copy(deep=True)
        settings.stream.silver_max_files_per_trigger = files
    q = silver.stream.start(spark, settings, trigger="available_now", **kwargs)
    q.awaitTermination(300)
    assert not q.isActive and q.exception() is None


def table(settings: Settings, name: str) -> pa.Table:
    return read_table(settings.table_path(name))


def quarantined(settings: Settings) -> dict[int, str]:
    q = table(settings, "quarantine")
    return dict(zip(q.column("kafka_offset").to_pylist(), q.column("reason").to_pylist(), strict=True))


def silver_offsets(settings: Settings) -> set[int]:
    return set(table(settings, "silver").column("kafka_offset").to_pylist())


def accounted(settings: Settings, bronze: Bronze) -> dict[str, int]:
    """Counter totals of the quality log, checked against every table to the row."""
    log = table(settings, "quality_log").to_pylist()
    totals: Counter[str] = Counter()
    for r in log:
        if r["kind"] == "counter":
            totals[r["expectation"]] += json.loads(r["details"])["count"]
    q = quarantined(settings)
    assert totals["rows_in"] == DeltaTable(bronze.path).to_pyarrow_dataset().count_rows() == bronze.offset
    assert totals["silver"] == table(settings, "silver").num_rows
    assert totals["quarantine"] == sum(r != "late" for r in q.values())
    assert totals["late"] == sum(r == "late" for r in q.values())
    assert totals["rows_in"] == (totals["silver"] + totals["quarantine"] + totals["duplicates"]
                                 + totals["late"])
    assert silver_offsets(settings).isdisjoint(q)  # nothing is both valid and quarantined
    return dict(totals)


def test_each_defect_kind_goes_to_quarantine_with_its_exact_reason(spark, lake):
    b = Bronze(lake)
    cases = [  # payload, expected quarantine reason (None: valid)
        (payload(1), None), (payload(2), None),
        (payload(3, fw="1.2"), None),  # unknown field: kept in `extra`, not a defect
        (b"\xffnot json", "not_json"), (payload(4)[:20], "not_json"),
        (payload(5, event_id=_DROP), "missing_event_id,event_id_not_null"),
        (payload(6, device_id=_DROP), "device_id_not_null"),
        (payload(7, ts=_DROP), "missing_ts,event_time_not_null"),
        (payload(8, temperature="hot"), "wrong_type:temperature"),
        (payload(9, ts="yesterday"), "bad_ts,event_time_not_null"),
        (payload(10, temperature=130.5), "temperature_in_range"),
        (payload(11, humidity=-0.5), "humidity_in_range"),
        (payload(12, battery=100.5), "battery_in_range"),
        (payload(13, status="broken"), "status_known"),
        (payload(14, event_id="XYZ"), "event_id_format"),
        (payload(15, device_id="dev-15"), "device_id_format"),
        (payload(16, temperature=-41.0, status="OK"), "temperature_in_range,status_known"),
    ]
    offsets = b.append(*(p for p, _ in cases))
    run(spark, lake)

    expected = {o: r for o, (_, r) in zip(offsets, cases, strict=True) if r}
    assert quarantined(lake) == expected
    assert silver_offsets(lake) == {o for o, (_, r) in zip(offsets, cases, strict=True) if not r}
    q = table(lake, "quarantine").to_pylist()
    assert all(r["value"] == b.payloads[r["kafka_offset"]] for r in q)  # raw bytes, unchanged
    s = {r["kafka_offset"]: r for r in table(lake, "silver").to_pylist()}
    assert json.loads(s[offsets[2]]["extra"]) == {"fw": "1.2"}
    assert accounted(lake, b) == {"rows_in": len(cases), "silver": 3, "quarantine": len(cases) - 3,
                                  "duplicates": 0, "late": 0}

    # quality log: every parse check and every suite expectation, counted on this batch
    log = {r["expectation"]: r for r in table(lake, "quality_log").to_pylist() if r["kind"] != "counter"}
    suite = load_suite(SENSOR_SUITE)
    assert set(log) >= {c.name for c in suite.checks}
    reasons = Counter(n for r in expected.values() for n in r.split(","))
    docs = [d for d in (_json(p) for p, _ in cases) if d is not None]
    n_json = len(docs)
    assert n_json == len(cases) - 2
    for c in suite.row_level:
        r = log[c.name]
        assert (r["kind"], r["failed"], r["success"]) == ("row", reasons[c.name], not reasons[c.name])
        assert r["passed"] + r["failed"] == r["evaluated"]
    assert log["event_id_not_null"]["evaluated"] == n_json  # not_null: every JSON row
    assert log["temperature_in_range"]["evaluated"] == n_json - 1  # "hot" parsed to null
    assert (log["not_json"]["evaluated"], log["not_json"]["failed"]) == (len(cases), 2)
    assert (log["wrong_type:temperature"]["evaluated"], log["wrong_type:temperature"]["failed"]) == (n_json, 1)
    assert log["missing_ts"]["failed"] == log["bad_ts"]["failed"] == 1
    assert (log["row_count"]["kind"], json.loads(log["row_count"]["details"])["observed_value"]) == ("set", n_json)
    assert (log["event_id_unique"]["evaluated"], log["event_id_unique"]["failed"]) == (n_json - 1, 0)
    temps = [d["temperature"] for d in docs if isinstance(d.get("temperature"), float)]
    mean = json.loads(log["temperature_mean_in_range"]["details"])["observed_value"]
    assert mean == pytest.approx(sum(temps) / len(temps))


@both_dedups
def test_duplicates_within_a_batch_across_batches_and_across_a_restart(spark, lake):
    b = Bronze(lake)
    first = b.append(*(payload(i) for i in range(10)), payload(3),  # same bytes, same batch
                     payload(5, temperature=29.5),  # same event id, other bytes: still a duplicate
                     b"not json", b"not json",  # no key: never deduplicated, both quarantined
                     payload(40, ts=_DROP), payload(40, ts=_DROP))
    second = b.append(*(payload(i) for i in range(10, 15)), payload(1))  # 1: seen in batch 0
    run(spark, lake, files=1)  # one batch per commit
    b.append(*(payload(i) for i in range(15, 18)), payload(2), payload(12), payload(12))
    live = silver.stream.start(spark, lake, trigger="live")  # same checkpoint: state restored
    deadline = time.monotonic() + 120
    while not delta_caught_up(live, b.path):
        assert live.isActive and time.monotonic() < deadline
        time.sleep(0.5)
    live.stop()  # a graceful stop ...
    b.append(payload(18), payload(17), payload(0), payload(18))
    run(spark, lake)  # ... and a restart from the checkpoint
    run(spark, lake)  # nothing new: nothing written

    silver_rows = table(lake, "silver")
    ids = silver_rows.column("event_id").to_pylist()
    assert sorted(ids) == [f"{i:032x}" for i in range(19)]
    first_seen = dict(zip(ids, silver_rows.column("kafka_offset").to_pylist(), strict=True))
    assert first_seen[f"{5:032x}"] == first[5] and first_seen[f"{1:032x}"] == first[1]
    assert first_seen[f"{12:032x}"] == second[2]
    assert sorted(quarantined(lake).values()) == ["missing_ts,event_time_not_null"] * 2 + ["not_json"] * 2
    assert accounted(lake, b) == {"rows_in": 32, "silver": 19, "quarantine": 4, "duplicates": 9,
                                  "late": 0}
    # the quality log judges the same rows either way (state_store: one Spark aggregation)
    q = table(lake, "quality_log").to_pylist()
    failed = lambda name: sum(r["failed"] or 0 for r in q if r["expectation"] == name)  # noqa: E731
    assert {c.name for c in load_suite(SENSOR_SUITE).row_level} <= {r["expectation"] for r in q}
    assert (failed("event_time_not_null"), failed("not_json"), failed("missing_ts")) == (2, 2, 2)


def test_late_rows_are_counted_and_quarantined(spark, lake):
    """Spark drops a row as late against the previous batch's watermark (600 s here)."""
    b = Bronze(lake)
    mins = lambda m: T + timedelta(minutes=m)  # noqa: E731
    # A batch drops rows at or below the watermark the batch before it computed (max event time
    # seen - 10 min): 0 for batches 0 and 1 (a device clock reset to the epoch is late), T-10m
    # for batch 2, T+50m for the next run.
    a, epoch = b.append(payload(1, T), payload(2, "1970-01-01T00:00:00Z"))
    (c,) = b.append(payload(3, mins(60)))
    on_time, late_c = b.append(payload(4, mins(30)), payload(5, mins(-20)))
    run(spark, lake, files=1)  # one batch per commit
    late_d = b.append(payload(6, mins(50)),  # exactly at the watermark: late
                      payload(7, mins(49), temperature=500.0),  # late wins over invalid
                      payload(1, T))  # a late re-send of event 1: late, not a duplicate
    fine = b.append(payload(8, mins(51)), payload(9, mins(55)), b"oops")
    run(spark, lake)

    q = quarantined(lake)
    assert {o for o, r in q.items() if r == "late"} == {epoch, late_c, *late_d}
    assert silver_offsets(lake) == {a, c, on_time, *fine[:2]}
    assert q[fine[2]] == "not_json"
    late_rows = [r for r in table(lake, "quarantine").to_pylist() if r["reason"] == "late"]
    assert all(r["value"] == b.payloads[r["kafka_offset"]] for r in late_rows)
    assert accounted(lake, b) == {"rows_in": 11, "silver": 5, "quarantine": 1, "duplicates": 0,
                                  "late": 5}


def test_a_replayed_batch_writes_nothing_twice_and_both_readers_agree(spark, lake):
    """A crash after the batch's Delta commits but before Spark recorded it: the restart replays
    that batch id, Delta's txn ids skip every write, the index gives the same answer."""
    b = Bronze(lake)
    b.append(*(payload(i) for i in range(6)), payload(2), b"nope")
    b.append(*(payload(i) for i in range(6, 9)), payload(0))
    run(spark, lake, files=1)
    before = {n: table(lake, n).sort_by("kafka_offset" if n != "quality_log" else "batch_id")
              for n in ("silver", "quarantine")}
    log_rows = table(lake, "quality_log").num_rows
    commits = Path(lake.checkpoint_path("silver"), "commits")
    last = max(int(f.name) for f in commits.iterdir() if f.name.isdigit())
    (commits / str(last)).unlink()  # Spark will replay batch `last`
    (commits / f".{last}.crc").unlink(missing_ok=True)
    run(spark, lake, files=1)
    assert (commits / str(last)).exists()
    for n, t in before.items():
        assert table(lake, n).sort_by("kafka_offset").equals(t)
    assert table(lake, "quality_log").num_rows == log_rows
    assert accounted(lake, b) == {"rows_in": 12, "silver": 9, "quarantine": 1, "duplicates": 2,
                                  "late": 0}
    for n in ("silver", "quarantine", "quality_log"):  # delta-spark reads what delta-rs reads
        rs = table(lake, n).to_pylist()
        js = [r.asDict() for r in spark.read.format("delta").load(lake.table_path(n)).collect()]
        key = lambda r: json.dumps({k: _naive(v) for k, v in r.items()}, sort_keys=True,  # noqa: E731
                                   default=str)
        assert sorted(map(key, rs)) == sorted(map(key, js)), n


def test_editing_the_suite_changes_routing_on_the_next_run(spark, lake, tmp_path):
    b = Bronze(lake)
    warm = b.append(payload(1, temperature=35.0), payload(2, temperature=20.0))
    run(spark, lake)
    raw = copy.deepcopy(dict(load_suite(SENSOR_SUITE).raw))
    for e in raw["expectations"]:
        if e["meta"]["name"] == "temperature_in_range":
            e["kwargs"].update(min_value=-10.0, max_value=30.0)
    tight = tmp_path / "tight.json"
    tight.write_text(json.dumps(raw))
    hot, ok = b.append(payload(3, temperature=35.0), payload(4, temperature=20.0))
    run(spark, lake, suite_path=tight)

    assert quarantined(lake) == {hot: "temperature_in_range"}
    assert silver_offsets(lake) == {*warm, ok}
    log = [r for r in table(lake, "quality_log").to_pylist() if r["expectation"] == "temperature_in_range"]
    assert [r["failed"] for r in sorted(log, key=lambda r: r["batch_id"])] == [0, 1]
    accounted(lake, b)


def test_validate_counts_match_quarantine_for_the_same_rows(spark, lake, tmp_path):
    """GX over the parsed rows (before routing) finds what the stream quarantined, per check."""
    b = Bronze(lake)
    b.append(*(payload(i) for i in range(8)), payload(20, temperature=126.0),
             payload(21, temperature=-45.0, humidity=100.1), payload(22, status="lost"),
             payload(23, device_id="sensor-1"), payload(24, event_id=_DROP),
             payload(25, device_id=_DROP, battery=-2.0), payload(26, ts="later"), b"{oops")
    run(spark, lake)

    bronze = read_table(b.path, columns=["value", "topic", "partition", "offset", "ingest_time"])
    suite = load_suite(SENSOR_SUITE)
    parsed = (silver.stream.validated(spark.createDataFrame(bronze), suite, SENSOR)
              .where(F.col("reasons") != "not_json").select(*suite.columns).toArrow())
    write_deltalake(lake.table_path("scratch"), parsed)
    summary = validate_table(lake, "scratch", out_dir=tmp_path / "report")

    in_quarantine = Counter(n for r in quarantined(lake).values() for n in r.split(","))
    row_names = [c.name for c in suite.row_level]
    assert {n: summary["unexpected_counts"][n] for n in row_names} == {
        n: in_quarantine[n] for n in row_names}
    assert sum(in_quarantine[n] for n in row_names) == 9
    log = {r["expectation"]: r for r in table(lake, "quality_log").to_pylist()}
    assert log["event_id_unique"]["failed"] == summary["unexpected_counts"]["event_id_unique"] == 0
    for name in ("row_count", "temperature_mean_in_range"):
        observed = json.loads(log[name]["details"])["observed_value"]
        assert observed == pytest.approx(summary["expectations"][name]["observed_value"])


def test_arrow_quality_equals_the_spark_aggregation(spark):
    """The stream's pyarrow quality log and ``quality_summary`` (one Spark pass) agree."""
    suite = load_suite(SENSOR_SUITE)
    df = spark.createDataFrame([c[:-1] for c in CASES], SCHEMA).withColumn(
        "failed_expectations", failed_expectations(suite))
    for data in (df, df.limit(0)):
        got, want = arrow_quality(suite, data.toArrow()), quality_summary(data, suite)
        assert [_approx(r) for r in got] == [_approx(r) for r in want]


def _approx(r: dict) -> dict:
    """A quality-log row with its observed value compared approximately (float sums)."""
    details = json.loads(r["details"])
    if isinstance(details.get("observed_value"), float):
        details["observed_value"] = pytest.approx(details["observed_value"])
    return {**r, "details": details}


def test_a_batch_whose_watermark_moved_generates_no_new_code(spark, lake, monkeypatch):
    """Compiled (a backfill's mode), Spark generates a batch's code once: a watermark written
    into it as a long literal made every batch's code new (compiled again, and interpreted until
    the JIT caught up). Each batch here moves the watermark 20 minutes and holds the same kinds
    of rows."""
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()
    per_batch: dict[int, int] = {}
    write = silver.stream.SilverBatchWriter.__call__

    def counted(self, df, batch_id: int) -> None:
        before = compiled.getCount()
        write(self, df, batch_id)
        per_batch[batch_id] = compiled.getCount() - before

    monkeypatch.setattr(silver.stream.SilverBatchWriter, "__call__", counted)
    b = Bronze(lake)
    for k in range(4):
        at = T + timedelta(minutes=20 * k)
        first = payload(10 * k, at)
        b.append(first, payload(10 * k + 1, at), first, payload(10 * k + 2, at, temperature=500.0))
    with session_confs(spark, {"spark.sql.codegen.factoryMode": "FALLBACK"}):
        run(spark, lake, files=1)  # one batch per commit
    assert sorted(per_batch) == [0, 1, 2, 3]
    assert per_batch[2] == per_batch[3] == 0, per_batch
    assert accounted(lake, b) == {"rows_in": 16, "silver": 8, "quarantine": 4, "duplicates": 4, "late": 0}
