"""End-to-end latency: MQTT publish -> readable in silver, and -> reflected in device_current.

Runs ``iotlake run`` (embedded Mosquitto + Apache Kafka, bridge, all streams) and ``iotlake simulate
--rate RATE`` as child processes for ``--seconds``; meanwhile this script publishes sampled probe readings (device
``dev-99999``, event time = publish time) and watches the Delta logs: a probe is "in silver"
when a committed silver version contains its event_id, and "in device_current" when the
table's row for the probe device has ``last_seen`` >= the probe's time. Probes start after
``--warmup`` and gold health's first committed batch (at most 180 s more; a short run would
otherwise end before gold's cold first batch and measure nothing), and the run waits for the last ones to reach
both tables (at most 60 s). Last line: one JSON
object with ``silver_p50_s``, ``silver_p99_s``, ``current_p99_s``, ``events`` and the trigger
settings used. ``--rates 0,200,1000,5000`` runs once per rate (a fresh data root each) and ends with
``cores_idle``, ``cores_<rate>``, ``silver_p50_s_<rate>``, ``silver_p99_s_<rate>``,
``current_p50_s_<rate>``, ``current_p99_s_<rate>`` and ``achieved_<rate>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleets import SENSOR  # noqa: E402
from procs import IOTLAKE, by_role, stop_now  # noqa: E402  (bench/ is on sys.path)

from ingest.mqtt_client import mqtt_client  # noqa: E402
from lakehouse.delta.read import commit_adds, latest_version  # noqa: E402
from lakehouse.settings import load_settings  # noqa: E402
from lakehouse.spark import shuffle_partitions  # noqa: E402
from orchestration.services import free_port  # noqa: E402

PROBE = "dev-99999"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=5000)
    ap.add_argument("--devices", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=150,
                    help="seconds of each run, the warm-up included (probes: the rest)")
    ap.add_argument("--warmup", type=float, default=30,
                    help="seconds before sampling starts (and at least until gold health's "
                         "first batch has committed)")
    ap.add_argument("--probe-rate", type=float, default=5, help="probe readings per second")
    ap.add_argument("--trigger-seconds", type=float, default=0.5)
    ap.add_argument("--gold-trigger-seconds", type=float, default=3,
                    help="gold device health's trigger interval (<0: --trigger-seconds)")
    ap.add_argument("--windows-trigger-seconds", type=float, default=10,
                    help="gold window aggregates' trigger interval (<0: gold's)")
    ap.add_argument("--stream", action="append", default=[], metavar="KEY=VALUE",
                    help="any other stream setting, e.g. min_offsets_per_trigger=1000 (repeatable)")
    ap.add_argument("--simulator-nice", type=int, default=0,
                    help="run the simulator (the devices' stand-in) at this nice level; the "
                         "achieved rate is printed either way")
    ap.add_argument("--shuffle-partitions", type=int, default=0,
                    help="spark.shuffle_partitions (state store partitions; 0: the setting's default)")
    ap.add_argument("--smoke", action="store_true",
                    help="a short run at a low rate that checks the bench still works")
    ap.add_argument("--rates", default="",
                    help="comma-separated rates, one run each (0: the pipeline with no data "
                         "flowing); the last line then has cores_<rate> and the latencies at "
                         "1000 and 5000 events/s")
    args = ap.parse_args()
    args.stream = dict(kv.split("=", 1) for kv in args.stream)
    if args.smoke:
        args.rate, args.devices, args.seconds, args.warmup, args.probe_rate = 50, 10, 8, 2, 2
        args.rates = "50"
    if args.seconds <= args.warmup:  # no probe would be published: every latency null
        ap.error(f"--seconds ({args.seconds:g}) includes --warmup ({args.warmup:g}): give more "
                 f"seconds than warm-up, e.g. --seconds {args.warmup + 60:g}")
    if not args.rates:
        print(json.dumps(run_once(args, args.rate)))
        return
    runs = {}
    for rate in (float(r) for r in args.rates.split(",")):
        runs[rate] = run_once(args, rate)
        print(f"# rate {rate:g}: {json.dumps(runs[rate])}", flush=True)
    print(json.dumps(summary(runs)))


def summary(runs: dict[float, dict]) -> dict:
    """The issue's figures from one run per rate: cores of ``iotlake run`` itself per rate
    (``cores_idle`` at 0) and of the whole machine (``cores_machine_<rate>``: others' work
    too), silver and device_current p50 / p99 and the simulator's achieved rate at each rate
    with data."""
    out: dict = {}
    for rate, r in runs.items():
        key = "idle" if rate == 0 else f"{rate:g}"
        out[f"cores_{key}"] = r["cores_iotlake"]
        out[f"cores_machine_{key}"] = r["cores_machine"]
        if rate > 0:
            out[f"silver_p50_s_{key}"] = r["silver_p50_s"]
            out[f"silver_p99_s_{key}"] = r["silver_p99_s"]
            out[f"current_p50_s_{key}"] = r["current_p50_s"]
            out[f"current_p99_s_{key}"] = r["current_p99_s"]
            out[f"achieved_{key}"] = r["achieved_rate"]
    return {**out, "load": os.getloadavg()[0]}


def run_once(args: argparse.Namespace, rate: float) -> dict:
    """One ``iotlake run`` with the simulator at ``rate`` (none at 0) and probes (none at 0)."""
    spark_opts = {"shuffle_partitions": args.shuffle_partitions} if args.shuffle_partitions else {}

    root = Path(tempfile.mkdtemp(prefix="iotlake-e2e-"))
    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root / "lake"),
                             kafka={"embedded_port": free_port(pair=True)}, mqtt={"embedded_port": free_port()},
                             stream={"trigger_seconds": args.trigger_seconds,
                                     "gold_trigger_seconds": args.gold_trigger_seconds,
                                     "windows_trigger_seconds": args.windows_trigger_seconds,
                                     **args.stream},
                             observability={"metrics_port": 0}, spark=spark_opts)
    cfg = settings.save(root / "settings.json")
    env = {**os.environ, "IOTLAKE_CONFIG": str(cfg)}
    # The devices are a separate process, as real ones are: a simulator thread inside `iotlake run`
    # would share the GIL with the bridge and the streams' driver-side Python.
    child = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "run"], env=env,
                             stdout=open(root / "run.log", "w"), stderr=subprocess.STDOUT)
    sim: subprocess.Popen | None = None
    sim_start = sim_seconds = 0.0
    sample_from = time.time()
    published: dict[str, float] = {}
    silver_seen: dict[str, float] = {}
    current_seen: dict[str, float] = {}
    stop = threading.Event()
    try:
        _wait(lambda: Path(settings.table_path("silver"), "_delta_log").exists() and child.poll() is None,
              120, "pipeline start")
        nice = ["nice", "-n", str(args.simulator_nice)] if args.simulator_nice else []
        if rate > 0:
            sim = subprocess.Popen([*nice, sys.executable, "-m", "orchestration.cli", "simulate",
                                    "--rate", str(rate), "--devices", str(args.devices)], env=env,
                                   stdout=open(root / "simulate.log", "w"), stderr=subprocess.STDOUT)
        sim_start = time.monotonic()
        time.sleep(args.warmup)
        if rate > 0:  # a first batch (planning, code generation) is no steady-state latency
            # not required: a pipeline that falls behind (a rate the cores cannot keep) is a
            # figure too, and the other rates' runs are not lost
            _wait(lambda: any(Path(settings.checkpoint_path("gold_health"), "commits").glob("[0-9]*")),
                  180, "gold health's first batch", required=False)
        sample_from = time.time()
        cpu_from, busy_from = _cpu_by_role(), _machine_busy_s()
        watcher = threading.Thread(target=_watch, args=(settings, published, silver_seen, current_seen, stop))
        watcher.start()
        if rate > 0:
            _probe(settings, published, args.probe_rate, args.seconds - args.warmup)
        else:  # no data flowing: what the pipeline costs while it waits
            time.sleep(args.seconds - args.warmup)
        # let the last probes arrive: until every one is in both tables, or the drain time is up
        # (the smoke's is longer: its numbers are checked, and on a machine others keep busy its
        # few probes took over 30 s)
        deadline = time.monotonic() + (120 if args.smoke else 60)
        while (min(len(silver_seen), len(current_seen)) < len(published)
               and time.monotonic() < deadline and child.poll() is None):
            time.sleep(0.2)
        stop.set()
        watcher.join()
        cpu_to, busy_to = _cpu_by_role(), _machine_busy_s()
        cores = {r: round((cpu_to[r] - cpu_from.get(r, 0.0)) / (time.time() - sample_from), 2)
                 for r in cpu_to}
        machine = round((busy_to - busy_from) / (time.time() - sample_from), 2)
    finally:
        if sim is not None:
            sim.send_signal(signal.SIGINT)
            sim.wait(30)
            sim_seconds = time.monotonic() - sim_start
        if not stop_now(child):
            child.kill()
    lat_s = np.array([silver_seen[e] - published[e] for e in published if e in silver_seen])
    lat_c = np.array([current_seen[e] - published[e] for e in published if e in current_seen])
    result = {
        "events": len(published), "rate": rate, "devices": args.devices,
        "silver_seen": int(lat_s.size), "current_seen": int(lat_c.size),
        "silver_p50_s": round(float(np.percentile(lat_s, 50)), 3) if lat_s.size else None,
        "silver_p99_s": round(float(np.percentile(lat_s, 99)), 3) if lat_s.size else None,
        "current_p50_s": round(float(np.percentile(lat_c, 50)), 3) if lat_c.size else None,
        "current_p99_s": round(float(np.percentile(lat_c, 99)), 3) if lat_c.size else None,
        "achieved_rate": _achieved_rate(root / "simulate.log", sim_seconds) if rate > 0 else 0,
        "trigger_seconds": args.trigger_seconds, "gold_trigger_seconds": args.gold_trigger_seconds,
        "windows_trigger_seconds": args.windows_trigger_seconds, "simulator_nice": args.simulator_nice,
        "stream": args.stream,
        "shuffle_partitions": shuffle_partitions(settings),
        "cores_iotlake": round(sum(v for r, v in cores.items() if r in IOTLAKE), 2),
        "cores_machine": machine,
        "load": os.getloadavg()[0],
    }
    for name, parts in _batch_profile(settings, sample_from).items():
        print(f"# {name}: {json.dumps(parts)}")
    print(f"# cores used while sampling: {json.dumps(cores)}; the machine's: {machine}")
    shutil.rmtree(root, ignore_errors=True)  # ~90 MB of tables and logs per run
    return result



def _achieved_rate(log: Path, seconds: float) -> float | None:
    """Messages the simulator published per second (its last log line) over its whole run."""
    import re

    found = re.findall(r"simulator published (\d+) messages", log.read_text(errors="replace"))
    return round(int(found[-1]) / seconds) if found else None


def _batch_profile(settings, since: float) -> dict[str, dict]:
    """Median rows and duration parts (ms) per query over the sampled period, from
    ``pipeline_metrics``: where a reading's time goes."""
    from deltalake import DeltaTable

    path = settings.table_path("pipeline_metrics")
    if not Path(path, "_delta_log").exists():
        return {}
    t = DeltaTable(path).to_pyarrow_table(
        columns=["query_name", "timestamp", "num_input_rows", "duration_ms"]).to_pylist()
    out: dict[str, dict] = {}
    for name in sorted({r["query_name"] for r in t}):
        rows = [r for r in t if r["query_name"] == name and r["timestamp"].timestamp() >= since]
        if not rows:
            continue
        parts: dict[str, list[float]] = {}
        for r in rows:
            for k, v in json.loads(r["duration_ms"]).items():
                parts.setdefault(k, []).append(v)
        out[name] = {"batches": len(rows),
                     "rows_p50": float(np.median([r["num_input_rows"] for r in rows])),
                     **{k: float(np.median(v)) for k, v in sorted(parts.items())}}
    return out


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this script and every process it started (``iotlake run``, its
    JVM and brokers, the simulator), summed by role (``other``: this script). Not the whole
    machine's: another user's Spark JVM would count as iotlake's, and one that exits while
    sampling would subtract its CPU."""
    return {role: v["cpu_s"] for role, v in by_role([os.getpid()]).items()}


def _machine_busy_s() -> float:
    """CPU seconds the machine's cores have been busy (``/proc/stat``: all but idle and
    iowait): with ``cores_iotlake``, what else ran while sampling."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _wait(pred, timeout: float, what: str, required: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.5)
    if required:
        raise SystemExit(f"timed out waiting for {what}")
    print(f"# timed out waiting for {what}: sampling anyway", flush=True)
    return False


def _probe(settings, published: dict[str, float], rate: float, seconds: float) -> None:
    host, port = settings.mqtt_endpoint
    c = mqtt_client(settings, f"probe-{uuid.uuid4().hex[:6]}")  # the simulator's credential
    c.connect(host, port)
    c.loop_start()
    topic = settings.mqtt.topic_filter.replace("+", PROBE)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        eid = uuid.uuid4().hex
        now = time.time()
        payload = {"schema_version": 1, "device_id": PROBE, "event_id": eid,
                   "ts": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                   "temperature": 21.0, "humidity": 40.0, "battery": 90.0, "status": "ok"}
        published[eid] = now
        c.publish(topic, json.dumps(payload), qos=1)
        time.sleep(1.0 / rate)
    c.loop_stop()
    c.disconnect()


def _watch(settings, published, silver_seen, current_seen, stop: threading.Event) -> None:
    silver = settings.table_path("silver")
    current = settings.table_path("device_current")
    seen_v = latest_version(silver)
    cur_v = -1
    while not stop.is_set():
        v = latest_version(silver)
        now = time.time()
        for ver in range(seen_v + 1, v + 1):
            for path, _ in commit_adds(silver, ver):
                try:
                    ids = pq.read_table(Path(silver, path), columns=["event_id", "device_id"]).to_pydict()
                except FileNotFoundError:  # vacuumed already (a soak's minutes-long retention)
                    continue
                for e, d in zip(ids["event_id"], ids["device_id"], strict=True):
                    if d == PROBE and e in published and e not in silver_seen:
                        silver_seen[e] = now
        seen_v = max(seen_v, v)
        cv = latest_version(current)
        if cv > cur_v:
            from deltalake import DeltaTable

            t = DeltaTable(current).to_pyarrow_table(columns=["device_id", "last_seen"]).to_pandas()
            row = t[t.device_id == PROBE]
            if len(row):
                last = row.last_seen.iloc[0].timestamp()
                for e, pt in list(published.items()):  # the publisher thread adds to it
                    if e not in current_seen and pt <= last + 0.001:
                        current_seen[e] = now
            cur_v = cv
        time.sleep(0.1)


if __name__ == "__main__":
    main()
    # Once under load a native library's thread aborted the interpreter's teardown ("terminate
    # called without an active exception", SIGABRT) after the result was printed: end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
