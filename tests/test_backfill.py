"""Backfill (availableNow on the live checkpoints) and time-travel reprocessing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from confluent_kafka import Producer
from deltalake import DeltaTable
from fleets import SENSOR

from ingest.simulator import generate
from lakehouse.kafka.config import client_config
from lakehouse.settings import Settings, load_settings
from lakehouse.streams import CheckpointBusy
from orchestration.backfill import backfill, rows_to_do
from tests.lakehouse_fixture import write_bronze

START = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _layered(request: pytest.FixtureRequest) -> None:
    """These tests are the layered queries' (silver from bronze's Delta table, bronze written
    here); the fused topology's backfill is test_topology's."""
    if "settings" in request.fixturenames:
        request.getfixturevalue("settings").stream.topology = "layered"


def produce(settings: Settings, messages) -> None:
    p = Producer(client_config(settings, **{"linger.ms": 5}))
    for m in messages:
        p.produce(settings.kafka.topic, key=m.topic.split("/")[-2].encode(), value=m.payload)
    p.flush(30)


def count(settings: Settings, table: str) -> int:
    return DeltaTable(settings.table_path(table)).to_pyarrow_dataset().count_rows()


def test_backfill_catches_up_exactly_and_rerun_changes_nothing(settings: Settings, spark) -> None:
    msgs = generate(settings, 900, devices=5, duplicates=20, malformed=10, start=START)
    produce(settings, msgs[:500])
    assert rows_to_do(settings, "bronze") == 500
    done = backfill(settings, ["bronze", "silver", "gold"])
    assert done["bronze"] == 500 and count(settings, "bronze") == 500
    assert rows_to_do(settings, "silver") == 0
    produce(settings, msgs[500:])
    assert rows_to_do(settings, "bronze") == 400
    done = backfill(settings, ["bronze", "silver", "gold"], max_rows=150)  # bounded batches
    assert done["bronze"] == 400 and done["silver"] == 400
    assert count(settings, "bronze") == 900
    assert count(settings, "silver") == 900 - 20 - 10
    assert count(settings, "quarantine") == 10
    versions = {t: DeltaTable(settings.table_path(t)).version()
                for t in ("bronze", "silver", "gold_metrics_1m", "device_current")}
    assert backfill(settings, ["bronze", "silver", "gold"]) == {"bronze": 0, "silver": 0, "gold": 0}
    assert versions == {t: DeltaTable(settings.table_path(t)).version() for t in versions}


def test_backfill_counts_every_batch_past_the_last_100(settings: Settings, spark,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A query's ``recentProgress`` keeps its last 100 batches: 105 one-record batches (one
    device, so one partition; at most one record per trigger) are counted whole."""
    produce(settings, generate(settings, 105, devices=1, start=START))
    with caplog.at_level(logging.INFO, logger="orchestration.progress"):
        done = backfill(settings, ["bronze"], max_rows=1)
    assert done == {"bronze": 105} and count(settings, "bronze") == 105
    assert DeltaTable(settings.table_path("bronze")).version() >= 105  # a commit per batch
    assert "backfill bronze: done, 105 / 105 rows (100%), 105 batches" in caplog.text


def test_backfill_refuses_while_live_stream_holds_checkpoint(settings: Settings, spark,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOTLAKE_STREAM__TOPOLOGY", "layered")  # for the CLI's own settings
    ckpt = settings.checkpoint_path("silver")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from lakehouse.streams import lock_checkpoint; "
         f"lock_checkpoint({ckpt!r}); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointBusy, match="in use by another running stream"):
            backfill(settings, ["silver"])
        from orchestration.cli import main

        assert main(["--data-root", settings.data_root, "backfill", "--layer", "silver"]) == 3
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.2)


def test_backfill_cli_refuses_while_the_live_stream_runs(tmp_path: Path, spark) -> None:
    """A real live silver stream (this process) holds the checkpoint: ``iotlake backfill`` in
    another process refuses clearly with exit code 3, before starting Spark, changing nothing."""
    import silver.stream
    from lakehouse.streams import release_checkpoints
    from orchestration.pipeline import delta_caught_up

    lake = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path / "lake"),
                         stream={"trigger_seconds": 0.5, "topology": "layered"})
    write_bronze(lake, generate(lake, 200, devices=4, duplicates=5, start=START))
    live = silver.stream.start(spark, lake)  # trigger "live": runs until stopped
    try:
        deadline = time.monotonic() + 120
        while not delta_caught_up(live, lake.table_path("bronze")):
            assert live.isActive and time.monotonic() < deadline, live.exception()
            time.sleep(0.5)
        before = DeltaTable(lake.table_path("silver")).version(), count(lake, "silver")
        env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
        env["IOTLAKE_STREAM__TOPOLOGY"] = "layered"  # silver reads the bronze written here
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("iotlake")), "--data-root", lake.data_root,
             "backfill", "--layer", "silver"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert proc.stderr.strip() == (
            f"iotlake: refused: checkpoint {lake.checkpoint_path('silver')} is in use by another "
            "running stream (e.g. `iotlake run`); stop that stream first, or let it catch up by "
            "itself")
        assert live.isActive
        assert (DeltaTable(lake.table_path("silver")).version(), count(lake, "silver")) == before
        assert before[1] == 195
    finally:
        live.stop()
        release_checkpoints()


def test_reprocess_as_of_bronze_version_switches_readers_and_is_idempotent(settings: Settings, spark) -> None:
    from orchestration.reprocess import reprocess

    msgs = generate(settings, 700, devices=5, duplicates=15, malformed=8, start=START)
    first = msgs[:400]
    produce(settings, first)
    backfill(settings, ["bronze"])
    v_first = DeltaTable(settings.table_path("bronze")).version()
    produce(settings, msgs[400:])
    backfill(settings, ["bronze", "silver", "gold"])
    assert count(settings, "silver") == 700 - 15 - 8

    dry = reprocess(settings, version=v_first, dry_run=True)
    assert dry["bronze_rows_as_of"] == 400 and dry["bronze_rows_now"] == 700
    assert settings.generation() == ""  # dry run changed nothing

    report = reprocess(settings, version=v_first)
    assert report["switched_to"] == f"v{v_first}" and settings.generation() == f"v{v_first}"
    # readers now see silver/gold computed from bronze as of that version only
    valid_first = {m.event_id for m in first if m.kind in ("valid", "late")}
    # silver read all of bronze (its filter kept version v_first's rows); gold read those
    assert report["rows_read"] == {"silver": 700, "gold_metrics_1m": len(valid_first),
                                   "gold_health": len(valid_first)}
    silver = DeltaTable(settings.table_path("silver")).to_pandas()
    assert set(silver.event_id) == valid_first and silver.event_id.is_unique
    assert count(settings, "quarantine") == sum(m.kind == "malformed" for m in first)
    gold = DeltaTable(settings.table_path("gold_metrics_1m")).to_pandas()
    assert gold["count"].sum() == 3 * len(valid_first)
    # the original generation is untouched
    assert DeltaTable(settings.table_path("silver", generation="")).to_pyarrow_dataset().count_rows() == 677
    versions = DeltaTable(settings.table_path("silver")).version()
    again = reprocess(settings, version=v_first)  # rerun: nothing rebuilt, nothing changes
    assert again["switched_to"] == f"v{v_first}" and set(again["rows_read"].values()) == {0}
    assert DeltaTable(settings.table_path("silver")).version() == versions


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(capsys: pytest.CaptureFixture,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from orchestration.progress import RowsProgress

    with RowsProgress("backfill silver", 1000, tty=True) as bar:
        bar.update(250, 3)
    assert "backfill silver" in (err := capsys.readouterr().err) and "250 / 1,000 rows (25%), 3 batches" in err
    with caplog.at_level(logging.INFO, logger="orchestration.progress"):
        with RowsProgress("backfill gold", 1000, every=0.0, tty=False) as lines:
            lines.update(500, 2)
            lines.update(1000, 4)
    assert [r.getMessage().split(", ")[:2] for r in caplog.records] == [
        ["backfill gold: 500 / 1,000 rows (50%)", "2 batches"],
        ["backfill gold: 1,000 / 1,000 rows (100%)", "4 batches"]]
    assert " left" in caplog.records[0].getMessage() and " left" not in caplog.records[1].getMessage()
