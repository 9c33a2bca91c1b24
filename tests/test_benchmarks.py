"""Every benchmark's ``--smoke`` mode runs and ends with its JSON line, so benchmarks cannot rot.

Each runs as its own process, as a user runs it (``python bench/<name>.py --smoke``). The chaos
bench's smoke run is ``tests/test_chaos.py``'s; ``bench/nab_scoring.py`` is a library
(``tests/test_anomaly.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: bench -> keys its last line must have
BENCHES = {
    "anomaly_quality": ("score", "baseline_score", "readings_per_s"),
    "batch_overhead": ("silver", "gold_windows", "gold_health"),
    "bridge_throughput": (),
    "compaction": ("files_before", "compact", "zorder", "liquid"),
    "e2e_latency": (),
    "gold_throughput": (),
    "ingest_throughput": (),
    "jvm_startup": (),
    "query_latency": (),
    "scaling": ("messages", "local1_p4_rows_per_s", "cluster_1w_p4_rows_per_s"),
    "silver_dedup": (),
    "silver_throughput": (),
}


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_smoke(bench: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{bench}.py"), "--smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last, proc.stdout[-2000:]
    missing = [k for k in BENCHES[bench] if k not in last]
    assert not missing, f"{bench}: last line lacks {missing}: {proc.stdout.strip().splitlines()[-1][:500]}"
    print(f"\n{bench} --smoke: {proc.stdout.strip().splitlines()[-1][:300]}")
