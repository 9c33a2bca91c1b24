"""Silver's dedup as its state grows: Spark's state store against the driver's index.

At 5,000 events/s a 600 s watermark holds ~3M event ids. Spark's
``dropDuplicatesWithinWatermark`` reads all of them on every micro-batch to evict; the index
(``stream.dedup = "index"``, silver/dedup.py) touches only the batch and what expires. Builds
one bronze table whose event times are ``--step-ms`` apart (0.2 ms = 5,000 events/s of event
time), (one delta-rs commit of ``--batch-rows`` rows each) then runs silver over it with
``available_now``, one bronze commit per batch (``stream.silver_max_files_per_trigger = 1``),
once per dedup mode in the same Spark session (state store on RocksDB first: the baseline).
Prints per mode rows/s over the whole run, the median batch time over the first and the last
``--edge`` batches, CPU seconds of the process tree and the accounting; last line one JSON
object with the ratios.

    .venv/bin/python bench/silver_dedup.py [--rows 1000000] [--batch-rows 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fleets import SENSOR
from silver_throughput import build_bronze, counters, tree_cpu  # bench/ is on sys.path

import silver.stream
from lakehouse.settings import load_settings
from lakehouse.spark import spark_session


def _ratio(a: float, b: float) -> float | None:
    """a / b; None when b rounds to nothing (a smoke run's few batches on a shared JVM, whose
    process tree can even lose CPU seconds to a Python worker that exited)."""
    return round(a / b, 2) if b > 0 else None


def run(spark, root: Path, mode: str, bronze: str, batch_rows: int, edge: int) -> dict:
    s = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root / mode),
                      stream={"watermark_seconds": 600, "dedup": mode,
                              "silver_max_files_per_trigger": 1,  # one bronze commit per batch
                              "silver_max_bytes_per_trigger": 0})
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    cpu0, t0 = tree_cpu(pid) + time.process_time(), time.monotonic()
    q = silver.stream.start(spark, s, trigger="available_now", bronze_path=bronze)
    q.awaitTermination()
    wall, cpu = time.monotonic() - t0, tree_cpu(pid) + time.process_time() - cpu0
    data = [p for p in q.recentProgress if p["numInputRows"] > 0]
    ms = [p["durationMs"]["triggerExecution"] for p in data]
    rows = sum(p["numInputRows"] for p in data)
    return {"batches": len(data), "rows_per_s": round(rows / wall), "first_batches_ms": statistics.median(ms[1:1 + edge]),
            "last_batches_ms": statistics.median(ms[-edge:]), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "accounting": dict(counters(s))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch-rows", type=int, default=20_000)
    ap.add_argument("--step-ms", type=float, default=0.2, help="event time between rows")
    ap.add_argument("--edge", type=int, default=5, help="batches at each end to take the median of")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.batch_rows, args.edge = 4_000, 2_000, 1
    root = Path(tempfile.mkdtemp(prefix="iotlake-dedup-bench-"))
    try:
        bronze = str(root / "bronze")
        expected = build_bronze(bronze, args.rows, args.rows // args.batch_rows, step_ms=args.step_ms)
        warm = str(root / "warm_bronze")
        build_bronze(warm, 4 * args.batch_rows, 4, seed=1, step_ms=args.step_ms)
        spark = spark_session(load_settings(environ={}, data_root=str(root / "spark")),
                              app_name="iotlake-dedup-bench")
        for mode in () if args.smoke else ("state_store", "index"):  # a smoke run measures nothing
            run(spark, root / "warm", mode, warm, args.batch_rows, 1)
        runs = {}
        for mode in ("state_store", "index"):
            runs[mode] = r = run(spark, root, mode, bronze, args.batch_rows, args.edge)
            assert r["accounting"] == dict(expected), (mode, r["accounting"], dict(expected))
            print(f"# {mode}: {json.dumps(r)}", flush=True)
        spark.stop()
        base, new = runs["state_store"], runs["index"]
        print(json.dumps({
            "rows": args.rows, "batch_rows": args.batch_rows, "step_ms": args.step_ms,
            "state_store_last_batches_ms": base["last_batches_ms"],
            "index_last_batches_ms": new["last_batches_ms"],
            "last_batches_speedup": _ratio(base["last_batches_ms"], new["last_batches_ms"]),
            "cpu_ratio": _ratio(base["cpu_s"], new["cpu_s"]),
            "state_store_rows_per_s": base["rows_per_s"], "index_rows_per_s": new["rows_per_s"],
            "state_store_cpu_s": base["cpu_s"], "index_cpu_s": new["cpu_s"],
            "load_avg_1m": os.getloadavg()[0]}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
