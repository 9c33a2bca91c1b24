"""Shared fixtures: real brokers on loopback (own ports) and one Spark session per test run."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The chaos harness and the benchmarks live in bench/ (scripts, not a package): tests import
# them as their scripts do, by sibling name.
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))

from fleets import SENSOR  # noqa: E402

from lakehouse.settings import Settings, load_settings  # noqa: E402
from orchestration.services import embedded_services  # noqa: E402

# Every JVM the suite starts (its Spark session, the CLI and role processes, Airflow's tasks, the
# standalone cluster) lives seconds to minutes: C1 alone compiles enough, and C2's compiler
# threads cost ~30% of a short Spark run's CPU on 2 cores (bench/jvm_startup.py). C1-only makes
# the JVM reserve 48 MB for compiled code, which a Spark process filled within a minute of Delta
# work ("CodeCache is full. Compiler has been disabled": interpreted from then on): 240 MB, the
# tiered default.
C1_ONLY = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
os.environ.setdefault("JAVA_TOOL_OPTIONS", C1_ONLY)
# For the same reason their Spark sessions interpret expressions, the batch processes' too (CLI
# backfills, Airflow's tasks): compiling them pays only over large batches, and the tests' are
# small (measured: docs/history/benchmarks.md).
os.environ.setdefault("IOTLAKE_SPARK__EXPRESSION_CODEGEN", "off")

_main = sys.modules["__main__"]
if getattr(_main, "__spec__", None) is None and not hasattr(_main, "__file__"):
    # pytest-xdist workers run under execnet, whose bare __main__ makes pyspark.sql.connect take
    # the process for a doctest run and sys.exit(0) when imported (Great Expectations imports it).
    _main.__file__ = "<pytest-xdist worker>"

# The reliability (chaos, fuzz, security) and scale-out (cluster, S3) suites run in their short
# versions by default; `IOTLAKE_EXTENDED_TESTS=1 make test` runs the long ones (test_scaleout*.py
# say what they add; the long chaos run is bench/chaos.py).

# Test ports differ from `make run`'s defaults so tests and a running demo can coexist. Under
# pytest-xdist (`make test` runs two workers) each worker has its own brokers, 100 ports apart.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
TEST_KAFKA_PORT = int(os.environ.get("IOTLAKE_TEST_KAFKA_PORT", "29092")) + 100 * _WORKER
TEST_MQTT_PORT = int(os.environ.get("IOTLAKE_TEST_MQTT_PORT", "21883")) + 100 * _WORKER
#: The tests' own MQTT clients log in as this user, which may read and write everything (the
#: session broker, and every broker a test starts with the ``settings`` fixture's, gives it that:
#: lakehouse.mqtt.auth); devices' credentials are tests/test_device_auth.py's.
TEST_MQTT_LOGIN = {"username": "iotlake-tests", "password": secrets.token_urlsafe(16)}


@pytest.fixture(scope="session")
def base_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="iotlake-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def services_settings(base_dir: Path) -> Settings:
    """Settings pointing at the session's embedded brokers (data root is per test)."""
    return load_settings(
        environ={},
        data_root=str(base_dir / "services"),
        kafka={"embedded_port": TEST_KAFKA_PORT},
        mqtt={"embedded_port": TEST_MQTT_PORT, **TEST_MQTT_LOGIN},
    )


@pytest.fixture(scope="session")
def brokers(services_settings: Settings):
    """Apache Kafka + Mosquitto, started once for the whole test session."""
    with embedded_services(services_settings) as started:
        yield started


_topic_seq = iter(range(1, 1_000_000))


@pytest.fixture
def settings(brokers, services_settings: Settings, tmp_path: Path) -> Settings:
    """Per-test settings: own data root and own Kafka topics on the shared brokers; the example
    sensor fleet (the simulator's)."""
    n = next(_topic_seq)
    s = load_settings(
        environ={},
        data_root=str(tmp_path / "lake"),
        telemetry=SENSOR.model_dump(mode="json"),
        kafka={
            "bootstrap": services_settings.kafka_bootstrap,
            "topic": f"telemetry-{n}",
            "dead_letter_topic": f"telemetry-dlq-{n}",
            "partitions": 2,
        },
        mqtt={"host": "127.0.0.1", "port": TEST_MQTT_PORT, "client_id": f"iotlake-bridge-{n}",
              "topic_filter": f"t{n}/devices/+/telemetry", **TEST_MQTT_LOGIN},
        # gold at the streams' interval (not its 3-s default): tests wait for gold's batches
        stream={"trigger_seconds": 0.5, "gold_trigger_seconds": -1, "windows_trigger_seconds": -1},
        observability={"metrics_port": 0},
        spark={"master": "local[2]", "shuffle_partitions": 2},
    )
    from lakehouse.kafka.topics import ensure_topics

    ensure_topics(s)
    return s


@pytest.fixture(scope="session")
def spark(base_dir: Path):
    from lakehouse.spark import codegen_factory_mode, spark_session

    s = load_settings(environ={}, data_root=str(base_dir / "spark"),
                      spark={"master": "local[2]", "shuffle_partitions": 2})
    # This JVM lives for the whole worker, running thousands of Delta commits: C2 pays off here
    # (a MERGE took ~25% less time than C1-only), unlike the suite's short-lived JVMs.
    tool = os.environ.get("JAVA_TOOL_OPTIONS")
    if tool == C1_ONLY:
        del os.environ["JAVA_TOOL_OPTIONS"]
    try:
        session = spark_session(s, app_name="iotlake-tests")
    finally:
        if tool is not None:
            os.environ["JAVA_TOOL_OPTIONS"] = tool
    # interpreted, as a streams process, even if a test's batch command (a compaction, a
    # backfill) started this process's session before any test asked for this fixture
    session.conf.set("spark.sql.codegen.factoryMode", codegen_factory_mode(s, batch=False))
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _no_stream_left_running(request: pytest.FixtureRequest):
    """A streaming query a test leaves on the worker's shared session would run, and take CPU,
    through every later test of that worker."""
    yield
    if "spark" not in request.fixturenames:
        return
    active = request.getfixturevalue("spark").streams.active
    for q in active:
        q.stop()
    assert not active, f"left running: {[q.name for q in active]}"


#: free space the suite needs in the temp dir: its tables, checkpoints, broker logs and bench runs
#: peak at ~0.5 GB; below this, tests fail by the hundred with ENOSPC instead of once, here
MIN_FREE_GB = 2.0


def pytest_sessionstart(session) -> None:
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    if free < MIN_FREE_GB:
        pytest.exit(f"only {free:.1f} GB free in {tempfile.gettempdir()}; the suite needs "
                    f"{MIN_FREE_GB:.0f} GB. Free some (e.g. `.venv/bin/uv cache prune`, old "
                    f"/tmp/pytest-of-*), or point TMPDIR at a larger disk.", returncode=3)


# Longest files first (worker-seconds on the 2-core machine, docs/history/benchmarks.md): with
# two xdist workers taking whole files, a long file started last would leave one worker idle
# while the other finishes it. `make test` passes --no-loadscope-reorder: xdist would otherwise
# order files by their number of tests.
_LONG_FILES = ("test_bench_processes.py", "test_chaos.py", "test_benchmarks.py", "test_alerts_pipeline.py", "test_gold.py",
               "test_scaleout.py", "test_fleet.py", "test_bridge.py", "test_pipeline.py",
               "test_dags.py", "test_sparkplug.py", "test_device_auth.py",
               "test_scaleout_s3.py", "test_quickstart.py",
               "test_maintenance.py", "test_backfill.py", "test_run_restart.py", "test_status.py",
               "test_kafka_security.py",
               "test_silver.py", "test_fuzz.py", "test_kafka_broker.py", "test_expectations.py",
               "test_security.py", "test_query.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    def weight(item) -> int:
        name = item.path.name
        return _LONG_FILES.index(name) if name in _LONG_FILES else len(_LONG_FILES)

    items.sort(key=weight)  # stable: order within a file is kept


class _TreeCpu:
    """CPU seconds of this worker and every process it started, sampled each second from /proc.

    A pid seen once under the worker keeps counting after its parent dies (an orphaned JVM is
    reparented to init); a process loses at most its last second."""

    def __init__(self) -> None:
        import threading

        self.last: dict[int, float] = {}
        self.total = 0.0
        self.lock = threading.Lock()
        self.sample(baseline=True)
        threading.Thread(target=self._loop, daemon=True, name="tree-cpu").start()

    def _loop(self) -> None:
        import time

        while True:
            time.sleep(1.0)
            self.sample()

    def sample(self, baseline: bool = False) -> float:
        from procs import processes

        stats = {pid: (ppid, cpu) for pid, (ppid, _, cpu, _) in processes().items()}
        with self.lock:
            ours = set(self.last) | {os.getpid()}
            grew = True
            while grew:
                kids = {pid for pid, (ppid, _) in stats.items() if ppid in ours} - ours
                ours |= kids
                grew = bool(kids)
            for pid in ours:
                if pid in stats:
                    cpu = stats[pid][1]
                    if not baseline:  # a new pid counts from 0: it started since the last sample
                        self.total += max(0.0, cpu - self.last.get(pid, 0.0))
                    self.last[pid] = cpu
            for pid in set(self.last) - set(stats):
                del self.last[pid]  # gone: its last second is lost
            return self.total


_tree_cpu: _TreeCpu | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``IOTLAKE_TEST_CPU_LOG=file`` appends each test's wall and CPU seconds (its worker and
    every process it started: the shared Spark JVM, CLI processes, brokers) to ``file``: where the
    suite's CPU goes, per test, on cores that are always busy."""
    log = os.environ.get("IOTLAKE_TEST_CPU_LOG")
    if not log:
        yield
        return
    import time

    global _tree_cpu
    _tree_cpu = _tree_cpu or _TreeCpu()
    t0, c0 = time.monotonic(), _tree_cpu.sample()
    yield
    wall, cpu = time.monotonic() - t0, _tree_cpu.sample() - c0
    with open(log, "a") as f:
        f.write(f"{item.nodeid}\t{wall:.1f}\t{cpu:.1f}\n")
