"""Every benchmark's ``--smoke`` mode runs and ends with its JSON line, so benchmarks cannot rot.

Benchmarks of a Spark workload run here, in this process, on the test session's Spark: one warm
JVM instead of one per bench; their ``spark.stop()`` is a no-op here and the session's settings
are restored after each. Benchmarks of processes: ``tests/test_bench_processes.py``; the chaos
bench's smoke run is ``tests/test_chaos.py``; ``bench/nab_scoring.py`` is a library
(``tests/test_anomaly.py``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

REPO = Path(__file__).resolve().parents[1]

#: bench -> keys its last line must have
IN_PROCESS = {
    "batch_overhead": ("silver", "gold_windows", "gold_health"),
    "compaction": ("files_before", "compact", "zorder", "liquid"),
    "delta_log_length": ("append_ms_0", "append_ms_2000", "delta_rs_update_ms_2000"),
    "gold_throughput": ("health_floor_rows_per_s", "windows_floor_rows_per_s"),
    "ingest_throughput": ("live_cores_spark", "live_cores_broker", "live_batch_ms_p50"),
    "silver_dedup": (),
    "silver_throughput": ("rows_per_s_floor", "ratio_to_floor"),
    "silver_throughput --profile sparkplug": ("ratio_to_json", "rows_per_s_json"),
    "window_merge": ("batch_ms_first", "batch_ms_last", "gold_metrics_1m", "gold_metrics_5m"),
}


def check_last_line(bench: str, stdout: str, keys: tuple[str, ...]) -> None:
    line = stdout.strip().splitlines()[-1]
    last = json.loads(line)
    assert isinstance(last, dict) and last, stdout[-2000:]
    missing = [k for k in keys if k not in last]
    assert not missing, f"{bench}: last line lacks {missing}: {line[:500]}"
    print(f"\n{bench} --smoke: {line[:300]}")


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(IN_PROCESS))
def test_spark_bench_smoke(bench: str, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(SparkSession, "stop", lambda self: None)
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as when run as a script: sibling imports
    conf = dict(spark.conf.getAll)
    try:
        module, *args = bench.split()
        importlib.import_module(f"bench.{module}").main(["--smoke", *args])
    finally:
        now = dict(spark.conf.getAll)
        for k in now.keys() - conf.keys():
            spark.conf.unset(k)
        for k, v in conf.items():
            if now.get(k) != v and spark.conf.isModifiable(k):
                spark.conf.set(k, v)
    check_last_line(bench, capsys.readouterr().out, IN_PROCESS[bench])


def test_gold_throughput_cpu_leaves_out_exited_workers() -> None:
    """A Python worker that exits during a run (Spark retires idle ones) is not subtracted
    from the run's CPU; one started during it counts whole."""
    from bench.gold_throughput import cpu_used

    before = {1: ("driver", 1.0), 2: ("jvm", 10.0), 3: ("workers", 30.0)}
    after = {1: ("driver", 1.5), 2: ("jvm", 25.0), 4: ("workers", 2.0)}
    assert cpu_used(before, after) == {"driver": 0.5, "jvm": 15.0, "workers": 2.0}
