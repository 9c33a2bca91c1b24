"""Per-micro-batch cost of each Delta-sourced layer: the floor under end-to-end latency.

Latency is a few batch durations, and at live rates a batch holds a few thousand rows, so what
matters is the fixed cost of a batch, not throughput. Builds a bronze table (the silver bench's
generator), then runs silver, gold windows and gold health one at a time over it with
``available_now`` in small batches (``--batch-rows``), on an otherwise idle Spark session (the JVM
warmed on a separate table first). As in a live pipeline, the measured batches read commits made
after their query first ran: each query first runs over the bronze table's first commit (and
the layers it feeds), then the other commits are added and each query runs again from its
checkpoint. A query started over a table written before reads the table's files as its first
snapshot instead, through a Spark job every batch. Prints, per layer, the median batch's
duration and its parts (ms) and the CPU seconds per batch of the whole process tree (driver,
JVM, Python workers).
Last line: one JSON object ``{layer: {"batch_ms": .., "cpu_ms_per_batch": .., ...}}``.

    .venv/bin/python bench/batch_overhead.py [--rows 40000] [--batch-rows 4000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fleets import SENSOR
from silver_throughput import build_bronze, tree_cpu  # bench/ is on sys.path

import gold.health
import gold.windows
import silver.stream
from lakehouse.settings import Settings, load_settings
from lakehouse.spark import spark_session


def settings_for(root: Path, name: str, batch_rows: int, conf: dict[str, str]) -> Settings:
    return load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root / name),
                         # one bronze commit (= one file, --batch-rows rows) per silver batch;
                         # a silver batch writes about two files (the local session's parallelism)
                         stream={"silver_max_files_per_trigger": 1, "silver_max_bytes_per_trigger": 0},
                         gold={"max_files_per_trigger": 2, "max_bytes_per_trigger": 0},
                         spark={"conf": conf})


def layer_runs(spark, s: Settings, bronze: str) -> dict[str, object]:
    """Each layer's query over the previous one's table, in pipeline order."""
    return {
        "silver": lambda: silver.stream.start(spark, s, trigger="available_now", bronze_path=bronze),
        "gold_windows": lambda: gold.windows.start(spark, s, trigger="available_now"),
        "gold_health": lambda: gold.health.start(spark, s, trigger="available_now"),
    }


def add_commits(written: str, table: str, upto: int | None = None) -> None:
    """Make ``table`` the table at ``written`` up to commit ``upto`` (all: None): its data files,
    then its log's commits, as a writer would have committed them after a query's start."""
    src, dst = Path(written), Path(table)
    (dst / "_delta_log").mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.parquet"):
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
    for f in sorted((src / "_delta_log").glob("*.json")):
        if (upto is None or int(f.stem) <= upto) and not (dst / "_delta_log" / f.name).exists():
            shutil.copy2(f, dst / "_delta_log" / f.name)


def measure(spark, start) -> dict:
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    cpu0 = tree_cpu(pid) + time.process_time()
    q = start()
    q.awaitTermination()
    cpu = tree_cpu(pid) + time.process_time() - cpu0
    batches = [p for p in q.recentProgress if p["numInputRows"] > 0][1:]  # first pays set-up
    parts: dict[str, list[int]] = {}
    for p in batches:
        for k, v in p["durationMs"].items():
            parts.setdefault(k, []).append(v)
    return {"batches": len(q.recentProgress), "rows_p50": statistics.median(p["numInputRows"] for p in batches),
            "batch_ms": statistics.median(parts["triggerExecution"]),
            "cpu_ms_per_batch": round(1000 * cpu / len(q.recentProgress)),
            "parts_ms": {k: statistics.median(v) for k, v in sorted(parts.items())
                         if k != "triggerExecution" and statistics.median(v) >= 1}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--batch-rows", type=int, default=4_000)
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--layers", default="silver,gold_windows,gold_health",
                    help="layers to report (silver always runs: gold reads it)")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.batch_rows = 3_000, 1_000  # no warm-up run, no first-commit run: 2 measured
    conf = dict(c.split("=", 1) for c in args.conf)
    wanted = args.layers.split(",")
    root = Path(tempfile.mkdtemp(prefix="iotlake-overhead-"))
    try:
        spark = None
        results = {}
        for run in ("measured",) if args.smoke else ("warm", "measured"):
            s = settings_for(root, run, args.batch_rows, conf)
            bronze, written = s.table_path("bronze"), str(root / f"{run}_written")
            build_bronze(written, args.rows, args.rows // args.batch_rows)
            spark = spark or spark_session(s, app_name="iotlake-batch-overhead")
            # gold health only when reported (nothing reads its tables)
            runs = {layer: start for layer, start in layer_runs(spark, s, bronze).items()
                    if layer != "gold_health" or layer in wanted}
            if not args.smoke:  # a smoke run's queries start over the whole table: half the runs
                add_commits(written, bronze, upto=0)
                for start in runs.values():  # the first commit
                    start().awaitTermination()
            add_commits(written, bronze)
            for layer, start in runs.items():
                r = measure(spark, start)
                if run == "measured" and layer in wanted:
                    results[layer] = r
                    print(f"# {layer}: {json.dumps(r)}", flush=True)
        spark.stop()
        print(json.dumps(results))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
