"""Benchmark: silver throughput with the expectation suite and without it (``validate=False``).

Builds a bronze table of N rows (~150-byte payloads, 1% duplicates, 1% invalid) in C commits of
one file each (written with delta-rs), then runs silver over it
twice in one Spark session (fresh checkpoints, trigger available_now), after both variants warmed
the JVM up on a small separate bronze table (so neither profits from running second). Steady
state: the sum of numInputRows over the sum of durationMs.triggerExecution of every batch after
the first (the first pays state store creation). Each run's quality-log counters are checked
against the generated data to the row. The session is a batch process's, as `iotlake backfill`
runs (``spark.expression_codegen``; the JSON's ``codegen`` says which mode ran). The same
bronze then goes through Spark and Delta alone (``rows_per_s_floor``: ``from_json`` into the
model's typed fields, appended as iotlake appends; no checks, dedup or quarantine): the most this stack
gives on this machine, and ``ratio_to_floor`` how much of it silver keeps. Last line: one JSON
object.

    .venv/bin/python bench/silver_throughput.py [--rows 1000000] [--commits 10] [--files-per-batch 2]

``--profile sparkplug``: Sparkplug B DDATA with 5 metrics by alias (edge nodes of 10 devices,
births in the first commit), and the sensor's JSON readings in the same session for
``ratio_to_json`` (Sparkplug readings/s over JSON's, both with validation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from fleets import SENSOR, example  # bench/ is on sys.path
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

import silver.stream
from ingest.simulator import ModelPayloads, device_topic, drop_field, encode, set_field
from lakehouse.delta import tables as delta_tables
from lakehouse.delta.read import read_table
from lakehouse.settings import Settings, load_settings
from lakehouse.spark import spark_session
from lakehouse.tables import BRONZE
from lakehouse.telemetry import TelemetryModel
from silver.default_suite import default_suite
from silver.parse import topic_device

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PARTITIONS = 4
_INVALID = (  # (what, payload fields replaced): each fails the default suite or parsing
    ("range", {"temperature": "130.5"}), ("blank_in_id", {"device_id": '"dev 1"'}),
    ("long_id", {"device_id": '"' + "d" * 200 + '"'}), ("type", {"humidity": '"wet"'}),
    ("no_id", {"event_id": None}), ("not_json", None),
)


def _payload(i: int, rng: random.Random, over: dict | None = None, step_ms: float = 10) -> bytes:
    fields = {"schema_version": "1", "device_id": f'"dev-{i % 1000 + 1:05d}"',
              "event_id": f'"{rng.getrandbits(128):032x}"',
              "ts": f'"{(T0 + timedelta(milliseconds=step_ms * i)).isoformat(timespec="milliseconds")[:23]}Z"',
              "temperature": f"{rng.uniform(15, 30):.2f}", "humidity": f"{rng.uniform(30, 70):.2f}",
              "battery": f"{rng.uniform(20, 100):.2f}", "status": '"ok"'}
    fields.update(over or {})
    return ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items() if v is not None) + "}").encode()


#: ``--profile``: whose readings the bronze table holds: an example fleet's (``examples/``),
#: or Sparkplug B's.
PROFILES = ("sensor", "pump", "sparkplug")
#: the Sparkplug profile's metrics (Sparkplug names -> silver columns), each in [0, 100]
SPARKPLUG_METRICS = [{"name": f"m{k}", "path": f"Line/Metric {k}", "min": 0.0, "max": 100.0} for k in range(1, 6)]


def profile_model(name: str) -> TelemetryModel:
    if name == "sparkplug":
        return TelemetryModel(sparkplug=True, metrics=SPARKPLUG_METRICS)
    return example(name)


class SparkplugBronze:
    """Edge nodes of 10 devices: NBIRTH and DBIRTHs (5 metrics with aliases) first, then DDATA
    by alias; invalid ones use an alias no birth declared or a value out of range."""

    def __init__(self, devices: int = 1000, per_node: int = 10) -> None:
        from lakehouse.mqtt.sparkplug import payload_class

        self.cls, self.per_node, self.devices = payload_class(), per_node, devices
        self.nodes = -(-devices // per_node)
        self.seq = [0] * self.nodes
        self.t0_ms = int(T0.timestamp() * 1000)

    def _encode(self, node: int, ts: int, metrics: list[dict]) -> bytes:
        p = self.cls(timestamp=ts, seq=self.seq[node])
        self.seq[node] = (self.seq[node] + 1) % 256
        for m in metrics:
            p.metrics.add(timestamp=ts, datatype=10, **m)
        return p.SerializeToString()

    def births(self) -> list[tuple[int, bytes, bytes]]:
        """(node, topic, payload) of every birth, nodes first."""
        out = []
        for n in range(self.nodes):
            out.append((n, f"spBv1.0/bench/NBIRTH/node-{n}".encode(), self._encode(n, self.t0_ms, [])))
            for d in range(n * self.per_node, min(self.devices, (n + 1) * self.per_node)):
                metrics = [{"name": m["path"], "alias": 1 + d * 5 + k, "double_value": 50.0}
                           for k, m in enumerate(SPARKPLUG_METRICS)]
                out.append((n, f"spBv1.0/bench/DBIRTH/node-{n}/dev-{d}".encode(), self._encode(n, self.t0_ms, metrics)))
        return out

    def data(self, i: int, rng: random.Random, step_ms: float, invalid: int | None = None) -> tuple[int, bytes, bytes]:
        d = i % self.devices
        n = d // self.per_node
        values = [rng.uniform(10, 90) for _ in SPARKPLUG_METRICS]
        alias0 = 1 + d * 5
        if invalid is not None and invalid % 2:
            alias0 = 10_000_000  # no birth declared it: unknown_alias
        elif invalid is not None:
            values[0] = 150.0  # out of range: the suite fails it
        metrics = [{"alias": alias0 + k, "double_value": round(v, 3)} for k, v in enumerate(values)]
        ts = self.t0_ms + int(step_ms * i) + 1
        return n, f"spBv1.0/bench/DDATA/node-{n}/dev-{d}".encode(), self._encode(n, ts, metrics)


def build_sparkplug_bronze(path: str, rows: int, commits: int, seed: int = 0,
                           step_ms: float = 10) -> Counter[str]:
    """The Sparkplug profile's bronze table: births, then ``rows`` DDATA (1% re-sent, 1% invalid);
    a node's messages in one partition, in order. Returns the expected silver accounting."""
    rng = random.Random(seed)
    gen = SparkplugBronze()
    kinds = ["dup"] * (rows // 100) + ["bad"] * (rows // 100)
    kinds += ["ok"] * (rows - len(kinds))
    rng.shuffle(kinds)
    kinds[0] = "ok"
    msgs = gen.births()
    n_births = len(msgs)
    valid: list[int] = []
    for i, kind in enumerate(kinds):
        if kind == "dup":
            msgs.append(msgs[valid[-1 - rng.randrange(min(len(valid), 5000))]])
            continue
        msgs.append(gen.data(i, rng, step_ms, invalid=i if kind == "bad" else None))
        if kind == "ok":
            valid.append(len(msgs) - 1)
    offsets = [0] * PARTITIONS
    per_commit = -(-len(msgs) // commits)
    now = datetime.now(UTC)
    for c in range(commits):
        part = msgs[c * per_commit:(c + 1) * per_commit]
        parts, offs = [], []
        for node, _, _ in part:
            p = node % PARTITIONS
            parts.append(p)
            offs.append(offsets[p])
            offsets[p] += 1
        n = len(part)
        write_deltalake(path, pa.table({
            "key": pa.nulls(n, pa.binary()), "value": [m[2] for m in part], "topic": ["telemetry"] * n,
            "partition": pa.array(parts, pa.int32()), "offset": pa.array(offs, pa.int64()),
            "timestamp": [now] * n, "headers": [[{"key": "mqtt_topic", "value": m[1]}] for m in part],
            "ingest_time": [now] * n}, schema=BRONZE), mode="append")
    k = Counter(kinds)
    return Counter(rows_in=len(msgs), silver=k["ok"] + n_births, quarantine=k["bad"],
                   duplicates=k["dup"], late=0)


class ModelBronze:
    """Payloads of any telemetry model (the simulator's), with invalid ones that fail parsing
    or the model's generated suite."""

    def __init__(self, model: TelemetryModel, rng: random.Random, step_ms: float) -> None:
        self.model, self.step_us = model, int(step_ms * 1000)
        self.settings = load_settings(environ={}, telemetry=model.model_dump())
        self.gen = ModelPayloads(model, rng, 1000)
        self.t0_us = int(T0.timestamp() * 1_000_000)
        ranged = next(m for m in model.metrics if m.max is not None)
        self.invalid = (("range", ranged.source, ranged.max + 1), ("type", model.metrics[0].source, "x"),
                        ("no_ts", model.event_time_path, None), ("not_json", None, None))

    def topic(self, i: int) -> bytes:
        """The MQTT topic (the bridge's ``mqtt_topic`` header) of reading ``i``'s device."""
        d = i % 1000
        return device_topic(self.settings, self.gen.ids[d], d).encode()

    def payload(self, i: int, invalid: int | None = None) -> bytes:
        rec, _ = self.gen.record(i % 1000, self.t0_us + i * self.step_us)
        if invalid is not None:
            what, path, value = self.invalid[invalid % len(self.invalid)]
            if what == "not_json":
                return b"\xffnot json"
            if value is None:
                drop_field(rec, path)
            else:
                set_field(rec, path, value)
        return encode(rec)


def build_bronze(path: str, rows: int, commits: int, seed: int = 0, step_ms: float = 10,
                 model: TelemetryModel | None = None) -> Counter[str]:
    """Write the bronze table (event times ``step_ms`` apart); returns the expected silver
    accounting. ``model``: payloads of that telemetry model instead of the example sensor's."""
    if model is not None and model.sparkplug:
        return build_sparkplug_bronze(path, rows, commits, seed, step_ms)
    rng = random.Random(seed)
    shaped = ModelBronze(model, rng, step_ms) if model is not None and model != SENSOR else None
    kinds = ["dup"] * (rows // 100) + ["bad"] * (rows // 100)
    kinds += ["ok"] * (rows - len(kinds))
    rng.shuffle(kinds)
    kinds[0] = "ok"
    payloads: list[bytes] = []
    headers: list[list[dict]] = []
    valid: list[int] = []  # positions of valid events, for duplicates to re-send
    for i, kind in enumerate(kinds):
        if kind == "dup":  # a re-send of a recent event (within ~50 s of event time)
            j = valid[-1 - rng.randrange(min(len(valid), 5000))]
            payloads.append(payloads[j])
            headers.append(headers[j])
            continue
        headers.append([{"key": "mqtt_topic", "value": shaped.topic(i)}] if shaped else [])
        if kind == "bad":
            if shaped is not None:
                payloads.append(shaped.payload(i, invalid=i))
            else:
                _, over = _INVALID[i % len(_INVALID)]
                payloads.append(b"\xffnot json" if over is None else _payload(i, rng, over, step_ms))
        else:
            payloads.append(shaped.payload(i) if shaped is not None else _payload(i, rng, step_ms=step_ms))
            valid.append(i)
    per_commit = -(-rows // commits)
    now = datetime.now(UTC)
    for c in range(commits):
        idx = range(c * per_commit, min(rows, (c + 1) * per_commit))
        n = len(idx)
        write_deltalake(path, pa.table({
            "key": pa.nulls(n, pa.binary()), "value": [payloads[i] for i in idx],
            "topic": ["telemetry"] * n, "partition": pa.array([i % PARTITIONS for i in idx], pa.int32()),
            "offset": pa.array([i // PARTITIONS for i in idx], pa.int64()),
            "timestamp": [now] * n, "headers": [headers[i] for i in idx], "ingest_time": [now] * n,
        }, schema=BRONZE), mode="append")
    n = Counter(kinds)
    return Counter(rows_in=rows, silver=n["ok"], quarantine=n["bad"], duplicates=n["dup"], late=0)


def counters(settings: Settings) -> Counter[str]:
    t = read_table(settings.table_path("quality_log"), columns=["kind", "expectation", "details"])
    out: Counter[str] = Counter()
    for r in t.to_pylist():
        if r["kind"] == "counter":
            out[r["expectation"]] += json.loads(r["details"])["count"]
    return out


def batch_rows_in(settings: Settings) -> dict[int, int]:
    """Bronze rows each silver batch read (its ``rows_in`` counter), by batch id."""
    t = read_table(settings.table_path("quality_log"), columns=["kind", "expectation", "batch_id", "details"])
    return {r["batch_id"]: json.loads(r["details"])["count"] for r in t.to_pylist()
            if r["kind"] == "counter" and r["expectation"] == "rows_in"}


def tree_cpu(pid: int) -> float:
    """CPU seconds used by ``pid`` and its descendants (the JVM and its Python workers): the
    machine may be shared, so wall-clock rows/s alone can mislead."""
    parents, used = {}, {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            f = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(p.name)] = int(f[1])
        used[int(p.name)] = sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")
    total, frontier = used.get(pid, 0.0), {pid}
    while frontier:
        frontier = {q for q, parent in parents.items() if parent in frontier}
        total += sum(used[q] for q in frontier)
    return total


def run_silver(spark, settings: Settings, bronze: str, validate: bool) -> dict:
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    cpu0 = tree_cpu(pid) + time.process_time()
    t0 = time.monotonic()
    q = silver.stream.start(spark, settings, trigger="available_now", validate=validate,
                            bronze_path=bronze)
    q.awaitTermination()
    wall = time.monotonic() - t0
    cpu = tree_cpu(pid) + time.process_time() - cpu0
    progress = q.recentProgress
    first = next(p["batchId"] for p in progress if p["numInputRows"] > 0)
    steady = [p for p in progress if p["batchId"] > first]  # no-data batches included
    # bronze rows per batch from the quality log (Spark's numInputRows counts each scan of the
    # source: the Sparkplug profile's plan reads a batch twice, JSON and Sparkplug branches)
    per_batch = batch_rows_in(settings)
    rows = sum(per_batch.get(p["batchId"], 0) for p in steady)
    ms = sum(p["durationMs"]["triggerExecution"] for p in steady)
    parts: Counter[str] = Counter()
    for p in steady:
        parts.update({k: v for k, v in p["durationMs"].items() if k != "triggerExecution"})
    return {"batches": len(progress), "steady_rows": rows, "steady_ms": ms,
            "rows_per_s": rows / (ms / 1000) if ms else None, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "rows_per_cpu_s": round(sum(per_batch.values()) / cpu),
            "ms_parts": dict(parts)}


def payload_struct(model: TelemetryModel) -> StructType:
    """The model's payload as one nested struct (metrics typed, every other field a string):
    what Spark's ``from_json`` needs to parse it in one pass."""
    tree: dict = {}
    typed = {m.source: (LongType() if m.type == "long" else DoubleType()) for m in model.metrics}
    paths = [model.device_id_path, model.event_id_path, model.event_time_path, model.status_path,
             model.schema_version_path, *typed]
    for path in filter(None, paths):
        *parents, leaf = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = typed.get(path, StringType())

    def struct(node: dict) -> StructType:
        return StructType([StructField(k, struct(v) if isinstance(v, dict) else v) for k, v in node.items()])
    return struct(tree)


def event_time(raw, fmt: str):
    """The event time as the model's format gives it (``auto``: ISO-8601 only, as most fleets
    send it)."""
    units = {"epoch_s": 1_000_000, "epoch_ms": 1_000, "epoch_us": 1}
    if fmt in units:
        return F.timestamp_micros((raw.cast("double") * units[fmt]).cast("long"))
    return F.try_to_timestamp(raw)


def floor_query(df, settings: Settings, name: str):
    """A floor's stream, appended as iotlake appends (``delta_tables.append``: Delta's transaction
    API, exactly once per batch; less per batch than Delta's own streaming sink), available-now."""
    path = settings.table_path(name)
    delta_tables.ensure_table(df.sparkSession, path, df.schema)
    return (df.writeStream.outputMode("append").trigger(availableNow=True)
            .foreachBatch(lambda batch, i: delta_tables.append(batch, path, name, i))
            .option("checkpointLocation", settings.checkpoint_path(name)).start())


def run_floor(spark, settings: Settings, bronze: str) -> dict:
    """Spark and Delta alone over the same bronze batches: ``from_json`` into the model's typed
    fields, the event time parsed, the device id from the topic where the model puts it there, the
    Kafka coordinates kept, appended as iotlake appends
    (``delta_tables.append``). No checks, dedup, quarantine or quality log: the least any silver
    on this stack does per row."""
    model = settings.telemetry
    p = F.from_json(F.col("value").cast("string"), payload_struct(model)).alias("p")
    topic = topic_device(model)[0]  # the device id from the MQTT topic, where the model says so
    topic = F.lit(None).cast("string") if topic is None else topic

    def at(path: str):
        return F.col("p." + path) if path else F.lit(None)
    rows = (silver.stream.bronze_stream(spark, settings, bronze)  # as silver reads it
            .select(p, topic.alias("topic_device"), F.col("partition").alias("kafka_partition"),
                    F.col("offset").alias("kafka_offset"), "ingest_time")
            .select(at(model.event_id_path).alias("event_id"),
                    (at(model.device_id_path) if model.device_id_path else F.col("topic_device")).alias("device_id"),
                    event_time(F.col("p." + model.event_time_path), model.event_time_format).alias("event_time"),
                    *(at(m.source).alias(m.name) for m in model.metrics),
                    at(model.status_path).alias("status"), "kafka_partition", "kafka_offset", "ingest_time"))
    t0 = time.monotonic()
    q = floor_query(rows, settings, "floor")
    q.awaitTermination()
    progress = q.recentProgress
    first = next(p["batchId"] for p in progress if p["numInputRows"] > 0)
    steady = [p for p in progress if p["batchId"] > first]
    rows_n = sum(p["numInputRows"] for p in steady)
    ms = sum(p["durationMs"]["triggerExecution"] for p in steady)
    return {"batches": len(progress), "steady_rows": rows_n, "steady_ms": ms,
            "rows_per_s": rows_n / (ms / 1000) if ms else None, "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--commits", type=int, default=10)
    ap.add_argument("--files-per-batch", type=int, default=2,
                    help="stream.silver_max_files_per_trigger (one bronze commit = one file here)")
    ap.add_argument("--shuffle-partitions", type=int, default=2)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark conf (repeatable), e.g. to try a state store setting")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="sensor",
                    help="whose readings: an example fleet's (examples/*.toml) or Sparkplug B's")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.commits, args.files_per_batch = 2_000, 2, 1

    root = Path(tempfile.mkdtemp(prefix="iotlake-silver-bench-"))
    model = profile_model(args.profile)
    suite = root / "suite.json"  # the model's generated suite
    suite.write_text(json.dumps(default_suite(model)))
    try:
        def settings(name: str) -> Settings:
            return load_settings(environ={}, data_root=str(root / name), stream={"watermark_seconds": 600, "silver_max_files_per_trigger": args.files_per_batch,
                                                 "silver_max_bytes_per_trigger": 0},
                                 spark={"master": args.master, "shuffle_partitions": args.shuffle_partitions,
                                        "conf": dict(c.split("=", 1) for c in args.conf)},
                                 telemetry={**model.model_dump(), "suite": str(suite)})

        bronze = settings("bronze").table_path("bronze")
        t0 = time.monotonic()
        expected = build_bronze(bronze, args.rows, args.commits, model=model)
        built = time.monotonic() - t0
        warm = settings("warm_bronze").table_path("bronze")
        # at least two micro-batches, so the warm-up has a steady part too
        build_bronze(warm, min(args.rows, 2 * args.rows // args.commits), 2 * args.files_per_batch,
                     seed=1, model=model)
        spark = spark_session(settings("spark"), app_name="iotlake-silver-bench", batch=True)
        for validate in () if args.smoke else (True, False):  # a smoke run measures nothing
            run_silver(spark, settings(f"warm_{validate}"), warm, validate)
        if not args.smoke and not model.sparkplug:
            run_floor(spark, settings("warm_floor"), warm)
        runs = {}
        variants = [("with_validation", True), ("without", False)]
        if model.sparkplug:  # the sensor's JSON readings, same session, for ratio_to_json
            json_bronze = settings("json_bronze").table_path("bronze")
            json_expected = build_bronze(json_bronze, args.rows, args.commits)
            variants.append(("json", True))
        else:
            variants.append(("floor", False))
        for name, validate in variants:
            s = settings(name)
            if name == "floor":
                runs[name] = run_floor(spark, s, bronze)
                print(name, json.dumps(runs[name]), flush=True)
                continue
            if name == "json":
                s = s.model_copy(update={"telemetry": SENSOR})
                runs[name] = run_silver(spark, s, json_bronze, True)
                assert counters(s) == json_expected, f"json: accounting {dict(counters(s))}"
                print(name, json.dumps(runs[name]), flush=True)
                continue
            runs[name] = run_silver(spark, s, bronze, validate)
            got = counters(s)
            if validate:
                assert got == expected, f"{name}: accounting {dict(got)} != expected {dict(expected)}"
            else:  # without the suite only unparseable rows are quarantined
                assert got["rows_in"] == expected["rows_in"] and got["duplicates"] == expected["duplicates"], got
            print(name, json.dumps(runs[name]), flush=True)
        codegen = spark.conf.get("spark.sql.codegen.factoryMode")
        spark.stop()
        with_v, without = runs["with_validation"]["rows_per_s"], runs["without"]["rows_per_s"]
        print(json.dumps({"bronze_build_s": round(built, 1), "files_per_batch": args.files_per_batch,
                          "shuffle_partitions": args.shuffle_partitions, "conf": args.conf,
                          "load_avg_1m": os.getloadavg()[0]}))
        print(json.dumps({"rows": args.rows, "profile": args.profile, "codegen": codegen,
                          "rows_per_s_with_validation": round(with_v),
                          "rows_per_s_without": round(without),
                          "overhead_ratio": round(without / with_v, 3),
                          **({"rows_per_s_json": round(runs["json"]["rows_per_s"]),
                              "ratio_to_json": round(with_v / runs["json"]["rows_per_s"], 3)}
                             if "json" in runs else {}),
                          **({"rows_per_s_floor": round(runs["floor"]["rows_per_s"]),
                              "ratio_to_floor": round(with_v / runs["floor"]["rows_per_s"], 3)}
                             if "floor" in runs else {})}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
