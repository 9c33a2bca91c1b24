"""Gold: device status from event-time timeouts, anomaly flags, restart without re-warm-up."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lakehouse.settings import Settings, load_settings
from lakehouse.tables import SILVER

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def gold_settings(tmp_path) -> Settings:
    return load_settings(
        environ={}, data_root=str(tmp_path / "lake"),
        spark={"master": "local[2]", "shuffle_partitions": 2},
        stream={"watermark_seconds": 30, "max_rows_per_trigger": 1},
        gold={"offline_after_seconds": 120},
    )


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
    # commits 2..: only dev-00001 keeps reporting; event time moves 6 minutes on
    for k in range(1, 7):
        append_silver(s, [reading("dev-00001", T0 + timedelta(minutes=k, seconds=10 * i)) for i in range(6)])
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
    n = 400
    temps = 21 + rng.normal(0, 0.2, n)
    temps[300] = 45.0  # an injected spike
    rows = [reading("dev-00003", T0 + timedelta(seconds=15 * i), temp=float(temps[i])) for i in range(n)]
    append_silver(s, rows[:250])
    run_health(spark, s)  # stream stops here: detector state must carry over the restart
    append_silver(s, rows[250:])
    append_silver(s, [reading("dev-00003", T0 + timedelta(seconds=15 * n), battery=5.0)])
    run_health(spark, s)
    an = DeltaTable(s.table_path("anomalies")).to_pandas()
    temp_flags = an[an.metric == "temperature"]
    assert list(temp_flags.event_id) == [rows[300]["event_id"]]
    scored = DeltaTable(s.table_path("readings_scored")).to_pandas()
    assert len(scored) == (n + 1) * 3 and scored.event_id.nunique() == n + 1
    assert scored.score.between(0, 1).all()
    assert current(s, "dev-00003")["status"] == "degraded"
    h = DeltaTable(s.table_path("device_status_history")).to_pandas()
    assert any("battery_low" in r for r in h.reason)
