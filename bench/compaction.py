"""Benchmark: analyst queries on a silver-like table before and after compaction, by layout.

Streaming leaves one small file per micro-batch; this builds that many commits (1000 devices,
24 h of event_time), copies the table three times and lays each copy out with delta-spark:
OPTIMIZE bin-packing, OPTIMIZE ZORDER BY (device_id, event_time) (``iotlake compact``), and
liquid clustering (CLUSTER BY the same columns, then OPTIMIZE). It times a 24-hour per-device
aggregate and a one-device, one-hour lookup through delta-rs + DuckDB (what the dashboard and
``iotlake query`` do: the readers the layout is for; table open included, median of N runs).
Results must be identical in every layout, and delta-rs must read each. Last line: one JSON
object.

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
from fleets import SENSOR

from lakehouse.delta.tables import ensure_table
from lakehouse.settings import load_settings
from lakehouse.tables import silver_schema
from orchestration.maintenance import compact, session

T0 = datetime(2024, 5, 1, tzinfo=UTC)
QUERY = """
SELECT device_id, count(*) AS n, avg(temperature) AS t_avg, min(temperature) AS t_min,
       max(temperature) AS t_max, avg(humidity) AS h_avg, min(battery) AS b_min
FROM silver
WHERE event_time >= $start AND event_time < $end
GROUP BY device_id ORDER BY device_id
"""
LOOKUP = """
SELECT event_time, temperature FROM silver
WHERE device_id = 'dev-00042' AND event_time >= $start AND event_time < $end ORDER BY event_time
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
    }, schema=silver_schema(SENSOR))


def run_query(path: str, sql: str, hours: int) -> tuple[float, list[tuple]]:
    start = time.perf_counter()
    silver = DeltaTable(path).to_pyarrow_dataset()  # noqa: F841 (DuckDB scans it by name)
    con = duckdb.connect()
    con.execute("SET threads = 2")
    rows = con.execute(sql, {"start": T0 + timedelta(hours=12),
                             "end": T0 + timedelta(hours=12 + hours)}).fetchall() \
        if hours < 24 else con.execute(sql, {"start": T0, "end": T0 + timedelta(hours=24)}).fetchall()
    return time.perf_counter() - start, rows


def timed(path: str, runs: int) -> dict[str, tuple[float, list[tuple]]]:
    out = {}
    for name, sql, hours in (("aggregate", QUERY, 24), ("lookup", LOOKUP, 1)):
        results = [run_query(path, sql, hours) for _ in range(runs)]
        out[name] = (statistics.median(t for t, _ in results), results[0][1])
    return out


def liquid(spark, path: str, target_size: int) -> dict:
    """CLUSTER BY on the existing table, then OPTIMIZE (clusters every file)."""
    q = "delta.`" + path + "`"
    spark.conf.set("spark.databricks.delta.optimize.maxFileSize", str(target_size))
    spark.sql(f"ALTER TABLE {q} CLUSTER BY (device_id, event_time)")
    m = spark.sql(f"OPTIMIZE {q}").collect()[0]["metrics"]
    spark.conf.unset("spark.databricks.delta.optimize.maxFileSize")
    dt = DeltaTable(path)
    return {"files_removed": m["numFilesRemoved"], "files_after": len(dt.file_uris()),
            "protocol": [dt.protocol().min_reader_version, dt.protocol().min_writer_version,
                         sorted(dt.protocol().writer_features or [])]}


def _same(a: list[tuple], b: list[tuple]) -> bool:
    """Float sums depend on scan order (Z-order reorders rows): compare with a tolerance."""
    return len(a) == len(b) and all(
        x == y or (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-12))
        for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=500)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--target-size", type=int, default=1 << 20,
                    help="OPTIMIZE file size (small: several files, so layout matters)")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.commits, args.rows, args.devices, args.runs = 12, 50, 20, 1

    root = Path(tempfile.mkdtemp(prefix="iotlake-bench-"))
    try:
        base = load_settings(environ={}, data_root=str(root / "base"),
                             spark={"master": "local[2]", "shuffle_partitions": 2})
        spark = session(base)
        path = base.table_path("silver")
        ensure_table(spark, path, silver_schema(SENSOR))  # as the streams create it
        rng = random.Random(7)
        t = time.perf_counter()
        for i in range(args.commits):
            write_deltalake(path, batch(i, args.rows, args.devices, rng), mode="append")
        print(f"built {args.commits} commits in {time.perf_counter() - t:.1f}s")
        before = timed(path, args.runs)
        out: dict = {"files_before": len(DeltaTable(path).file_uris()),
                     "rows": args.commits * args.rows, "target_size": args.target_size,
                     "before": {k: round(v[0], 4) for k, v in before.items()}}
        for layout in ("compact", "zorder", "liquid"):
            s = load_settings(environ={}, data_root=str(root / layout))
            p = s.table_path("silver")
            shutil.copytree(path, p)
            t = time.perf_counter()
            if layout == "liquid":
                stats = liquid(spark, p, args.target_size)
            else:
                [stats] = compact(s, ["silver"], target_size=args.target_size,
                                  zorder=layout == "zorder")
            took = time.perf_counter() - t
            after = timed(p, args.runs)
            for k in before:
                assert _same(after[k][1], before[k][1]), f"{layout} changed {k} results"
            print(f"{layout}: {stats} in {took:.1f}s")
            out[layout] = {"optimize_s": round(took, 1), "files_after": stats["files_after"],
                           **{k: round(v[0], 4) for k, v in after.items()},
                           **({"protocol": stats["protocol"]} if "protocol" in stats else {})}
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
