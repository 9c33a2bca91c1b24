"""Benchmark: silver -> gold throughput of the health stream and the window stream.

Writes ``--readings`` synthetic silver readings from ``--devices`` devices (every device reports
every 10 s of event time; a few spikes, low batteries and errors) into a silver Delta table in
``--commits`` commits (one file each), then drains it through Delta's streaming source with
``availableNow`` and ``gold.max_files_per_trigger`` (``--max-files``; the default 1 makes every
commit one micro-batch): the health stream alone, the window stream alone, then both at once.
State size comes from the last progress' ``stateOperators`` (RocksDB), or from the files of the
health stream's device state on the driver (``--health-state``: the setting's default unless
given). The same readings then go through Spark and Delta alone
(``health_floor_rows_per_s``: the health stream's buckets, state and Python round trip with a
function that only counts; ``windows_floor_rows_per_s``: the same windows in append mode), each
appended to one table as iotlake appends: the most this stack gives on this machine. ``--scaling`` repeats the health run at other device
counts with the same number of readings. The session is a batch process's, as `iotlake backfill`
runs (``spark.expression_codegen``; the JSON's ``codegen`` says which mode ran). Before the
measured runs each stream runs once over a small table of its own (``--warmup`` readings; its
own checkpoint and state), as the silver bench warms up: the measured runs then find the JVM,
the Python workers and the detector compiled, as a stream that has been running does; the first
batch of each measured run still creates the state of every device it sees. Last line: one
JSON object.

    .venv/bin/python bench/gold_throughput.py [--devices 10000] [--readings 1000000]
        [--commits 10] [--max-files 1] [--scaling 1000,100000] [--skip-windows] [--warmup 40000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from fleets import SENSOR  # bench/ is on sys.path
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.state import GroupStateTimeout
from pyspark.sql.types import DoubleType, LongType, StructField, StructType
from silver_throughput import PROFILES, floor_query, profile_model

import gold.health
import gold.state_store
import gold.windows
from gold.device_state import state_files
from lakehouse.delta.tables import spark_schema
from lakehouse.settings import Settings, load_settings
from lakehouse.spark import spark_session
from lakehouse.tables import silver_schema

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STEP_S = 10  # every device reports every STEP_S seconds of event time


#: the telemetry model of the run (``--profile``); the example sensor's by default
MODEL = SENSOR
#: gold.health_state for the runs (None: the setting's default)
HEALTH_STATE: str | None = None


def settings_for(root: Path, max_files: int, conf: dict[str, str] | None = None) -> Settings:
    return load_settings(environ={}, data_root=str(root),
                         spark={"master": "local[2]", "shuffle_partitions": 2, "conf": conf or {}},
                         gold={"max_files_per_trigger": max_files, "max_bytes_per_trigger": 0,
                               **({"health_state": HEALTH_STATE} if HEALTH_STATE else {})},
                         telemetry=MODEL.model_dump())


def model_batch(lo: int, hi: int, devices: int, rng: np.random.Generator) -> pa.Table:
    """Readings of any telemetry model: each metric a per-device level plus noise, rare spikes
    on the first; a few devices break the first status rule."""
    i = np.arange(lo, hi)
    dev = i % devices
    n = hi - lo
    t_us = int(T0.timestamp() * 1e6) + (i // devices) * STEP_S * 1_000_000
    cols = {}
    for k, m in enumerate(MODEL.metrics):
        lo_v = m.min if m.min is not None else 0.0
        hi_v = m.max if m.max is not None else lo_v + 100.0
        v = lo_v + (hi_v - lo_v) * (0.4 + 0.02 * (dev % 7)) + rng.normal(0, 0.002 * (hi_v - lo_v), n)
        if k == 0:
            v[rng.random(n) < 1e-4] += 0.3 * (hi_v - lo_v)  # rare spikes
        cols[m.name] = np.round(v).astype(np.int64) if m.type == "long" else v
    for r in MODEL.status_rules[:1]:  # a few devices out of bounds
        bad = r.below - 1 if r.below is not None else r.above + 1
        cols[r.metric] = np.where(dev % 500 == 0, bad, cols[r.metric])
    schema = silver_schema(MODEL)
    data = {
        "event_id": pa.array(np.char.add("e", i.astype(str))),
        "device_id": pa.array(np.char.add("dev-", np.char.zfill(dev.astype(str), 6))),
        "event_time": pa.array(t_us, pa.timestamp("us", tz="UTC")), **cols,
        **{c: pa.array(np.char.add(f"{c}-", (dev % 3).astype(str))) for c in MODEL.topic_columns},
        "status": pa.nulls(n, pa.string()), "schema_version": pa.array(np.ones(n, np.int32)),
        "extra": pa.nulls(n, pa.string()), "kafka_partition": pa.array(np.zeros(n, np.int32)),
        "kafka_offset": i, "ingest_time": pa.array(t_us, pa.timestamp("us", tz="UTC")),
    }
    return pa.table({f: data[f] for f in schema.names}).cast(schema)


def silver_batch(lo: int, hi: int, devices: int, rng: np.random.Generator) -> pa.Table:
    """Readings lo..hi-1: reading i is device i % devices at T0 + (i // devices) * STEP_S."""
    if MODEL != SENSOR:
        return model_batch(lo, hi, devices, rng)
    i = np.arange(lo, hi)
    dev = i % devices
    n = hi - lo
    temp = 20.0 + dev % 7 + rng.normal(0, 0.2, n)
    temp[rng.random(n) < 1e-4] += 25.0  # rare spikes
    battery = np.where(dev % 500 == 0, 10.0, 80.0)  # a few devices on low battery
    status = np.where(rng.random(n) < 1e-4, "error", "ok")
    t_us = int(T0.timestamp() * 1e6) + (i // devices) * STEP_S * 1_000_000
    return pa.table({
        "event_id": pa.array(np.char.add("e", i.astype(str))),
        "device_id": pa.array(np.char.add("dev-", np.char.zfill(dev.astype(str), 6))),
        "event_time": pa.array(t_us, pa.timestamp("us", tz="UTC")),
        "temperature": temp, "humidity": 40.0 + rng.normal(0, 1.0, n), "battery": battery,
        "status": pa.array(status), "schema_version": pa.array(np.ones(n, np.int32)),
        "extra": pa.nulls(n, pa.string()), "kafka_partition": pa.array(np.zeros(n, np.int32)),
        "kafka_offset": i, "ingest_time": pa.array(t_us, pa.timestamp("us", tz="UTC")),
    }).cast(silver_schema(SENSOR))


def write_silver(settings: Settings, readings: int, devices: int, commits: int) -> float:
    t0 = time.perf_counter()
    rng = np.random.default_rng(7)
    edges = np.linspace(0, readings, commits + 1).astype(int)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        write_deltalake(settings.table_path("silver"), silver_batch(lo, hi, devices, rng), mode="append")
    return time.perf_counter() - t0


def state_of(q: StreamingQuery) -> dict:
    """State rows / memory / RocksDB size from the last progress that reports a state operator."""
    ops = [p["stateOperators"][0] for p in q.recentProgress if p.get("stateOperators")]
    if not ops:
        return {}
    op = ops[-1]
    custom = op.get("customMetrics", {})
    out = {"state_rows": op.get("numRowsTotal"),
           "state_memory_mb": round(op.get("memoryUsedBytes", 0) / 2**20, 1)}
    for k in ("rocksdbTotalSizeOnDisk", "rocksdbSstFileSize"):
        if k in custom:
            out[f"{k}_mb"] = round(custom[k] / 2**20, 1)
    return out


def driver_state_of(settings: Settings) -> dict:
    """Devices and bytes on disk of the health stream's driver-held state (its last snapshot
    and the changes after it), when it runs in that mode."""
    files = state_files(Path(settings.checkpoint_path("gold_health"), "device_state"))
    snaps = [(b, f) for b, kind, f in files if kind == "snapshot"]
    if not snaps:
        return {}
    last, snap = snaps[-1]
    with pa.memory_map(str(snap)) as src:
        devices = pa.ipc.open_file(src).read_all().num_rows
    live = [f for b, _, f in files if b >= last]
    return {"state_rows": devices, "state_disk_mb": round(sum(f.stat().st_size for f in live) / 2**20, 1)}


def rates(q: StreamingQuery, wall: float, cpu: dict[str, float]) -> dict:
    """Whole = rows / query wall time; steady = rows / trigger time of batches after the first;
    per CPU-second = rows / CPU time of the driver, JVM and workers (x2 = 2 idle cores)."""
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in prog)
    rest = prog[1:]
    steady_ms = sum(p["durationMs"]["triggerExecution"] for p in rest)
    return {
        "rows": rows, "batches": len(prog), "wall_s": round(wall, 1),
        "cpu_s": round(sum(cpu.values()), 1), "cpu_s_by_process": cpu, "rows_per_s": round(rows / wall),
        "rows_per_cpu_s": round(rows / sum(cpu.values())) if sum(cpu.values()) else None,
        "rows_per_s_steady": round(sum(p["numInputRows"] for p in rest) / steady_ms * 1000)
        if steady_ms else None,
        "batch_ms": [p["durationMs"]["triggerExecution"] for p in prog],
    }


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU time of this process (driver), the JVM and the Python workers (live ones), by pid.

    The machine is shared: wall-clock rates depend on others' load, CPU seconds much less.
    """
    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            kind = "driver" if p.pid == me.pid else "jvm" if p.name() == "java" else "workers"
            out[p.pid] = (kind, t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by kind between two samples, per process: a Python worker that exited in
    between (Spark retires idle ones) is left out, not subtracted; a new one counts whole."""
    out = {"driver": 0.0, "jvm": 0.0, "workers": 0.0}
    for pid, (kind, cpu) in after.items():
        out[kind] += max(0.0, cpu - before.get(pid, (kind, 0.0))[1])  # max: a reused pid
    return {k: round(v, 1) for k, v in out.items()}


def run(starts: list[Callable[[], StreamingQuery]]
        ) -> tuple[list[StreamingQuery], float, dict[str, float]]:
    """Run the queries to completion; returns them, wall seconds and CPU seconds by process."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    qs = [s() for s in starts]
    for q in qs:
        q.awaitTermination()
        if q.exception():
            raise RuntimeError(str(q.exception()))
    c1 = cpu_seconds()
    return qs, time.perf_counter() - t0, cpu_used(c0, c1)


def fresh(root: Path, name: str, max_files: int, silver: str) -> Settings:
    """Settings with an own data root whose silver table is a link to the shared one."""
    s = settings_for(root / name, max_files)
    Path(s.table_path("silver")).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(silver, s.table_path("silver"))
    return s


def check_scored(settings: Settings, readings: int) -> None:
    n = DeltaTable(settings.table_path("readings_scored")).count()
    k = len(MODEL.gold_metrics)
    if n != readings * k:
        raise AssertionError(f"readings_scored has {n} rows, want {readings * k}")


def _floor_windows(spark: SparkSession, s: Settings) -> StreamingQuery:
    """Spark and Delta alone: the same 1-minute windows (count, mean, min, max, stddev, last) in
    append mode, appended to one table: no upsert of open windows, no final table."""
    long = gold.windows.readings_long(gold.windows.silver_stream(spark, s), MODEL.gold_metrics)
    agg = (long.withWatermark("event_time", f"{s.stream.watermark_seconds} seconds")
           .groupBy("device_id", "metric", F.window("event_time", "1 minute"))
           .agg(F.count("value").alias("count"), F.avg("value").alias("mean"), F.min("value").alias("min"),
                F.max("value").alias("max"), F.stddev("value").alias("stddev"),
                F.max_by("value", "event_time").alias("last")))
    return floor_query(agg, s, "floor_windows")


def _floor_health(spark: SparkSession, s: Settings) -> StreamingQuery:
    """Spark and Delta alone: the health stream's shape (rows to Python by the same 64 device
    buckets, RocksDB state per bucket, every reading out again with a score) with a function
    that only counts, appended to one table: no detector, status or upserts."""
    state = StructType([StructField("n", LongType())])

    def count(key, frames, st):
        n = st.get[0] if st.exists else 0
        for pdf in frames:
            n += len(pdf)
            yield pdf.drop(columns="bucket").assign(score=0.0)
        st.update((n,))
    cols = ["device_id", "event_time", *MODEL.gold_metrics]
    out = StructType([*[f for f in spark_schema(silver_schema(MODEL)).fields if f.name in cols],
                      StructField("score", DoubleType())])
    df = (gold.windows.silver_stream(spark, s).select(*cols)
          .withWatermark("event_time", f"{s.stream.watermark_seconds} seconds")
          .withColumn("bucket", F.pmod(F.xxhash64("device_id"), F.lit(gold.state_store.STATE_BUCKETS)))
          .groupBy("bucket").applyInPandasWithState(count, out, state, "append", GroupStateTimeout.NoTimeout))
    return floor_query(df, s, "floor_health")


def warm_up(spark: SparkSession, root: Path, args: argparse.Namespace) -> dict:
    """Each stream once over ``args.warmup`` readings of a table of its own (own checkpoint and
    state), in two micro-batches; returns their time (what the cold start cost, not a rate)."""
    base = settings_for(root / "warm", args.max_files)
    devices = max(1, min(args.devices, args.warmup // 4))
    write_silver(base, args.warmup, devices, 2 * args.max_files)
    out = {}
    starts = {"health": gold.health.start, "windows": gold.windows.start}
    for name, start in starts.items():
        if name == "windows" and args.skip_windows:
            continue
        s = fresh(root, f"warm_{name}", args.max_files, base.table_path("silver"))
        (q,), wall, cpu = run([lambda start=start, s=s: start(spark, s, "available_now")])
        out[name] = {"wall_s": round(wall, 1), "cpu_s": round(sum(cpu.values()), 1)}
    print("warm-up", json.dumps(out), flush=True)
    return out


def bench_devices(spark: SparkSession, root: Path, devices: int, args: argparse.Namespace,
                  windows: bool, floors: bool = False) -> dict:
    base = settings_for(root / f"d{devices}", args.max_files)
    write_s = write_silver(base, args.readings, devices, args.commits)
    silver = base.table_path("silver")
    print(f"{devices} devices: silver written in {write_s:.1f}s", flush=True)
    s = fresh(root, f"h{devices}", args.max_files, silver)
    (hq,), wall, cpu = run([lambda: gold.health.start(spark, s, "available_now")])
    check_scored(s, args.readings)
    out = {"devices": devices, "health": rates(hq, wall, cpu) | state_of(hq) | driver_state_of(s)}
    print("health", json.dumps(out["health"]), f"load {os.getloadavg()[0]:.1f}", flush=True)
    if windows:
        w = fresh(root, f"w{devices}", args.max_files, silver)
        (wq,), wall, cpu = run([lambda: gold.windows.start(spark, w, "available_now")])
        out["windows"] = rates(wq, wall, cpu) | state_of(wq)
        print("windows", json.dumps(out["windows"]), f"load {os.getloadavg()[0]:.1f}", flush=True)
    if floors:  # the same readings through Spark and Delta alone
        f = fresh(root, f"f{devices}", args.max_files, silver)
        for name, start in (("health_floor", _floor_health), ("windows_floor", _floor_windows)):
            (fq,), wall, cpu = run([lambda start=start: start(spark, f)])
            out[name] = rates(fq, wall, cpu)
            print(name, json.dumps(out[name]), f"load {os.getloadavg()[0]:.1f}", flush=True)
    if windows and not args.smoke:  # both at once: a measurement, no code path of its own
        b = fresh(root, f"b{devices}", args.max_files, silver)
        (hq, wq), wall, cpu = run([lambda: gold.health.start(spark, b, "available_now"),
                                   lambda: gold.windows.start(spark, b, "available_now")])
        out["both"] = {"wall_s": round(wall, 1), "cpu_s": round(sum(cpu.values()), 1),
                       "rows_per_s": round(args.readings / wall),
                       "health_batches": len(hq.recentProgress), "windows_batches": len(wq.recentProgress)}
        print("both", json.dumps(out["both"]), f"load {os.getloadavg()[0]:.1f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--readings", type=int, default=1_000_000)
    ap.add_argument("--commits", type=int, default=10)
    ap.add_argument("--max-files", type=int, default=1, help="silver files (commits) per micro-batch")
    ap.add_argument("--scaling", default="1000,100000",
                    help="comma-separated device counts for health-only runs ('' = none)")
    ap.add_argument("--skip-windows", action="store_true")
    ap.add_argument("--warmup", type=int, default=40_000,
                    help="readings of the warm-up runs before the measured ones (0: none, a cold start)")
    ap.add_argument("--skip-floors", action="store_true",
                    help="skip the floor runs (the same readings through Spark and Delta alone)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="sensor",
                    help="whose readings: an example fleet's (examples/sensor.toml, examples/pump.toml)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark conf (repeatable), as iotlake.toml's [spark.conf] gives it")
    ap.add_argument("--health-state", choices=["driver", "state_store"], default=None,
                    help="where the health stream keeps device state (gold.health_state; default: its default)")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    global MODEL, HEALTH_STATE
    MODEL = profile_model(args.profile)
    HEALTH_STATE = args.health_state
    if args.smoke:
        args.devices, args.readings, args.commits, args.scaling, args.warmup = 20, 2_000, 2, "", 0
    root = Path(tempfile.mkdtemp(prefix="iotlake-gold-bench-"))
    conf = dict(c.split("=", 1) for c in args.conf)
    s = settings_for(root / "spark", args.max_files, conf)
    spark = spark_session(s, app_name="iotlake-gold-bench", batch=True)
    try:
        warm = warm_up(spark, root, args) if args.warmup else {}
        load0 = os.getloadavg()
        main_run = bench_devices(spark, root, args.devices, args, windows=not args.skip_windows,
                                 floors=not args.skip_floors)
        scaling = {str(args.devices): main_run["health"]}
        for d in [int(x) for x in args.scaling.split(",") if x.strip()]:
            scaling[str(d)] = bench_devices(spark, root, d, args, windows=False)["health"]
        h = main_run["health"]
        result = {
            "profile": args.profile, "devices": args.devices, "readings": args.readings, "max_files_per_trigger": args.max_files,
            "rows_per_batch": args.readings // args.commits * args.max_files,
            "rows_per_s": h["rows_per_s"], "rows_per_s_steady": h["rows_per_s_steady"],
            "rows_per_cpu_s": h["rows_per_cpu_s"], "cpu_s_by_process": h["cpu_s_by_process"],
            "windows_rows_per_s": main_run.get("windows", {}).get("rows_per_s"),
            "windows_rows_per_cpu_s": main_run.get("windows", {}).get("rows_per_cpu_s"),
            "both_rows_per_s": main_run.get("both", {}).get("rows_per_s"),
            # what Spark and Delta alone reach on the same readings and machine (whole runs)
            "health_floor_rows_per_s": main_run.get("health_floor", {}).get("rows_per_s"),
            "health_floor_rows_per_s_steady": main_run.get("health_floor", {}).get("rows_per_s_steady"),
            "windows_floor_rows_per_s": main_run.get("windows_floor", {}).get("rows_per_s"),
            "health_state": s.gold.health_state,
            # state_store: rows are device buckets; driver: devices (state_disk_mb: its files)
            "state_rows": h.get("state_rows"), "state_buckets": gold.state_store.STATE_BUCKETS,
            "state_memory_mb": h.get("state_memory_mb"),
            "state_disk_mb": h.get("rocksdbTotalSizeOnDisk_mb", h.get("rocksdbSstFileSize_mb", h.get("state_disk_mb"))),
            "windows_state_rows": main_run.get("windows", {}).get("state_rows"),
            "windows_state_memory_mb": main_run.get("windows", {}).get("state_memory_mb"),
            "scaling": {d: {k: r.get(k) for k in (
                "rows_per_s", "rows_per_s_steady", "rows_per_cpu_s", "cpu_s_by_process", "state_rows",
                "state_memory_mb", "rocksdbTotalSizeOnDisk_mb", "rocksdbSstFileSize_mb", "state_disk_mb")}
                for d, r in scaling.items()},
            "warmup_readings": args.warmup, "warmup": warm,
            "load_avg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
            "cores": os.cpu_count(), "codegen": spark.conf.get("spark.sql.codegen.factoryMode"),
        }
        print(json.dumps(result))
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
