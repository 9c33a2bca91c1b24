"""Scale-out by configuration only: a standalone Spark cluster, one process per role, S3 storage.

Pipelines run in child processes (the test session may already own a local SparkSession).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from confluent_kafka import Producer
from deltalake import DeltaTable

from ingest.simulator import generate
from lakehouse.cluster import StandaloneCluster, cluster_conf
from lakehouse.kafka_config import client_config
from lakehouse.settings import Settings

START = "2026-05-01T00:00:00Z"
CLI = [sys.executable, "-m", "lakehouse.cli"]
#: Columns that differ between two runs of the same data: arrival time and Kafka coordinates.
RUN_SPECIFIC = {"ingest_time", "quarantined_at", "kafka_topic", "kafka_partition", "kafka_offset"}


def _variant(settings: Settings, tmp_path: Path, name: str, **spark) -> Settings:
    """The test's settings with its own data root, Kafka topics and MQTT topics."""
    s = settings.model_copy(deep=True)
    s.data_root = str(tmp_path / name)
    s.kafka.topic = f"{settings.kafka.topic}-{name}"
    s.kafka.dead_letter_topic = f"{settings.kafka.dead_letter_topic}-{name}"
    s.mqtt.client_id = f"{settings.mqtt.client_id}-{name}"
    s.mqtt.topic_filter = f"{name}/{settings.mqtt.topic_filter}"
    s.spark.driver_memory = "768m"
    for k, v in spark.items():
        setattr(s.spark, k, v)
    return s


def _table(s: Settings, name: str, sort: list[str]) -> pd.DataFrame:
    df = DeltaTable(s.table_path(name)).to_pandas()
    df = df.drop(columns=[c for c in df.columns if c in RUN_SPECIFIC])
    return df.sort_values(sort, kind="stable").reset_index(drop=True)


def _demo(s: Settings, tmp_path: Path, name: str) -> dict:
    cfg = s.save(tmp_path / f"{name}.json")
    with open(tmp_path / f"{name}.log", "w") as err:
        proc = subprocess.run(
            [*CLI, "--config", str(cfg), "demo", "--events", "600", "--devices", "6",
             "--duplicates", "15", "--malformed", "6", "--start", START, "--seed", "3",
             "--timeout", "400"],
            stdout=subprocess.PIPE, stderr=err, text=True, timeout=600)
    tail = (tmp_path / f"{name}.log").read_text()[-3000:]
    assert proc.returncode == 0, f"{name} demo failed ({proc.returncode}):\n{tail}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_standalone_cluster_matches_local(settings: Settings, tmp_path: Path) -> None:
    """The same demo on local[2] and on 1 master + 2 one-core workers: identical tables."""
    local = _variant(settings, tmp_path, "local", master="local[2]")
    local_result = _demo(local, tmp_path, "local")
    with StandaloneCluster(workers=2, cores=1, memory="1g", work_dir=tmp_path / "cluster") as c:
        remote = _variant(settings, tmp_path, "cluster", master=c.master_url,
                          conf=cluster_conf("512m", cores_max=2))
        remote_result = _demo(remote, tmp_path, "cluster")
        executor_logs = sorted((tmp_path / "cluster").glob("worker-*/app-*/*/stderr"))
    for r in (local_result, remote_result):
        assert r["ok"] and r["published"] == r["bronze_rows"] == 600
        assert r["duplicates_dropped"] == 15 and r["quarantine_rows"] == 6
    assert {k: v for k, v in local_result.items() if k != "seconds"} == \
        {k: v for k, v in remote_result.items() if k != "seconds"}
    # both workers ran tasks, importing iotlake from the shipped zip (not the source tree)
    ran = {p.parts[-4] for p in executor_logs if "Finished task" in p.read_text(errors="replace")}
    assert ran == {"worker-0", "worker-1"}, executor_logs

    pd.testing.assert_frame_equal(_table(local, "silver", ["event_id"]),
                                  _table(remote, "silver", ["event_id"]), check_exact=True)
    pd.testing.assert_frame_equal(_table(local, "quarantine", ["value"]),
                                  _table(remote, "quarantine", ["value"]), check_exact=True)
    keys = ["device_id", "metric", "window_start"]
    a, b = _table(local, "gold_metrics_1m", keys), _table(remote, "gold_metrics_1m", keys)
    exact = [c for c in a.columns if c not in ("mean", "stddev")]
    pd.testing.assert_frame_equal(a[exact], b[exact], check_exact=True)
    # mean / stddev: Spark sums in arrival order, and batch boundaries differ between runs
    pd.testing.assert_frame_equal(a[["mean", "stddev"]], b[["mean", "stddev"]], rtol=1e-12)


# ---- one process per role --------------------------------------------------------------

def _produce(s: Settings, messages) -> None:
    p = Producer(client_config(s, **{"linger.ms": 5}))
    for m in messages:
        p.produce(s.kafka.topic, key=m.topic.split("/")[-2].encode(), value=m.payload)
    p.flush(30)


def _count(s: Settings, table: str) -> int:
    p = s.table_path(table)
    return DeltaTable(p).to_pyarrow_dataset().count_rows() if Path(p, "_delta_log").is_dir() else 0


def _wait(pred, timeout: float, what: str, procs: dict) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for role, (p, log_file) in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"role {role} exited {p.returncode}:\n{log_file.read_text()[-3000:]}")
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_roles_in_separate_processes_survive_kill_9(settings: Settings, tmp_path: Path) -> None:
    """bronze, silver and gold as three processes; silver and gold are killed -9 and restarted."""
    from test_pipeline import assert_gold_matches

    s = _variant(settings, tmp_path, "roles", master="local[1]", shuffle_partitions=2)
    cfg = s.save(tmp_path / "roles.json")
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(role: str) -> None:
        log_file = tmp_path / f"role-{role}.log"
        with open(log_file, "a") as out:
            procs[role] = (subprocess.Popen([*CLI, "--config", str(cfg), "run", "--role", role],
                                            stdout=out, stderr=subprocess.STDOUT), log_file)

    def kill9(role: str) -> None:
        p, _ = procs.pop(role)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    msgs = generate(s, 900, devices=6, duplicates=20, malformed=10, seed=11,
                    start=pd.Timestamp(START).to_pydatetime())

    def expect(n: int) -> tuple[int, int]:
        """(silver, quarantine) rows for the first n messages."""
        head = msgs[:n]
        return (len({m.event_id for m in head if m.kind in ("valid", "late", "duplicate")}),
                sum(m.kind == "malformed" for m in head))

    def layer_done(n: int) -> bool:
        return _count(s, "bronze") == n and (_count(s, "silver"), _count(s, "quarantine")) == expect(n)

    # Roles start one after another: on a loaded machine, three JVMs starting at once can miss
    # Spark's fixed 10 s for a Python worker to connect back.
    try:
        start("bronze")
        _produce(s, msgs[:300])
        _wait(lambda: _count(s, "bronze") == 300, 240, "bronze 300", procs)
        start("silver")
        _wait(lambda: _count(s, "silver") + _count(s, "quarantine") > 0, 240, "silver rows", procs)
        kill9("silver")  # mid-stream: a batch may be half committed
        _produce(s, msgs[300:600])
        _wait(lambda: _count(s, "bronze") == 600, 120, "bronze 600 while silver is down", procs)
        start("silver")
        _wait(lambda: layer_done(600), 240, "silver to catch up after kill -9", procs)
        start("gold")
        _wait(lambda: _count(s, "gold_metrics_1m") > 0, 240, "gold rows", procs)
        kill9("gold")
        _produce(s, msgs[600:])
        _wait(lambda: layer_done(900), 240, "silver 900", procs)
        start("gold")
        from test_pipeline import expected_windows

        n_windows = len(expected_windows(msgs))
        _wait(lambda: _count(s, "gold_metrics_1m") == n_windows, 240, "gold to catch up", procs)
        time.sleep(3)  # a duplicate write would show up now
    finally:
        for role in list(procs):
            p, _ = procs.pop(role)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    bronze = DeltaTable(s.table_path("bronze")).to_pandas()
    assert len(bronze) == 900 and not bronze.duplicated(["partition", "offset"]).any()
    silver = DeltaTable(s.table_path("silver")).to_pandas()
    assert len(silver) == 900 - 30 and silver["event_id"].is_unique
    assert _count(s, "quarantine") == 10
    assert_gold_matches(s, msgs)
    devices = DeltaTable(s.table_path("device_current")).to_pandas()
    assert sorted(devices["device_id"]) == [f"dev-{i:05d}" for i in range(1, 7)]


def test_kafka_split_records_is_wired(settings: Settings) -> None:
    """stream.kafka_split_records reaches the Kafka source: N records -> ceil(N/split) ranges."""
    from lakehouse.kafka_source import KafkaStreamReader

    s = settings.model_copy(deep=True)
    s.stream.kafka_split_records = 100
    opts = _kafka_options(s)
    assert opts["split_records"] == "100"
    parts = KafkaStreamReader(opts).partitions({"0": 0, "1": 0}, {"0": 250, "1": 100})
    for kp, n, end in ((0, 3, 250), (1, 1, 100)):
        r = [(p.start, p.end) for p in parts if p.partition == kp]
        assert len(r) == n and r[0][0] == 0 and r[-1][1] == end  # contiguous, all covered
        assert all(a[1] == b[0] for a, b in zip(r, r[1:], strict=False)) and max(e - b for b, e in r) <= 100


def _kafka_options(s: Settings) -> dict[str, str]:
    """The options bronze.stream passes to iotlake_kafka (captured by a stand-in reader)."""
    import bronze.stream

    captured: dict[str, str] = {}

    class Reader:
        def format(self, _):
            return self

        def option(self, k, v):
            captured[k] = v
            return self

        def load(self):
            return None

    class FakeSpark:
        readStream = Reader()

    bronze.stream.kafka_stream(FakeSpark(), s)
    return captured
