"""Benchmark: Kafka -> bronze -> silver throughput as parallelism grows.

The same N telemetry messages go into topics of 1, 2 and 4 partitions on the embedded Apache Kafka broker.
Each Spark configuration drains them with bronze then silver (``availableNow``, the live
streams' code and checkpoints), after a small warm-up topic that pays Python-worker start-up:

- ``local[1]`` and ``local[2]`` with 1, 2 and 4 partitions;
- a standalone cluster (pyspark's own jars) of 1 and 2 workers of one core, 4 partitions.

Every configuration runs in its own process, one after another (one driver JVM at a time).
Rates are rows / wall seconds of the layer's availableNow run. Last line: one JSON object with
rows/s per configuration and ``speedup_2x`` (cluster, 2 workers over 1, bronze+silver). Two cores
cannot show more, so it also says what limits scale: CPU-seconds per million rows on the driver
(serial) and on executors (parallel) in the widest local run (``bench/spark_cpu.py``), and the
speedups Amdahl's law gives for 8 and 32 executors (``predicted_speedup_8``, ``_32``).

    .venv/bin/python bench/scaling.py [--messages 200000]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import Producer
from deltalake import DeltaTable
from fleets import SENSOR

from lakehouse.kafka.config import client_config
from lakehouse.kafka.topics import ensure_topics
from lakehouse.settings import Settings, load_settings
from orchestration.cluster import StandaloneCluster, cluster_conf
from orchestration.services import free_port, kafka_service

PARTITIONS = (1, 2, 4)


def produce(settings: Settings, n: int, devices: int = 500) -> None:
    """n distinct, valid readings keyed by device (event times 10 ms apart)."""
    p = Producer(client_config(settings, **{"linger.ms": 50, "batch.num.messages": 10_000,
                                            "queue.buffering.max.messages": 1_000_000}))
    for i in range(n):
        dev = f"dev-{i % devices:05d}"
        ms = i * 10
        value = (f'{{"schema_version":1,"event_id":"{i:032x}","device_id":"{dev}",'
                 f'"ts":"2026-05-01T{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}'
                 f'.{ms % 1000:03d}Z","temperature":{20 + i % 97 / 10:.2f},'
                 f'"humidity":{40 + i % 53 / 3:.2f},"battery":{100 - i % 89:.1f},"status":"ok"}}')
        while True:
            try:
                p.produce(settings.kafka.topic, key=dev.encode(), value=value.encode())
                break
            except BufferError:
                p.poll(0.1)
    if p.flush(120):
        raise RuntimeError("producer did not flush")


# ---- child: one Spark configuration ---------------------------------------------------------

def child(cfg: str, topics: list[str]) -> None:
    """Drain each topic through bronze and silver; print {topic: {rows, bronze_s, silver_s}}."""
    from spark_cpu import SparkCpuSampler

    from lakehouse.spark import spark_session
    from orchestration.backfill import backfill

    base = load_settings(cfg)
    jvm = spark_session(base)._jvm.java.lang.ProcessHandle.current().pid()
    out = {}
    for topic in topics:
        s = base.model_copy(deep=True)
        s.data_root = str(Path(base.data_root) / topic)
        s.kafka.topic = topic
        s.stream.topology = "layered"  # bronze and silver timed apart
        cpu = SparkCpuSampler(jvm).start() if jvm_is_local(base) else None
        t0 = time.perf_counter()
        done_b = backfill(s, ["bronze"])["bronze"]
        t1 = time.perf_counter()
        done_s = backfill(s, ["silver"])["silver"]
        t2 = time.perf_counter()
        split = cpu.stop() if cpu else None
        silver = DeltaTable(s.table_path("silver")).to_pyarrow_dataset().count_rows()
        out[topic] = {"rows": done_b, "silver_in": done_s, "silver_rows": silver,
                      "bronze_s": round(t1 - t0, 2), "silver_s": round(t2 - t1, 2),
                      **({"cpu": {"serial": split.serial, "parallel": split.parallel,
                                  **split.__dict__}} if split else {})}
        logging.info("%s: %s", topic, out[topic])
    print(json.dumps(out), flush=True)


def jvm_is_local(settings: Settings) -> bool:
    """Driver and executors in one JVM: its threads tell them apart (bench/spark_cpu.py)."""
    return settings.spark.master.startswith("local")


def run_child(settings: Settings, work: Path, name: str, topics: list[str]) -> dict:
    settings = settings.model_copy(deep=True)
    settings.data_root = str(work / "lake" / name)  # own tables and checkpoints per configuration
    cfg = settings.save(work / f"{name}.json")
    with open(work / f"{name}.log", "w") as err:
        p = subprocess.run([sys.executable, __file__, "--child", str(cfg), "--topics", ",".join(topics)],
                           stdout=subprocess.PIPE, stderr=err, text=True, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"{name} failed:\n{(work / f'{name}.log').read_text()[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--dedup", choices=("index", "state_store"), default=None,
                    help="silver's stream.dedup (default: the setting's): state_store keeps a "
                         "batch on the executors, index collects it to the driver")
    ap.add_argument("--on-paper", action="store_true",
                    help="only what the scale-out figures need: local[2] on 4 partitions "
                         "(after the warm-up), no 1-core or cluster runs")
    ap.add_argument("--child")
    ap.add_argument("--topics")
    ap.add_argument("--smoke", action="store_true",
                    help="a small run that checks the bench still works: local[1] and 4 partitions "
                         "only (the standalone cluster is tests/test_scaleout.py's)")
    args = ap.parse_args()
    partitions = (4,) if args.smoke or args.on_paper else PARTITIONS
    if args.smoke:
        args.messages, args.warmup = 2_000, 200
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    if args.child:
        child(args.child, args.topics.split(","))
        return

    work = Path(tempfile.mkdtemp(prefix="iotlake-bench-scaling-"))
    port = free_port(pair=True)  # the broker's controller listens on port + 1
    base = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(work / "lake"), kafka={"embedded_port": port},
                         observability={"metrics_port": 0})
    broker = kafka_service(base, port).start()
    try:
        s = base.model_copy(deep=True)
        s.kafka.bootstrap = base.kafka_bootstrap
        s.spark.driver_memory = "1g"
        if args.dedup:
            s.stream.dedup = args.dedup
        s.spark.shuffle_partitions = 4
        s.stream.max_offsets_per_trigger = max(args.messages, 1)
        s.stream.silver_max_files_per_trigger = 100_000  # one silver batch for the whole topic
        # the warm-up topic keeps JIT compilation out of the first measured configuration; a
        # smoke run measures nothing worth it
        topics = {**({} if args.smoke else {"warm": 4}), **{f"p{n}": n for n in partitions}}
        warm = [] if args.smoke else ["warm"]
        for topic, n in topics.items():
            t = s.model_copy(deep=True)
            t.kafka.topic, t.kafka.partitions = topic, n
            ensure_topics(t)
            produce(t, args.warmup if topic == "warm" else args.messages)
        logging.info("produced %d messages into each of %s", args.messages, list(topics))

        results: dict[str, dict] = {}
        for cores in (1,) if args.smoke else (2,) if args.on_paper else (1, 2):
            s.spark.master, s.spark.conf = f"local[{cores}]", {}
            r = run_child(s, work, f"local{cores}", [*warm, *(f"p{n}" for n in partitions)])
            for n in partitions:
                results[f"local{cores}_p{n}"] = r[f"p{n}"]
        for workers in () if args.smoke or args.on_paper else (1, 2):
            with StandaloneCluster(workers=workers, cores=1, memory="1g",
                                   work_dir=work / f"cluster{workers}") as c:
                s.spark.master, s.spark.conf = c.master_url, cluster_conf("768m", cores_max=workers)
                r = run_child(s, work, f"cluster{workers}w", [*warm, "p4"])
            results[f"cluster_{workers}w_p4"] = r["p4"]
    finally:
        broker.stop()

    for name, r in results.items():
        assert r["rows"] == args.messages == r["silver_rows"], (name, r)
    rate = {f"{k}_rows_per_s": {"bronze": round(r["rows"] / r["bronze_s"]),
                               "silver": round(r["rows"] / r["silver_s"]),
                               "bronze_silver": round(r["rows"] / (r["bronze_s"] + r["silver_s"]))}
            for k, r in results.items()}

    def e2e(k: str) -> float:
        return rate[f"{k}_rows_per_s"]["bronze_silver"]

    shutil.rmtree(work, ignore_errors=True)
    speedups = {} if args.smoke or args.on_paper else {
        "speedup_2x": round(e2e("cluster_2w_p4") / e2e("cluster_1w_p4"), 2),
        "speedup_local2_over_local1_p4": round(e2e("local2_p4") / e2e("local1_p4"), 2),
        "speedup_p4_over_p1_local2": round(e2e("local2_p4") / e2e("local2_p1"), 2)}
    print(json.dumps({"messages": args.messages, "dedup": s.stream.dedup, **rate, **speedups,
                      **on_paper(results)}))


def on_paper(results: dict[str, dict]) -> dict:
    """What limits scale: driver (serial) and executor (parallel) CPU-seconds per million rows of
    Kafka -> bronze -> silver, from the widest local run on 4 partitions, and Amdahl's law."""
    name = "local2_p4" if "local2_p4" in results else "local1_p4"
    r = results[name]
    per_m = 1e6 / r["rows"]
    threads = r["cpu"].pop("driver_threads", [])
    cpu = {k: v * per_m for k, v in r["cpu"].items()}
    d, e = cpu["serial"], cpu["parallel"]

    def amdahl(n: int) -> float:
        return round((d + e) / (d + e / n), 2)

    return {"driver_cpu_s_per_m": round(d, 1), "executor_cpu_s_per_m": round(e, 1),
            "predicted_speedup_8": amdahl(8), "predicted_speedup_32": amdahl(32),
            "cpu_measured_on": name,
            "cpu_s_per_m": {k: round(v, 1) for k, v in cpu.items() if k not in ("serial", "parallel")},
            "driver_threads_cpu_s_per_m": {k: round(v * per_m, 1) for k, v in threads[:6]}}


if __name__ == "__main__":
    main()
