"""Benchmark: Kafka -> bronze throughput against Spark's ``noop`` sink as the ceiling.

Produces N ~150-byte telemetry JSON messages into a 4-partition topic on the embedded Apache
Kafka, then drains it twice with ``availableNow``: once into bronze (``bronze.stream.start``:
Spark's Kafka source, each batch appended to Delta once) and once into
``noop`` with the same Kafka stream, after a warm-up of both on another topic (the JVM's JIT
would otherwise bill whichever runs first). The first micro-batch pays query start-up, so
"steady" rates leave it out; on shared cores, CPU microseconds per row (whole process tree,
the broker included) are the load-independent figure. Checks bronze holds every record exactly once.
``--live-rate``: then bronze's live query (its trigger, its writes) under a producer sending that
many records per second, and the cores of the Spark JVM and of the broker while it runs: the
least any live pipeline on this stack uses at that rate and batch interval. Last line: one JSON
object.

    .venv/bin/python bench/ingest_throughput.py [--messages 1000000] [--max-offsets 250000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Producer
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

import bronze.stream
from lakehouse.kafka.config import client_config
from lakehouse.kafka.topics import ensure_topics
from lakehouse.settings import Settings, load_settings
from lakehouse.spark import spark_session
from orchestration.services import free_port, kafka_service


def produce(settings: Settings, n: int, devices: int = 1000, headers: bool = False) -> float:
    """Send n telemetry messages keyed by device; returns seconds until all are acknowledged."""
    p = Producer(client_config(settings, **{"linger.ms": 50, "batch.size": 1 << 20,
                                            "batch.num.messages": 10_000, "acks": 1,
                                            "queue.buffering.max.messages": 1_000_000,
                                            "queue.buffering.max.kbytes": 1 << 20}))
    failed: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            failed.append(str(err))

    topic, t0 = settings.kafka.topic, time.perf_counter()
    hdr = [("mqtt_topic", b"devices/x/telemetry"), ("qos", b"1")] if headers else None
    for i in range(n):
        dev = f"dev-{i % devices:05d}"
        value = (
            f'{{"event_id":"e{i:010d}","device_id":"{dev}","ts":"2024-05-01T00:{i // 60000 % 60:02d}:'
            f'{i // 1000 % 60:02d}.{i % 1000:03d}Z","temperature":{20 + i % 97 / 10:.2f},'
            f'"humidity":{40 + i % 53 / 3:.2f},"battery":{100 - i % 89:.1f},"status":"ok"}}'
        ).encode()
        while True:
            try:
                p.produce(topic, value, dev.encode(), headers=hdr, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.05)
        if i % 10_000 == 0:
            p.poll(0)
    if p.flush(120):
        raise RuntimeError("producer did not flush")
    if failed:
        raise RuntimeError(f"{len(failed)} deliveries failed, e.g. {failed[0]}")
    return time.perf_counter() - t0


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its descendants (JVM, Python workers, the Kafka broker), reaped ones too."""
    procs: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2:].split()
            procs[int(d)] = (int(f[1]), sum(map(int, f[11:15])))
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += procs.get(pid, (0, 0))[1]
        todo += kids.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Samples this process tree's CPU time, so CPU per row can be taken over the steady batches:
    on shared cores wall time says as much about the neighbours as about this code."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.samples.append((time.time(), tree_cpu(os.getpid())))

    def between(self, t0: float, t1: float) -> float:
        times = [t for t, _ in self.samples]
        cpu = [c for _, c in self.samples]
        return float(np.interp(t1, times, cpu) - np.interp(t0, times, cpu))


def rates(q: StreamingQuery, wall: float, cpu: CpuSampler) -> dict:
    """Whole = all rows / query wall time; steady = rows / trigger time of batches after the first."""
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in prog)
    rest = prog[1:]
    steady_ms = sum(p["durationMs"]["triggerExecution"] for p in rest)
    steady_rows = sum(p["numInputRows"] for p in rest)
    out = {
        "rows": rows, "batches": len(prog),
        "rows_per_s_whole": round(rows / wall),
        "rows_per_s_steady": round(steady_rows / steady_ms * 1000) if steady_ms else None,
        "first_batch_ms": prog[0]["durationMs"]["triggerExecution"] if prog else None,
        "batch_ms": [p["durationMs"]["triggerExecution"] for p in prog],
        # where a steady batch's time goes: addBatch is the write (tasks and the Delta commit),
        # the rest is the driver's own bookkeeping (offset and commit logs, offset lookups)
        "phase_ms_mean": {k: round(sum(p["durationMs"].get(k, 0) for p in rest) / len(rest))
                          for k in ("addBatch", "walCommit", "commitOffsets", "latestOffset",
                                    "queryPlanning", "getBatch")} if rest else None,
    }
    if rest:
        t0 = datetime.fromisoformat(rest[0]["timestamp"].replace("Z", "+00:00")).timestamp()
        t1 = datetime.fromisoformat(rest[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
        t1 += rest[-1]["durationMs"]["triggerExecution"] / 1000
        out["cpu_us_per_row_steady"] = round(cpu.between(t0, t1) / steady_rows * 1e6, 2)
    return out


def run_query(start) -> tuple[StreamingQuery, float]:
    t0 = time.perf_counter()
    q = start()
    q.awaitTermination()
    if q.exception():
        raise RuntimeError(str(q.exception()))
    time.sleep(0.5)  # one more CPU sample after the last batch
    return q, time.perf_counter() - t0


def check_bronze(path: str, n: int) -> None:
    t = DeltaTable(path).to_pyarrow_table(columns=["partition", "offset"])
    uniq = t.group_by(["partition", "offset"]).aggregate([]).num_rows
    if t.num_rows != n or uniq != n:
        raise AssertionError(f"bronze has {t.num_rows} rows, {uniq} distinct (partition, offset); want {n}")
    # every partition is contiguous from offset 0: nothing skipped
    for part in pc.unique(t["partition"]).to_pylist():
        offs = t.filter(pc.equal(t["partition"], part))["offset"]
        mm = pc.min_max(offs)
        if mm["min"].as_py() != 0 or mm["max"].as_py() != len(offs) - 1:
            raise AssertionError(f"partition {part}: offsets not contiguous from 0")


def bench_settings(root: Path, port: int, topic: str, partitions: int, conf: dict) -> Settings:
    return load_settings(environ={}, data_root=str(root / topic), kafka={
        "bootstrap": f"127.0.0.1:{port}", "embedded_port": port, "partitions": partitions,
        "topic": topic, "dead_letter_topic": f"{topic}-dlq",
    }, spark={"master": "local[2]", "shuffle_partitions": 2, "conf": conf})


def drain(spark: SparkSession, settings: Settings, max_offsets: int, sink: str) -> StreamingQuery:
    """Start an availableNow query from the topic's start into bronze or ``noop``."""
    if sink == "bronze":
        return bronze.stream.start(spark, settings, "available_now", max_offsets)
    frame = bronze.stream.kafka_stream(spark, settings, max_offsets)
    return (frame.writeStream.format("noop").queryName("noop")
            .option("checkpointLocation", settings.checkpoint_path("noop"))
            .trigger(availableNow=True).start())


def live(spark: SparkSession, settings: Settings, broker_pid: int, rate: float, warmup: float,
         seconds: float) -> dict:
    """Bronze's live query under ``rate`` records/s: cores of the Spark JVM and of the broker
    over ``seconds`` after ``warmup``, and the median batch."""
    ensure_topics(settings)
    stop = threading.Event()

    def send() -> None:
        p = Producer(client_config(settings, **{"linger.ms": 5}))
        t0, n = time.monotonic(), 0
        while not stop.is_set():
            due = int((time.monotonic() - t0) * rate)
            for i in range(n, due):
                dev = f"dev-{i % 200:05d}"
                p.produce(settings.kafka.topic, f'{{"event_id":"e{i:010d}","device_id":"{dev}",'
                          f'"ts":"2024-05-01T00:00:00.000Z","temperature":21.5,"status":"ok"}}'.encode(),
                          dev.encode())
            n = max(n, due)
            p.poll(0)
            stop.wait(0.01)
        p.flush(30)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    q = bronze.stream.start(spark, settings, "live")
    jvm = spark._jvm.java.lang.ProcessHandle.current().pid()
    try:
        time.sleep(warmup)
        before = max((p["batchId"] for p in q.recentProgress), default=-1)
        t0, c0 = time.monotonic(), (tree_cpu(jvm), tree_cpu(broker_pid))
        time.sleep(seconds)
        t1, c1 = time.monotonic(), (tree_cpu(jvm), tree_cpu(broker_pid))
        batches = [p for p in q.recentProgress if p["batchId"] > before and p["numInputRows"]]
    finally:
        q.stop()
        stop.set()
        sender.join(60)
    ms = sorted(p["durationMs"]["triggerExecution"] for p in batches)
    return {"rate": rate, "trigger_s": settings.stream.trigger_seconds, "batches": len(batches),
            "cores_spark": round((c1[0] - c0[0]) / (t1 - t0), 3),
            "cores_broker": round((c1[1] - c0[1]) / (t1 - t0), 3),
            "batch_ms_p50": ms[len(ms) // 2] if ms else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--max-offsets", type=int, default=250_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=200_000,
                    help="messages drained through both sinks first (another topic), so JIT "
                         "compilation is not charged to whichever query runs first; 0: none")
    ap.add_argument("--headers", action="store_true", help="attach two headers per message")
    ap.add_argument("--port", type=int, default=0, help="broker port (default: a free one)")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench works")
    ap.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting, as iotlake.toml's [spark.conf] would give")
    ap.add_argument("--live-rate", type=float, default=0,
                    help="then run bronze live under this many records/s and report its cores (0: skip)")
    ap.add_argument("--live-trigger", type=float, default=1.0, help="the live query's trigger interval (s)")
    ap.add_argument("--live-seconds", type=float, default=60, help="seconds sampled, after --live-warmup")
    ap.add_argument("--live-warmup", type=float, default=40)
    args = ap.parse_args(argv)
    if args.smoke:
        args.messages, args.max_offsets, args.warmup = 4_000, 2_000, 1_000
        args.live_rate, args.live_seconds, args.live_warmup = 50, 2, 2
    conf = dict(kv.split("=", 1) for kv in args.spark_conf)

    root = Path(tempfile.mkdtemp(prefix="iotlake-ingest-bench-"))
    port = args.port or free_port()
    settings = bench_settings(root, port, "bench-telemetry", args.partitions, conf)
    warm = bench_settings(root, port, "bench-warmup", args.partitions, conf)
    broker = kafka_service(settings, port=port).start()
    spark = None
    try:
        ensure_topics(settings)
        produce_s = produce(settings, args.messages, headers=args.headers)
        print(f"produced {args.messages} in {produce_s:.1f}s", flush=True)
        spark = spark_session(settings, app_name="iotlake-ingest-bench")
        if args.warmup:
            ensure_topics(warm)
            produce(warm, args.warmup, headers=args.headers)
            for sink in ("bronze", "noop"):
                run_query(lambda sink=sink: drain(spark, warm, args.max_offsets, sink))
        cpu = CpuSampler()
        cpu.start()

        bq, bwall = run_query(lambda: drain(spark, settings, args.max_offsets, "bronze"))
        b = rates(bq, bwall, cpu)
        print("bronze", json.dumps(b), flush=True)
        check_bronze(settings.table_path("bronze"), args.messages)
        nq, nwall = run_query(lambda: drain(spark, settings, args.max_offsets, "noop"))
        n = rates(nq, nwall, cpu)
        print("noop", json.dumps(n), flush=True)
        if n["rows"] != args.messages:
            raise AssertionError(f"noop read {n['rows']} rows, want {args.messages}")
        lv = {}
        if args.live_rate:
            s = bench_settings(root, port, "bench-live", args.partitions, conf)
            s = s.model_copy(update={"stream": s.stream.model_copy(update={"trigger_seconds": args.live_trigger})})
            lv = live(spark, s, broker.proc.pid, args.live_rate, args.live_warmup, args.live_seconds)
            print("live", json.dumps(lv), flush=True)
        files = len(DeltaTable(settings.table_path("bronze")).file_uris())
        print(json.dumps({
            "rows": b["rows"], "messages": args.messages, "max_offsets": args.max_offsets,
            "warmup": args.warmup, "headers": args.headers, "spark_conf": conf,
            "bronze_files": files, "produce_s": round(produce_s, 1),
            "rows_per_s_whole": b["rows_per_s_whole"], "rows_per_s_steady": b["rows_per_s_steady"],
            "noop_rows_per_s_whole": n["rows_per_s_whole"], "noop_rows_per_s_steady": n["rows_per_s_steady"],
            "ratio": round(n["rows_per_s_steady"] / b["rows_per_s_steady"], 3),
            "cpu_us_per_row_steady": b.get("cpu_us_per_row_steady"),
            "noop_cpu_us_per_row_steady": n.get("cpu_us_per_row_steady"),
            "load_avg_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count(),
            "exact_once": True,
            **{f"live_{k}": v for k, v in lv.items()},
        }))
    finally:
        if spark is not None:
            spark.stop()
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    pa.set_cpu_count(2)
    main()
