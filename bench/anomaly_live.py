"""Anomaly detection live: labelled faults through ``iotlake run``, recall per kind, false alarms.

Runs ``iotlake run --simulate RATE --devices N --anomalies FRACTION`` (embedded Mosquitto +
Apache Kafka, the bridge, every stream) on the example sensor fleet at its own rate
(``examples/sensor.toml``: 200 readings/s over 100 devices, one reading per device every 0.5 s)
in a fresh data root, until gold has scored ``--minutes`` of event time. The simulator's faults
(``ingest.simulator.faults``: spike, level shift, stuck value, drift, dropout) begin after
``--warmup-minutes`` (the detector learns its first 500 readings per key before it flags), their ground truth
in ``<root>/faults.jsonl``. Then, from gold's ``anomalies`` (delta-rs):

- a fault is **recalled** when an anomaly row of its device and metric has an event time in
  [start, end + ``--grace-seconds``] (a dropout is seen, if at all, when the metric returns);
  only faults whose end + grace lies inside the scored time count;
- **false** anomalies are rows on the healthy devices (never faulted) after the warm-up:
  ``false_per_device_day`` = false rows / (healthy devices x event-time days after the warm-up).
  Target: <= 1 at this rate; recall >= 0.8 for spikes, level shifts and stuck values.

It measures whatever detector gold runs, untuned. Last line: ``recall`` (per kind),
``false_per_device_day``, ``devices``, ``hours``, and counts (``faults``, ``recalled``,
``false_anomalies``, ``healthy_devices``, ``anomalies_on_faulted_outside_faults``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleets import SENSOR  # noqa: E402
from procs import stop_now  # noqa: E402  (bench/ is on sys.path)

from ingest.simulator import device_id  # noqa: E402
from ingest.simulator.faults import KINDS, faulted_devices, read_truth  # noqa: E402
from lakehouse.delta.read import arrow_dataset, open_table, table_exists  # noqa: E402
from lakehouse.settings import load_settings  # noqa: E402
from orchestration.services import free_port  # noqa: E402

#: ``iotlake run``'s simulator seed (it takes none from the command line)
SEED = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200, help="readings/s (the example fleet's)")
    ap.add_argument("--devices", type=int, default=100, help="devices (the example fleet's)")
    ap.add_argument("--anomalies", type=float, default=0.2, help="fraction of the devices with faults")
    ap.add_argument("--minutes", type=float, default=10, help="event-time minutes scored, the warm-up included")
    ap.add_argument("--warmup-minutes", type=float, default=2.5,
                    help="minutes before the first fault, excluded from the false count")
    ap.add_argument("--anomaly-length", type=int, default=120, help="readings a sustained fault lasts")
    ap.add_argument("--grace-seconds", type=float, default=30, help="after a fault's end, still its detection")
    ap.add_argument("--smoke", action="store_true", help="a short run at a low rate")
    ap.add_argument("--keep", action="store_true", help="keep the run's data root (its path on stderr)")
    args = ap.parse_args()
    if args.smoke:
        # 5 faulted devices: one fault of each kind in the first slot (warm-up 150 readings, the
        # last fault's end + grace ~29 s of event time after the start); 10 readings/s per device,
        # so event time covers that in half a minute of the clock
        args.rate, args.devices, args.anomalies = 100, 10, 0.5
        args.minutes, args.warmup_minutes, args.anomaly_length, args.grace_seconds = 0.55, 0.25, 30, 5
    if args.minutes <= args.warmup_minutes:
        ap.error(f"--minutes ({args.minutes:g}) includes --warmup-minutes ({args.warmup_minutes:g}): "
                 f"give more, e.g. --minutes {args.warmup_minutes + 5:g}")
    print(json.dumps(run(args)))


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="iotlake-anomaly-live-"))
    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root / "lake"),
                             kafka={"embedded_port": free_port(pair=True)}, mqtt={"embedded_port": free_port()},
                             observability={"metrics_port": 0})
    cfg = settings.save(root / "settings.json")
    env = {**os.environ, "IOTLAKE_CONFIG": str(cfg)}
    interval = args.devices / args.rate  # seconds between a device's readings
    warmup_readings = round(args.warmup_minutes * 60 / interval)
    truth_path = root / "faults.jsonl"
    argv = [sys.executable, "-m", "orchestration.cli", "run", "--simulate", f"{args.rate:g}",
            "--devices", str(args.devices), "--anomalies", f"{args.anomalies:g}",
            "--faults-file", str(truth_path), "--anomaly-warmup", str(warmup_readings),
            "--anomaly-length", str(args.anomaly_length)]
    t0 = time.monotonic()
    child = subprocess.Popen(argv, env=env, stdout=open(root / "run.log", "w"), stderr=subprocess.STDOUT)
    scored = settings.table_path("readings_scored")
    try:
        _wait(lambda: table_exists(scored) and _event_times(scored) is not None, 300, "gold's first scores",
              root, child)
        start = _event_times(scored)[0]  # device 0's first reading: the simulated clock's start
        end = start + timedelta(minutes=args.minutes)
        print(f"# scoring from {start.isoformat()} until {end.isoformat()} (event time)", file=sys.stderr)
        _wait(lambda: _event_times(scored)[1] >= end, args.minutes * 60 * 3 + 300, "gold to score the run",
              root, child)
        wall = time.monotonic() - t0
    finally:
        if not stop_now(child):
            child.kill()
            child.wait()
    result = evaluate(settings, read_truth(truth_path), args, start, end)
    result["seconds"] = round(wall, 1)
    result["load"] = os.getloadavg()[0]
    if args.keep:
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def evaluate(settings, truth: list[dict], args: argparse.Namespace, start: datetime, end: datetime) -> dict:
    """Recall per fault kind and false anomalies per healthy device-day, in [start + warm-up, end]."""
    counted_from = start + timedelta(minutes=args.warmup_minutes)
    grace = timedelta(seconds=args.grace_seconds)
    path = settings.table_path("anomalies")
    rows = []
    if table_exists(path):
        rows = arrow_dataset(open_table(path)).to_table(columns=["device_id", "metric", "event_time"]).to_pylist()
    rows = [r for r in rows if counted_from <= r["event_time"] <= end]
    faulted = {device_id(d) for d in faulted_devices(args.devices, args.anomalies, SEED)}
    assert {t["device_id"] for t in truth} <= faulted, "ground truth names a device not chosen for faults"
    healthy = args.devices - len(faulted)
    by_key: dict[tuple[str, str], list[datetime]] = {}
    for r in rows:
        by_key.setdefault((r["device_id"], r["metric"]), []).append(r["event_time"])
    complete, recalled = Counter(), Counter()
    windows: dict[str, list[tuple[datetime, datetime]]] = {}
    for t in truth:
        t0, t1 = _time(t["start"]), _time(t["end"]) + grace
        windows.setdefault(t["device_id"], []).append((t0, t1))
        if t1 > end:
            continue  # not over within the scored time
        complete[t["kind"]] += 1
        if any(t0 <= e <= t1 for e in by_key.get((t["device_id"], t["metric"]), ())):
            recalled[t["kind"]] += 1
    false = [r for r in rows if r["device_id"] not in faulted]
    outside = [r for r in rows if r["device_id"] in faulted
               and not any(a <= r["event_time"] <= b for a, b in windows.get(r["device_id"], ()))]
    days = (end - counted_from).total_seconds() / 86400
    per_device_day = len(false) / (healthy * days) if healthy else 0.0
    for k in KINDS:
        print(f"# {k}: {recalled[k]}/{complete[k]} recalled", file=sys.stderr)
    print(f"# false: {len(false)} anomaly rows on {healthy} healthy devices over {days * 24:.3f} h "
          f"({Counter(r['metric'] for r in false)}); on faulted devices outside their faults: {len(outside)}",
          file=sys.stderr)
    return {
        "recall": {k: round(recalled[k] / complete[k], 3) if complete[k] else 0.0 for k in KINDS},
        "false_per_device_day": round(per_device_day, 2),
        "devices": args.devices, "hours": round(days * 24, 3),
        "faults": sum(complete.values()), "faults_by_kind": {k: complete[k] for k in KINDS},
        "recalled": sum(recalled.values()), "false_anomalies": len(false), "healthy_devices": healthy,
        "anomalies_on_faulted_outside_faults": len(outside), "anomaly_rows": len(rows),
        "rate": args.rate, "anomalies": args.anomalies, "warmup_minutes": args.warmup_minutes,
        "grace_seconds": args.grace_seconds, "anomaly_length": args.anomaly_length,
    }


def _event_times(path: str) -> tuple[datetime, datetime] | None:
    """(first, last) event time gold has scored, None before its first rows."""
    t = arrow_dataset(open_table(path)).to_table(columns=["event_time"])["event_time"]
    if not len(t):
        return None
    mm = pc.min_max(t)
    return mm["min"].as_py(), mm["max"].as_py()


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def _wait(pred, timeout: float, what: str, root: Path, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            break
        try:
            if pred():
                return
        except (OSError, ValueError, TypeError):  # a table mid-creation
            pass
        time.sleep(1.0)
    log = (root / "run.log").read_text(errors="replace")[-3000:] if (root / "run.log").exists() else ""
    raise SystemExit(f"timed out waiting for {what} (iotlake run exit code {child.poll()})\n{log}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
