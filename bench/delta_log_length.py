"""Benchmark: what a long Delta log costs each commit and each reader, on local disk.

Delta's log store for local and HDFS paths lists the whole ``_delta_log`` folder whenever it
looks for new versions (each transaction's start, each stream's batch), and delta-rs lists it
to open or refresh a table: both grow with the files kept there, which the log retention
decides (``maintenance.log_retention_hours``; on a local disk each commit leaves four files:
the commit, Delta's checksum and Hadoop's hidden checksum of each). For each ``--log-files`` count this makes a table whose log
holds that many older commit and checksum files below its checkpoint (empty: no reader opens
files older than the checkpoint), then times iotlake's own append (``append``: transaction,
write, commit) and delta-rs's open and refresh. Last line: one JSON object with the medians
per count.

    .venv/bin/python bench/delta_log_length.py [--log-files 0,100000,1000000] [--appends 10]
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

from deltalake import DeltaTable

from lakehouse.delta.tables import append
from lakehouse.settings import load_settings
from lakehouse.spark import spark_session


def _name(version: int, suffix: str) -> str:
    return f"{version:020d}.{suffix}"


def make_table(spark, path: Path, log_files: int) -> None:
    """A one-commit table whose checkpoint is version ``log_files // 2``, with that many empty
    older commit and checksum files before it."""
    spark.range(100).selectExpr("id", "cast(id as double) AS value").write.format("delta").save(str(path))
    DeltaTable(str(path)).create_checkpoint()
    log = path / "_delta_log"
    top = log_files // 2
    for suffix in ("json", "crc", "checkpoint.parquet"):
        if (log / _name(0, suffix)).exists():
            os.rename(log / _name(0, suffix), log / _name(top, suffix))
    last = json.loads((log / "_last_checkpoint").read_text())
    (log / "_last_checkpoint").write_text(json.dumps({**last, "version": top}))
    for v in range(top):
        for suffix in ("json", "crc"):
            os.close(os.open(log / _name(v, suffix), os.O_CREAT | os.O_WRONLY, 0o644))


def measure(spark, root: Path, log_files: int, appends: int) -> dict:
    path = root / f"t{log_files}"
    t = time.perf_counter()
    make_table(spark, path, log_files)
    made_s = time.perf_counter() - t
    df = spark.range(100).selectExpr("id", "cast(id as double) AS value")
    append_ms, open_ms, update_ms = [], [], []
    reader = DeltaTable(str(path))
    for i in range(appends):
        t = time.perf_counter()
        append(df, str(path), "bench", i)
        append_ms.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        reader.update_incremental()
        update_ms.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        DeltaTable(str(path))
        open_ms.append((time.perf_counter() - t) * 1000)
    files = len(os.listdir(path / "_delta_log"))
    shutil.rmtree(path)
    med = lambda xs: round(statistics.median(xs[1:] or xs), 1)  # noqa: E731 - the first warms up
    return {"older_log_files": log_files, "log_files": files, "make_s": round(made_s, 1), "append_ms": med(append_ms),
            "delta_rs_open_ms": med(open_ms), "delta_rs_update_ms": med(update_ms)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log-files", default="0,100000,1000000",
                    help="comma-separated counts of older log files (commits and checksums)")
    ap.add_argument("--appends", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    try:
        counts = [int(c) for c in args.log_files.split(",")]
    except ValueError:
        ap.error(f"--log-files takes comma-separated integers, got {args.log_files!r}")
    if args.smoke:
        counts, args.appends = [0, 2000], 3
    root = Path(tempfile.mkdtemp(prefix="iotlake-loglen-"))
    settings = load_settings(environ={}, data_root=str(root / "data"),
                             spark={"master": "local[2]", "shuffle_partitions": 2})
    spark = spark_session(settings, app_name="bench-delta-log-length")
    try:
        rows = [measure(spark, root, n, args.appends) for n in counts]
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"appends": args.appends,
                      **{f"{k}_{r['older_log_files']}": r[k] for r in rows
                         for k in ("append_ms", "delta_rs_open_ms", "delta_rs_update_ms")}}))


if __name__ == "__main__":
    main()
