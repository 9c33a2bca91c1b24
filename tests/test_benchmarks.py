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
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from pyspark.sql import SparkSession

REPO = Path(__file__).resolve().parents[1]


class Headline(NamedTuple):
    """A bench's headline figures in its last line (dotted keys reach into nested objects):
    ``nonzero`` what was measured and cannot be 0 (a rate, a latency, a CPU time), ``finite``
    what can (a loss, a growth, a score)."""

    nonzero: tuple[str, ...]
    finite: tuple[str, ...] = ()


def _figure(last: dict, key: str) -> Any:
    node: Any = last
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def assert_figures(bench: str, last: dict, keys: Iterable[str], nonzero: Iterable[str] = ()) -> None:
    """Each of ``keys`` (and ``nonzero``) is a finite number in ``last``, and each of
    ``nonzero`` is not 0: a bench that stops measuring (prints null, NaN, 0 rows/s) fails
    the suite, not only one that stops printing the key."""
    nonzero = tuple(nonzero)
    bad = {}
    for key in dict.fromkeys((*keys, *nonzero)):
        v = _figure(last, key)
        if v is KeyError:
            bad[key] = "missing"
        elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            bad[key] = v
        elif key in nonzero and v == 0:
            bad[key] = 0
    assert not bad, f"{bench}: headline figures not measured: {bad}; last line: {json.dumps(last)[:1500]}"


#: bench -> its last line's headline figures
IN_PROCESS = {
    "batch_overhead": Headline(nonzero=tuple(f"{layer}.{k}" for layer in ("silver", "gold_windows", "gold_health")
                                             for k in ("rows_p50", "batch_ms", "cpu_ms_per_batch"))),
    "compaction": Headline(nonzero=("files_before", "before.aggregate", "before.lookup",
                                    *(f"{layout}.{k}" for layout in ("compact", "zorder", "liquid")
                                      for k in ("files_after", "aggregate", "lookup"))),
                           finite=tuple(f"{layout}.optimize_s" for layout in ("compact", "zorder", "liquid"))),
    "delta_append": Headline(nonzero=("partitioned.iotlake_ms_p50", "plain.iotlake_ms_p50", "plain.delta_rs_ms_p50",
                                      "plain.ratio")),
    "delta_log_length": Headline(nonzero=tuple(f"{k}_{n}" for n in (0, 2000)
                                               for k in ("append_ms", "delta_rs_open_ms", "delta_rs_update_ms"))),
    "gold_throughput": Headline(nonzero=("rows_per_s", "rows_per_cpu_s", "windows_rows_per_s",
                                         "health_floor_rows_per_s", "windows_floor_rows_per_s")),
    "ingest_throughput": Headline(nonzero=("rows_per_s_whole", "rows_per_s_steady", "noop_rows_per_s_whole",
                                           "noop_rows_per_s_steady", "ratio", "cpu_us_per_row_steady",
                                           "live_cores_spark", "live_cores_broker", "live_batch_ms_p50")),
    # a smoke run's few batches can leave its CPU ratio without a denominator (None by design)
    "silver_dedup": Headline(nonzero=("state_store_rows_per_s", "index_rows_per_s",
                                      "state_store_last_batches_ms", "index_last_batches_ms")),
    "silver_throughput": Headline(nonzero=("rows_per_s_with_validation", "rows_per_s_without", "overhead_ratio",
                                           "rows_per_s_floor", "ratio_to_floor")),
    "silver_throughput --profile sparkplug": Headline(nonzero=("rows_per_s_with_validation", "rows_per_s_without",
                                                               "rows_per_s_json", "ratio_to_json")),
    "window_merge": Headline(nonzero=("batch_ms_first", "batch_ms_last",
                                      *(f"{t}.{k}" for t in ("gold_metrics_1m", "gold_metrics_5m")
                                        for k in ("rows_written_first", "rows_written_last", "files")))),
}


def check_last_line(bench: str, stdout: str, headline: Headline) -> dict:
    """The bench's last line: a JSON object whose headline figures were measured."""
    line = stdout.strip().splitlines()[-1]
    last = json.loads(line)
    assert isinstance(last, dict) and last, stdout[-2000:]
    assert_figures(bench, last, headline.finite, nonzero=headline.nonzero)
    print(f"\n{bench} --smoke: {line[:300]}")
    return last


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


def test_a_bench_that_stops_measuring_fails() -> None:
    """Null, NaN, a string, a missing key or a 0 rate fail the smoke test; a 0 loss does not."""
    ok = {"rows_per_s": 1200, "lost": 0, "c1": {"wall_s": 3.5}}
    assert_figures("b", ok, ("lost",), nonzero=("rows_per_s", "c1.wall_s"))
    for bad in ({"rows_per_s": None}, {"rows_per_s": float("nan")}, {"rows_per_s": "fast"},
                {"rows_per_s": 0}, {"rows_per_s": True}, {"lost": None}, {"c1": {}}, {"c1": 2}):
        with pytest.raises(AssertionError, match="headline figures not measured"):
            assert_figures("b", {**ok, **bad}, ("lost",), nonzero=("rows_per_s", "c1.wall_s"))


def test_gold_throughput_cpu_leaves_out_exited_workers() -> None:
    """A Python worker that exits during a run (Spark retires idle ones) is not subtracted
    from the run's CPU; one started during it counts whole."""
    from bench.gold_throughput import cpu_used

    before = {1: ("driver", 1.0), 2: ("jvm", 10.0), 3: ("workers", 30.0)}
    after = {1: ("driver", 1.5), 2: ("jvm", 25.0), 4: ("workers", 2.0)}
    assert cpu_used(before, after) == {"driver": 0.5, "jvm": 15.0, "workers": 2.0}
