"""`make run` twice: Ctrl-C stops `iotlake run` cleanly, the embedded Kafka keeps what the bridge
delivered on disk, and a second run on the same data root resumes bronze where it stopped; Ctrl-C
twice stops it without waiting for the running batches, and loses nothing either."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from deltalake import DeltaTable
from fleets import SENSOR
from procs import stop_now

from lakehouse.delta.read import row_count
from lakehouse.settings import load_settings
from orchestration.services import free_port


def _rows(path: str) -> int:
    return row_count(path)


def _run_until(cmd: list[str], env: dict[str, str], log: Path, bronze: str, rows: int,
               twice: bool = False) -> str:
    """Start ``iotlake run``, wait for ``rows`` bronze rows, Ctrl-C it (``twice``: again a second
    later, not waiting for the running batches); its log."""
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while _rows(bronze) < rows:
            assert p.poll() is None, f"iotlake run exited {p.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {rows} bronze rows:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        if twice:
            stop_now(p, 240)  # Ctrl-C, and again a second later
        else:
            p.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert p.wait(240) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    return log.read_text()


def _delivered(log: str) -> int:
    m = re.search(r"bridge \S+ stopped: \{.*'delivered': (\d+)", log)
    assert m, log[-3000:]
    return int(m.group(1))


def _offsets(path: str) -> dict[int, list[int]]:
    t = DeltaTable(path).to_pyarrow_table(columns=["partition", "offset"]).to_pydict()
    out: dict[int, list[int]] = {}
    for p, o in zip(t["partition"], t["offset"], strict=True):
        out.setdefault(p, []).append(o)
    return {p: sorted(v) for p, v in out.items()}


def test_ctrl_c_stops_cleanly_and_a_second_run_resumes_from_the_durable_kafka(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    config = tmp_path / "iotlake.json"
    kafka_port = free_port(pair=True)
    config.write_text(json.dumps({
        "data_root": str(root), "telemetry": SENSOR.model_dump(mode="json"),
        "kafka": {"embedded_port": kafka_port}, "mqtt": {"embedded_port": free_port()},
        "spark": {"master": "local[2]", "shuffle_partitions": 2},
        # the default 30 s for the running batches to finish can be short with another test's
        # Spark beside this one on two cores
        "stream": {"trigger_seconds": 2.0, "graceful_stop_seconds": 180},
        "observability": {"metrics_port": 0}}))
    lake = load_settings(config, environ={})
    bronze = lake.table_path("bronze")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    env["IOTLAKE_CONFIG"] = str(config)
    # a light load: less backlog for the queries to finish at Ctrl-C
    cmd = [sys.executable, "-m", "orchestration.cli", "run", "--simulate", "100", "--devices", "10"]

    first = _run_until(cmd, env, tmp_path / "run1.log", bronze, 300)
    assert "signal SIGINT: shutting down" in first
    assert "SPARK_JOB_CANCELLED" not in first  # queries stopped between batches, not killed
    assert "mid-batch" not in first
    n1 = _delivered(first)
    assert 300 <= _rows(bronze) <= n1  # the rest waits in Kafka, on disk

    second = _run_until(cmd, env, tmp_path / "run2.log", bronze, n1 + 300, twice=True)
    assert "signal SIGINT again: stopping now" in second
    n2 = _delivered(second)
    # The broker kept every record across both runs: its end offsets are what the bridges
    # delivered, and bronze read each offset from 0 at most once, without gaps.
    from chaos_harness import kafka_end_offsets

    from orchestration.services import kafka_service

    broker = kafka_service(lake).start()
    try:
        ends = kafka_end_offsets(lake)
    finally:
        broker.stop()
    assert sum(ends.values()) == n1 + n2
    got = _offsets(bronze)
    assert sum(map(len, got.values())) == _rows(bronze) >= n1 + 300
    for p, offsets in got.items():
        assert offsets == list(range(len(offsets))) and len(offsets) <= ends[p], p
