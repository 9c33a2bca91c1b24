"""Soak: ``iotlake run`` for an hour under load with its built-in upkeep; do memory, files and
disk level off, and do latency and readers stay where they were?

Runs ``iotlake run`` (embedded brokers, bridge, every stream, built-in upkeep) and ``iotlake
simulate --rate R`` as child processes, with every retention shortened to ``--retention-minutes``
(table rows, Delta logs, vacuum, the Kafka log by size) so an hour shows what weeks would. Every
``--sample-seconds`` it records, per role, the resident memory and CPU of ``iotlake run``'s
processes (Spark JVM, Kafka JVM, Python workers, driver, Mosquitto), and per table the live data
files, bytes on disk and Delta log files; checkpoint and Kafka log bytes; the dashboard API's
and one analyst query's latency (p95 of a few calls each). Probe readings (a device of their
own, event time = publish time) give publish -> silver and -> ``device_current`` latency.

Last line: ``minutes``, ``rate``, ``rss_growth_pct_per_h_max`` (worst role, least-squares slope
after the warm-up, over its mean), ``files_max`` (worst table, any sample), ``disk_growth_pct_last_20min``
(least-squares rise over its mean, ``disk_growth_pct``; ``disk_growth_pct_endpoints``: last sample
over first),
``latency_p99_drift`` (silver p99 of the probes sent in the last 10 minutes over the first 10
after warm-up), ``dashboard_p95_ms_max``, ``query_p95_ms_max``, ``lost`` (probes never in
silver) and ``achieved_rate``. ``--smoke`` is a 30-second run at 50 events/s (windows scaled).

    .venv/bin/python bench/soak.py --minutes 60 --rate 1000
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e_latency import _achieved_rate, _probe, _wait, _watch  # noqa: E402  (bench/ is on sys.path)
from fleets import SENSOR  # noqa: E402
from procs import IOTLAKE, by_role, stop_now  # noqa: E402

from lakehouse.settings import Settings, load_settings  # noqa: E402
from lakehouse.tables import RETENTION_COLUMNS, TABLES  # noqa: E402
from orchestration.services import free_port  # noqa: E402

#: The analyst's query: last ten minutes of per-device means.
QUERY = ("SELECT device_id, metric, count(*) AS windows, avg(mean) AS mean FROM gold_metrics_1m "
         "WHERE window_end >= now() - INTERVAL 10 MINUTE GROUP BY ALL")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--rate", type=float, default=1000, help="simulated events/s")
    ap.add_argument("--devices", type=int, default=500)
    ap.add_argument("--retention-minutes", type=float, default=10,
                    help="rows, Delta logs and vacuum keep this long during the run")
    ap.add_argument("--sample-seconds", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=10,
                    help="left out of memory growth and the first latency window")
    ap.add_argument("--window-minutes", type=float, default=10,
                    help="latency drift compares the last window with the first after warm-up")
    ap.add_argument("--disk-minutes", type=float, default=20, help="disk growth over the last N minutes")
    ap.add_argument("--probe-rate", type=float, default=2, help="probe readings per second")
    ap.add_argument("--smoke", action="store_true", help="30 s at 50 events/s: the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.minutes, args.rate, args.devices, args.retention_minutes = 0.5, 50, 10, 1
        args.sample_seconds, args.warmup_minutes, args.window_minutes, args.disk_minutes = 6, 0.15, 0.25, 0.4
    if args.minutes <= args.warmup_minutes + args.window_minutes:
        ap.error("--minutes must exceed --warmup-minutes + --window-minutes")
    result = run(args)
    print(json.dumps(result))
    if result.get("error"):
        raise SystemExit(1)


def soak_settings(root: Path, retention_minutes: float) -> Settings:
    """Embedded brokers on free ports; every retention (rows of every table, Delta logs, vacuum,
    Kafka by size) shortened so disk should level off within the run; tables partitioned in
    buckets of at most half the retention (retention drops whole partitions)."""
    hours = retention_minutes / 60
    bucket = max(d for d in range(1, 1441) if 1440 % d == 0 and d <= max(1.0, retention_minutes / 2))
    return load_settings(
        environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root / "lake"),
        kafka={"embedded_port": free_port(pair=True), "embedded_retention_bytes": 16 << 20,
               "embedded_segment_bytes": 4 << 20},
        mqtt={"embedded_port": free_port()},
        observability={"metrics_port": 0},
        maintenance={"allow_short_retention": True, "vacuum_retention_hours": hours,
                     "log_retention_hours": hours, "vacuum_interval_hours": hours / 2,
                     "check_seconds": min(60.0, max(10.0, retention_minutes * 6)),
                     "partition_minutes": bucket,
                     "retention_days": dict.fromkeys(RETENTION_COLUMNS, hours / 24)})


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="iotlake-soak-"))
    settings = soak_settings(root, args.retention_minutes)
    env = {**os.environ, "IOTLAKE_CONFIG": str(settings.save(root / "settings.json"))}
    pipeline = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "run"], env=env,
                                stdout=open(root / "run.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
    sim = None
    error, sim_seconds = None, 0.0
    published: dict[str, float] = {}
    silver_seen: dict[str, float] = {}
    current_seen: dict[str, float] = {}
    samples: list[dict] = []
    stop = threading.Event()
    try:
        _wait(lambda: Path(settings.table_path("silver"), "_delta_log").exists() and pipeline.poll() is None,
              180, "pipeline start")
        sim = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "simulate", "--rate",
                                str(args.rate), "--devices", str(args.devices)], env=env,
                               stdout=open(root / "simulate.log", "w"), stderr=subprocess.STDOUT)
        _wait(lambda: Path(settings.table_path("device_current"), "_delta_log").exists(), 300,
              "the first gold batch")
        t0 = time.monotonic()
        seconds = args.minutes * 60
        watcher = threading.Thread(target=_watch, args=(settings, published, silver_seen, current_seen, stop))
        watcher.start()
        prober = threading.Thread(target=_probe, args=(settings, published, args.probe_rate, seconds))
        prober.start()
        reader = Readers(settings)
        while time.monotonic() - t0 < seconds:
            if pipeline.poll() is not None:
                raise SystemExit(f"iotlake run exited ({pipeline.returncode}): see {root / 'run.log'}")
            samples.append(sample(settings, pipeline.pid, reader, time.monotonic() - t0))
            print(f"# sample {json.dumps(samples[-1])}", flush=True)
            time.sleep(max(0.0, args.sample_seconds - (time.monotonic() - t0) % args.sample_seconds))
        prober.join()
        sim.send_signal(signal.SIGINT)
        sim.wait(60)
        sim_seconds = time.monotonic() - t0
        drain = time.monotonic() + 120
        while len(silver_seen) < len(published) and time.monotonic() < drain:
            time.sleep(1)  # the last probes on their way
    except SystemExit as e:
        error = str(e)
        print(f"# {e}", file=sys.stderr)
    finally:
        stop.set()
        if sim is not None and sim.poll() is None:
            sim.kill()
        if not stop_now(pipeline, 120):
            os.killpg(pipeline.pid, signal.SIGKILL)
    out = summary(args, samples, published, silver_seen, current_seen,
                  _achieved_rate(root / "simulate.log", sim_seconds) if sim_seconds else None, root)
    if error:
        print(f"# data and logs kept in {root}", file=sys.stderr)
        return {**out, "error": error}
    shutil.rmtree(root, ignore_errors=True)
    return out


class Readers:
    """The dashboard API in-process (as ``iotlake dashboard`` serves it) and DuckDB over Delta."""

    def __init__(self, settings: Settings) -> None:
        from fastapi.testclient import TestClient

        from dashboard.app import create_app

        self.settings = settings
        self.client = TestClient(create_app(settings), base_url="http://localhost")

    def dashboard_ms(self, calls: int = 3) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for _ in range(calls):
            for path in ("/api/fleet", "/api/devices", "/api/pipeline"):
                t = time.perf_counter()
                r = self.client.get(path)
                out.setdefault(path, []).append((time.perf_counter() - t) * 1000)
                if r.status_code != 200:
                    raise SystemExit(f"dashboard {path}: HTTP {r.status_code} {r.text[:200]}")
            time.sleep(1.1)  # past the dashboard's check interval: each round starts a refresh
        return out

    def query_ms(self, calls: int = 3) -> list[float]:
        from orchestration.query import run_query

        out = []
        for _ in range(calls):
            t = time.perf_counter()
            run_query(self.settings, QUERY)
            out.append((time.perf_counter() - t) * 1000)
        return out


def _du(path: Path) -> tuple[int, int]:
    """Bytes on disk (allocated blocks: Kafka's preallocated indexes are sparse) and files under
    ``path``."""
    size = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                size += os.stat(os.path.join(dirpath, n)).st_blocks * 512
                files += 1
            except OSError:
                pass
    return size, files


def sample(settings: Settings, pid: int, reader: Readers, t: float) -> dict:
    from deltalake import DeltaTable

    roles = by_role([pid])
    tables = {}
    for name in TABLES:
        path = Path(settings.table_path(name))
        if not (path / "_delta_log").exists():
            continue
        try:
            live = DeltaTable(str(path)).get_add_actions().num_rows
        except Exception:  # noqa: BLE001 - a file vacuumed under the reader: next sample
            live = None
        size, _ = _du(path)
        tables[name] = {"files": live, "bytes": size, "log_files": _du(path / "_delta_log")[1]}
    dash, query = reader.dashboard_ms(), reader.query_ms()
    return {
        "t": round(t, 1),
        "rss_mb": {r: round(v["rss"] / 2**20, 1) for r, v in roles.items() if r in IOTLAKE},
        "cpu_s": {r: round(v["cpu_s"], 1) for r, v in roles.items() if r in IOTLAKE},
        "tables": tables,
        "checkpoint_bytes": _du(settings.checkpoint_root / "checkpoints")[0],
        "kafka_bytes": sum(_du(d)[0] for d in settings.run_dir.glob("kafka-*")),
        "disk_bytes": _du(settings.root)[0],
        "dashboard_p95_ms": round(float(np.percentile([v for d in dash.values() for v in d], 95)), 1),
        "dashboard_max_ms": {p: round(max(d), 1) for p, d in dash.items()},
        "query_p95_ms": round(float(np.percentile(query, 95)), 1),
    }


def _rise_pct(pts: list[tuple[float, float]], seconds: float | None = None) -> float:
    """The least-squares line's rise over ``seconds`` (default: the points' span), in % of the
    points' mean."""
    t, y = np.array(pts, dtype=float).T
    return round(float(np.polyfit(t, y, 1)[0] * (seconds or t[-1] - t[0]) / y.mean() * 100), 2)


def rss_growth_pct_per_h(samples: list[dict], since: float) -> dict[str, float]:
    """Per role: least-squares RSS slope after ``since`` seconds, in % of its mean per hour."""
    out = {}
    for role in sorted({r for s in samples for r in s["rss_mb"]}):
        pts = [(s["t"], s["rss_mb"][role]) for s in samples if s["t"] >= since and role in s["rss_mb"]]
        if len(pts) >= 3:
            out[role] = _rise_pct(pts, 3600)
    return out


def disk_growth_pct(samples: list[dict], since: float) -> tuple[float | None, float | None]:
    """Disk growth from ``since`` to the last sample, in % of the mean: the least-squares line's
    rise over that span (as for memory), and the last sample over the first. Retention and vacuum
    make the disk a sawtooth with teeth of several minutes (a vacuum pass under load), so two
    single samples say more about where each fell on a tooth than about the level."""
    pts = [(s["t"], s["disk_bytes"]) for s in samples if s["t"] >= since and s["disk_bytes"]]
    if len(pts) < 3:
        return None, None
    return _rise_pct(pts), round((pts[-1][1] / pts[0][1] - 1) * 100, 2)


def summary(args: argparse.Namespace, samples: list[dict], published: dict[str, float],
            silver_seen: dict[str, float], current_seen: dict[str, float],
            achieved: float | None, root: Path) -> dict:
    warm, window, end = args.warmup_minutes * 60, args.window_minutes * 60, args.minutes * 60
    t0 = min(published.values()) if published else 0.0

    def p99(lo: float, hi: float, seen: dict[str, float]) -> float | None:
        lat = [seen[e] - p for e, p in published.items() if lo <= p - t0 < hi and e in seen]
        return round(float(np.percentile(lat, 99)), 3) if lat else None

    first, last = p99(warm, warm + window, silver_seen), p99(end - window, end, silver_seen)
    growth = rss_growth_pct_per_h(samples, warm)
    disk_growth, disk_ends = disk_growth_pct(samples, end - args.disk_minutes * 60)
    files = [(v["files"] or 0, name) for s in samples for name, v in s["tables"].items()]
    return {
        "minutes": args.minutes, "rate": args.rate, "devices": args.devices,
        "retention_minutes": args.retention_minutes, "samples": len(samples),
        "rss_growth_pct_per_h_max": max(growth.values()) if growth else None,
        "rss_growth_pct_per_h": growth,
        "rss_mb_last": samples[-1]["rss_mb"] if samples else {},
        "files_max": max(files)[0] if files else None,
        "files_max_table": max(files)[1] if files else None,
        "log_files_max": max((v["log_files"] for s in samples for v in s["tables"].values()), default=None),
        "disk_growth_pct_last_20min": disk_growth,
        "disk_growth_pct_endpoints": disk_ends,
        "disk_mb_last": round(samples[-1]["disk_bytes"] / 2**20, 1) if samples else None,
        "latency_p99_first_s": first, "latency_p99_last_s": last,
        "latency_p99_drift": round(last / first, 2) if first and last else None,
        "current_p99_last_s": p99(end - window, end, current_seen),
        "dashboard_p95_ms_max": max((s["dashboard_p95_ms"] for s in samples), default=None),
        "query_p95_ms_max": max((s["query_p95_ms"] for s in samples), default=None),
        "probes": len(published), "lost": len(set(published) - set(silver_seen)),
        "achieved_rate": achieved, "load": os.getloadavg()[0], "data_root": str(root),
    }


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see e2e_latency: a native thread can abort the interpreter's teardown
