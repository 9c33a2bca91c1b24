"""Benchmark: an analyst query on a silver-like table before and after ``iotlake compact``.

Streaming leaves one small file per micro-batch; this builds 500 such commits (200 rows each,
1000 devices, 24 h of event_time), times a 24-hour per-device aggregate (DuckDB over the delta-rs
dataset, table open included, median of N runs), compacts, and times it again. Results must be
identical. Last line: one JSON object.

    .venv/bin/python bench/compaction.py [--commits 500] [--rows 200] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from lakehouse.delta_io import utc_arrow_schema
from lakehouse.maintenance import compact
from lakehouse.settings import load_settings
from lakehouse.tables import SILVER

T0 = datetime(2024, 5, 1, tzinfo=UTC)
QUERY = """
SELECT device_id, count(*) AS n, avg(temperature) AS t_avg, min(temperature) AS t_min,
       max(temperature) AS t_max, avg(humidity) AS h_avg, min(battery) AS b_min
FROM silver
WHERE event_time >= $start AND event_time < $end
GROUP BY device_id ORDER BY device_id
"""


def batch(i: int, rows: int, devices: int, rng: random.Random) -> pa.Table:
    """One micro-batch: arrival order ~ event time, like a live stream."""
    base = i * rows
    times = [T0 + timedelta(seconds=(base + k) * 86_400 / (rows * 500) + rng.random())
             for k in range(rows)]
    return pa.table({
        "event_id": [f"e{base + k:09d}" for k in range(rows)],
        "device_id": [f"dev-{rng.randrange(devices):05d}" for _ in range(rows)],
        "event_time": times,
        "temperature": [rng.gauss(21, 3) for _ in range(rows)],
        "humidity": [rng.uniform(20, 80) for _ in range(rows)],
        "battery": [rng.uniform(5, 100) for _ in range(rows)],
        "status": ["ok"] * rows,
        "schema_version": [1] * rows,
        "extra": [None] * rows,
        "kafka_partition": [k % 4 for k in range(rows)],
        "kafka_offset": list(range(base, base + rows)),
        "ingest_time": times,
    }, schema=SILVER).cast(utc_arrow_schema(SILVER))


def analyst_query(path: str) -> tuple[float, list[tuple]]:
    start = time.perf_counter()
    silver = DeltaTable(path).to_pyarrow_dataset()  # noqa: F841 (DuckDB scans it by name)
    con = duckdb.connect()
    con.execute("SET threads = 2")
    rows = con.execute(QUERY, {"start": T0, "end": T0 + timedelta(hours=24)}).fetchall()
    return time.perf_counter() - start, rows


def timed(path: str, runs: int) -> tuple[float, list[tuple]]:
    results = [analyst_query(path) for _ in range(runs)]
    return statistics.median(t for t, _ in results), results[0][1]


def _same(a: list[tuple], b: list[tuple]) -> bool:
    """Float sums depend on scan order (Z-order reorders rows): compare with a tolerance."""
    return len(a) == len(b) and all(
        x == y or (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-12))
        for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=500)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="iotlake-bench-"))
    try:
        settings = load_settings(environ={}, data_root=str(root))
        path = settings.table_path("silver")
        rng = random.Random(7)
        t = time.perf_counter()
        for i in range(args.commits):
            write_deltalake(path, batch(i, args.rows, args.devices, rng), mode="append")
        print(f"built {args.commits} commits in {time.perf_counter() - t:.1f}s")

        q_before, res_before = timed(path, args.runs)
        t = time.perf_counter()
        [stats] = compact(settings, ["silver"])
        print(f"compact: {stats} in {time.perf_counter() - t:.1f}s")
        q_after, res_after = timed(path, args.runs)
        assert _same(res_after, res_before), "compaction changed query results"
        assert sum(r[1] for r in res_after) == args.commits * args.rows
        print(json.dumps({
            "files_before": stats["files_before"], "files_after": stats["files_after"],
            "query_s_before": round(q_before, 4), "query_s_after": round(q_after, 4),
            "speedup": round(q_before / q_after, 1),
        }))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
