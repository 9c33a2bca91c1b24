"""Benchmark: does the cost of gold's window MERGEs stay flat through a day of a live fleet?

Writes ``--minutes`` of silver readings from ``--devices`` devices (each every 10 s of event
time), one silver commit per ``--batch-seconds`` of event time, and drains them through the
window stream (``availableNow``, one micro-batch per commit) into tables partitioned as by
default (a day per partition). Prints the window batches' time and, per merged table, the rows
each batch's commit wrote (the windows it changed plus every row it rewrote unchanged because
it shared a file with them), over the first and the last tenth of the batches: flat when the
rewrites stay the size of a batch, growing when they carry the day's older windows. Last line:
one JSON object with those figures and each table's files at the end.

    .venv/bin/python bench/window_merge.py [--devices 500] [--minutes 60] [--batch-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from deltalake import DeltaTable
from gold_throughput import STEP_S, settings_for, write_silver  # bench/ is on sys.path

import gold.windows
from lakehouse.spark import spark_session

TABLES = (gold.windows.TABLE, gold.windows.SLIDING_TABLE)
#: the sliding table is off by default; this bench measures both merged tables
SLIDE_WINDOW_SECONDS = 300


def writes(path: str) -> list[int]:
    """Rows each batch's commit wrote to the table (rows it changed plus rows it copied), in order."""
    out = []
    for c in sorted(DeltaTable(path).history(), key=lambda c: c["version"]):
        if c["operation"] in ("MERGE", "WRITE"):
            out.append(int(c.get("operationMetrics", {}).get("numOutputRows", 0)))
    return out


def tenths(values: list[float]) -> tuple[float, float]:
    """Medians of the first and the last tenth (the first value, the table's creation, left out)."""
    k = max(1, len(values) // 10)
    first, last = values[1:k + 1], values[-k:]
    return (statistics.median(first) if first else 0, statistics.median(last) if last else 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=500)
    ap.add_argument("--minutes", type=int, default=60, help="minutes of event time")
    ap.add_argument("--batch-seconds", type=int, default=60, help="event time per micro-batch")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.devices, args.minutes, args.batch_seconds = 20, 3, 60
    readings = args.devices * args.minutes * 60 // STEP_S
    commits = args.minutes * 60 // args.batch_seconds
    root = Path(tempfile.mkdtemp(prefix="iotlake-window-merge-"))
    try:
        s = settings_for(root, max_files=1)
        s.gold.slide_window_seconds = SLIDE_WINDOW_SECONDS
        write_silver(s, readings, args.devices, commits)
        spark = spark_session(s, app_name="iotlake-window-merge")
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", str(commits + 10))
        t0 = time.perf_counter()
        q = gold.windows.start(spark, s, trigger="available_now")
        q.awaitTermination()
        wall = time.perf_counter() - t0
        batch_ms = [p["durationMs"].get("addBatch", 0) for p in q.recentProgress if p["numInputRows"]]
        first_ms, last_ms = tenths(batch_ms)
        out = {"devices": args.devices, "minutes": args.minutes, "batches": len(batch_ms),
               "wall_s": round(wall, 1), "batch_ms_first": first_ms, "batch_ms_last": last_ms}
        for t in TABLES:
            path = s.table_path(t)
            rows_first, rows_last = tenths(writes(path))
            out[t] = {"rows_written_first": rows_first, "rows_written_last": rows_last,
                      "files": len(DeltaTable(path).file_uris())}
        spark.stop()
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
