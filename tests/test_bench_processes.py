"""Benchmarks that measure processes run their ``--smoke`` mode as a user runs them
(``python bench/<name>.py --smoke``): JVM start-up, ``iotlake run`` end to end and as a soak, the bridge
against ``mosquitto_sub | kcat``, scaling; and the two that need no Spark. Spark workloads:
``tests/test_benchmarks.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_benchmarks import Headline, check_last_line

REPO = Path(__file__).resolve().parents[1]

#: bench -> its last line's headline figures
SUBPROCESS = {
    "alert_latency": Headline(nonzero=("rate", "threshold_p50_s", "threshold_p99_s", "notifications_per_incident",
                                       "incidents"),
                              finite=("silence_extra_s", "lost", "duplicated", "status_changes_per_device_hour")),
    "anomaly_live": Headline(nonzero=("devices", "hours", "faults", "healthy_devices"),
                             finite=("false_per_device_day", *(f"recall.{k}" for k in
                                                                ("spike", "level_shift", "stuck", "drift", "dropout")))),
    "anomaly_quality": Headline(nonzero=("state_bytes_per_key", "readings_per_s", "kernel_rows_per_s_10k_keys"),
                                finite=("score", "score_direct", "score_nested_loco",
                                        "baseline_score", "ratio", "parameters")),
    "bridge_throughput": Headline(nonzero=("bridge_msgs_per_s", "baseline_msgs_per_s", "bridge_mqtt311_msgs_per_s",
                                           "ratio", "bridge_p50_ms", "bridge_p99_ms", "baseline_p50_ms",
                                           "baseline_p99_ms", "kafka_floor_p50_ms", "kafka_floor_p99_ms",
                                           "secure_msgs_per_s", "secure_ratio", "provision_10k_s"),
                                  finite=("lost", "baseline_lost")),
    "dedup_index": Headline(nonzero=("keys", "bytes_per_key", "cpu_ms_per_batch", "rss_mb"),
                            finite=("rss_growth_mb_after_full",)),
    "e2e_latency": Headline(nonzero=("cores_50", "achieved_50", "silver_p50_s_50", "silver_p99_s_50",
                                     "current_p50_s_50", "current_p99_s_50")),
    "jvm_startup": Headline(nonzero=("c1.wall_s", "c1.cpu_s")),
    "query_latency": Headline(nonzero=("dashboard_p95_ms", "query_p95_s", "api_fleet.p95_ms"),
                              finite=("api_fleet_memo_hit_p95_ms",)),
    "soak": Headline(nonzero=("minutes", "rate", "files_max", "latency_p99_drift", "dashboard_p95_ms_max",
                              "query_p95_ms_max", "probes"),
                     finite=("rss_growth_pct_per_h_max", "disk_growth_pct_last_20min", "lost")),
    "scaling": Headline(nonzero=("messages", "local1_p4_rows_per_s.bronze", "local1_p4_rows_per_s.silver",
                                 "local1_p4_rows_per_s.bronze_silver", "driver_cpu_s_per_m", "executor_cpu_s_per_m",
                                 "predicted_speedup_8", "predicted_speedup_32")),
}


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(SUBPROCESS))
def test_bench_smoke(bench: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{bench}.py"), "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    last = check_last_line(bench, proc.stdout, SUBPROCESS[bench])
    if bench == "alert_latency":  # every incident notified once
        assert (last["lost"], last["duplicated"], last["notifications_per_incident"]) == (0, 0, 1.0), last
    if bench == "anomaly_live":  # the ground truth holds faults of every kind, each over in time
        assert all(n >= 1 for n in last["faults_by_kind"].values()), last
        assert set(last["faults_by_kind"]) == set(last["recall"]), last
    if bench == "soak":  # sampled the whole run, every probe reached silver, upkeep kept files down
        assert last["samples"] >= 4 and last["lost"] == 0 and last["probes"] > 0, last
        assert 0 < last["files_max"] <= 200, last


def test_every_bench_has_a_smoke_run() -> None:
    """A new script in bench/ cannot be left out of the smoke runs (libraries excepted)."""
    from test_benchmarks import IN_PROCESS

    libraries = {"anomaly_candidates", "chaos_harness", "fleets", "nab_scoring", "procs", "spark_cpu"}
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")} - libraries
    smoked = {b.split()[0] for b in IN_PROCESS} | set(SUBPROCESS) | {"chaos"}  # chaos: test_chaos.py
    assert scripts == smoked
