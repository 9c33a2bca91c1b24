"""`iotlake status` and the dashboard's /healthz: the running pipeline's health, from the one
snapshot `iotlake run` writes every second (orchestration/status.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app
from ingest.simulator import generate, publish
from lakehouse.delta.read import row_count
from lakehouse.monitoring.status_file import iso_time, read_status, status_path, write_status
from lakehouse.settings import AlertRuleSettings, Settings, load_settings
from orchestration.cli import main
from orchestration.pipeline import Running, start_layers
from orchestration.run import bridge_thread
from orchestration.services import free_port
from orchestration.status import StatusWriter, bridge_problems, query_problems, snapshot

#: the one alert rule these tests' settings have (the status reads its stale_seconds)
STALE = AlertRuleSettings(name="Stale", kind="pipeline_stale")


def _cli(capsys, cfg: Path, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--config", str(cfg), "status", *args])
    return code, capsys.readouterr().out


def _tick_until(writer: StatusWriter, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = writer.tick()
        if predicate(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {json.dumps(snap)}"
        time.sleep(1.0)


def test_a_running_pipeline_is_healthy_idle_and_unhealthy_once_a_query_stops(
        settings: Settings, spark, capsys, tmp_path: Path) -> None:
    settings.alerts.rules = [AlertRuleSettings(name="Stale", kind="pipeline_stale", stale_seconds=15)]
    cfg = settings.save(tmp_path / "settings.json")
    health = TestClient(create_app(settings, check_every=0.0), base_url="http://localhost")
    with bridge_thread(settings) as bridge:
        running = Running(spark, settings, start_layers(spark, settings))
        try:
            writer = StatusWriter(settings, "all", running, bridge)
            publish(settings, generate(settings, 300, devices=5, duplicates=0, malformed=0))
            running.wait_caught_up(lambda: row_count(settings.table_path("bronze")), 300, timeout=180)
            snap = _tick_until(writer, lambda s: s["healthy"] and all(
                q["last_batch_id"] is not None for q in s["queries"].values()), 60, "every query's batch")
            assert json.loads(status_path(settings).read_text()) == writer.latest == snap
            names = {q.name for q in running.queries.values()}
            assert set(snap["queries"]) == names == {"bronze_silver", "gold_metrics_1m", "gold_health"}
            assert snap["problems"] == [] and snap["role"] == "all" and snap["pid"] == os.getpid()
            for q in snap["queries"].values():
                assert q["active"] and q["error"] is None and not q["stale"]
                assert 0 <= q["last_progress_age_s"] < 15 and q["last_batch_age_s"] >= 0
            kafka_query = snap["queries"]["bronze_silver"]
            assert kafka_query["source"] == "kafka" and kafka_query["lag"] == 0
            assert snap["queries"]["gold_health"]["source"] == "delta"
            b = snap["bridge"]
            assert (b["running"], b["delivering"], b["connected"], b["delivered"], b["pending"]) == (
                True, True, True, 300, 0)
            assert {k: (f["up"], f["embedded"]) for k, f in snap["brokers"].items()} == {
                "mqtt": (True, False), "kafka": (True, False)}
            assert snap["disk"]["ok"] and snap["disk"]["free_gb"] > 0
            assert snap["alerts"] == {"open": 0, "firing": []}

            code, out = _cli(capsys, cfg, "--format", "json")
            shown = json.loads(out)
            assert code == 0 and shown["healthy"] and shown["running"] and set(shown["queries"]) == names
            code, out = _cli(capsys, cfg)
            assert code == 0 and out.startswith(f"iotlake: healthy (role all, pid {os.getpid()},")
            assert "bronze_silver" in out and "delivered 300, pending 0" in out
            r = health.get("/healthz")
            assert r.status_code == 200 and r.json()["healthy"] and set(r.json()["queries"]) == names

            # Idle: no batch for longer than stale_seconds, but Spark's progress events every
            # 10 s keep each query fresh: healthy all along
            ages: dict[str, list[float]] = {n: [] for n in names}
            deadline = time.monotonic() + 45
            while not all(any(b < a for a, b in zip(ages[n], ages[n][1:], strict=False))
                          and snap["queries"][n]["last_batch_age_s"] > 15 for n in names):
                assert time.monotonic() < deadline, ages
                time.sleep(1.0)
                snap = writer.tick()
                assert snap["healthy"], snap["problems"]
                for n in names:
                    ages[n].append(snap["queries"][n]["last_progress_age_s"])

            gold = snap["queries"]["gold_metrics_1m"]["id"]
            spark.streams.get(gold).stop()
            snap = writer.tick()
            assert not snap["healthy"] and snap["problems"] == ["query gold_metrics_1m stopped"]
            assert snap["queries"]["gold_metrics_1m"]["active"] is False
            assert snap["queries"]["gold_metrics_1m"]["stale"] is True
            code, out = _cli(capsys, cfg, "--format", "json")
            assert code == 1 and json.loads(out)["problems"] == ["query gold_metrics_1m stopped"]
            code, out = _cli(capsys, cfg)
            assert code == 1 and out.startswith("iotlake: UNHEALTHY")
            assert "  - query gold_metrics_1m stopped" in out
            r = health.get("/healthz")
            assert r.status_code == 503 and r.json()["problems"] == ["query gold_metrics_1m stopped"]
        finally:
            running.stop()

    # a broker that does not answer (nothing listens on its port)
    port = free_port()
    away = settings.model_copy(deep=True)
    away.kafka.bootstrap = f"127.0.0.1:{port}"
    snap = snapshot(away, "bronze")
    assert snap["brokers"] == {"kafka": {"endpoint": f"127.0.0.1:{port}", "up": False, "embedded": False}}
    assert snap["problems"] == [f"Kafka 127.0.0.1:{port} unreachable"] and not snap["healthy"]


def test_iotlake_run_writes_its_status_and_says_when_it_stops(settings: Settings, capsys,
                                                              tmp_path: Path) -> None:
    """`iotlake run --role bridge` (no JVM) on the session's brokers: its status file from the
    start, deliveries counted, "stopping" at SIGTERM, "not running" once it is old."""
    settings.alerts.rules = [STALE]
    cfg = settings.save(tmp_path / "settings.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "--config", str(cfg),
                                 "run", "--role", "bridge"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (s := read_status(settings, role="bridge"))["healthy"]:
            assert proc.poll() is None and time.monotonic() < deadline, (s, log.read_text()[-3000:])
            time.sleep(0.3)
        assert s["pid"] == proc.pid and s["queries"] == {} and s["bridge"]["running"]
        assert set(s["brokers"]) == {"mqtt", "kafka"}
        publish(settings, generate(settings, 50, devices=5, duplicates=0, malformed=0))
        while read_status(settings, role="bridge")["bridge"]["delivered"] < 50:
            assert proc.poll() is None and time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.3)
        code, out = _cli(capsys, cfg, "--role", "bridge", "--format", "json")
        s = json.loads(out)
        assert code == 0 and s["healthy"] and s["bridge"]["delivered"] == 50 and s["bridge"]["pending"] == 0
        code, out = _cli(capsys, cfg)  # role all: no such process on this data root
        assert code == 1 and f"not running: no status file {status_path(settings)}" in out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    last = json.loads(status_path(settings, "bridge").read_text())
    assert not last["healthy"] and last["problems"][0] == "stopping: shutdown requested"
    time.sleep(0.2)
    code, out = _cli(capsys, cfg, "--role", "bridge", "--max-age", "0.1", "--format", "json")
    s = json.loads(out)
    assert code == 1 and s["running"] is False and s["last_status"] == last
    assert s["problems"][0].startswith(f"not running: the status in {status_path(settings, 'bridge')} is ")


def test_a_missing_or_old_status_is_not_running_and_bad_arguments_exit_2(tmp_path: Path, capsys) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path / "lake"), alerts={"rules": [STALE.model_dump()]})
    cfg = s.save(tmp_path / "settings.json")
    code, out = _cli(capsys, cfg, "--format", "json")
    assert code == 1 and json.loads(out)["problems"] == [
        f"not running: no status file {status_path(s)} (start `iotlake run`)"]
    old = {"time": iso_time(datetime.now(UTC) - timedelta(seconds=60)), "pid": 1, "role": "all",
           "healthy": True, "problems": []}
    write_status(status_path(s), old)
    code, out = _cli(capsys, cfg, "--format", "json")
    got = json.loads(out)
    assert code == 1 and not got["healthy"] and got["last_status"] == old
    assert got["problems"][0].startswith(f"not running: the status in {status_path(s)} is 60 s old (pid 1")
    assert _cli(capsys, cfg, "--max-age", "120")[0] == 0  # young enough for a reader that allows it
    r = TestClient(create_app(s, token="t", check_every=0.0)).get("/healthz?max_age=120")
    assert r.status_code == 200 and r.json() == {"time": old["time"], "role": "all", "running": True,
                                                 "healthy": True}
    for bad in (["--max-age", "0"], ["--max-age", "soon"], ["--format", "yaml"], ["--role", "nope"]):
        with pytest.raises(SystemExit) as e:
            main(["--config", str(cfg), "status", *bad])
        assert e.value.code == 2
    assert "must be > 0 (got 0)" in capsys.readouterr().err


def test_the_judgement_of_a_query_and_the_bridge() -> None:
    """Stale: no progress for stale_seconds, or data waiting and no batch for as long; an idle
    query (no lag, recent progress, old batch) is fine. The bridge: waiting and not delivering."""
    def q(**kw):
        return {"active": True, "error": None, "last_progress_age_s": 3.0, "last_batch_age_s": 500.0,
                "lag": 0, "source": "kafka", "watched_s": 900.0, **kw}

    assert query_problems("a", f := q(), 60, None) == [] and f["stale"] is False
    assert query_problems("a", q(lag=7), 60, None) == [
        "query a: 7 records waiting and no batch for 500 s (stale after 60 s)"]
    assert query_problems("a", q(lag=7, source="delta", last_batch_age_s=None), 60, None) == [
        "query a: 7 table versions waiting and no batch for 900 s (stale after 60 s)"]
    assert query_problems("a", q(last_progress_age_s=61.0), 60, None) == [
        "query a: no progress for 61 s (stale after 60 s)"]
    assert query_problems("a", q(lag=300, last_batch_age_s=1.0), 60, 100) == [
        "query a: 300 records behind Kafka (pipeline_lag above 100)"]
    assert query_problems("a", q(active=False, error="boom"), 60, None) == ["query a stopped: boom"]
    b = {"id": "br", "running": True, "delivering": False, "pending": 4, "last_delivery_age_s": 31.0,
         "disconnected_s": 0.0, "error": None}
    assert bridge_problems(b, 30, "h:1") == [
        "bridge br: 4 messages waiting, nothing delivered to Kafka for 31 s (bridge.delivery_stall_seconds = 30)"]
    assert bridge_problems({**b, "delivering": True, "disconnected_s": 40.0}, 30, "h:1") == [
        "bridge br: not connected to MQTT h:1 for 40 s"]
    assert bridge_problems({**b, "running": False, "error": "KafkaException()"}, 30, "h:1") == [
        "bridge br stopped: KafkaException()"]
