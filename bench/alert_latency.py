"""Alert latency: MQTT publish -> a notification at a receiver, under a background load.

Runs ``iotlake run`` (embedded Mosquitto + Apache Kafka, the bridge, every stream, the alert
engine) and ``iotlake simulate --rate RATE`` as child processes, with a webhook receiver of its
own (``alerts.webhook_url``, Alertmanager's webhook format). The fleet is the example sensor on
topics that name a site (``sites/{site}/{device_id}/telemetry``). After the warm-up it

- injects threshold breaches: a probe device on its own site publishes readings every second;
  now and then one above the rule's bound (``temperature`` above 60), then normal ones again.
  ``threshold_p*_s``: publish of the breaching reading -> its ``firing`` notification;
- silences a site: the probe site's devices stop publishing at once. ``silence_extra_s``: the
  ``SiteSilent`` notification's arrival less (last publish + ``silent_seconds``), and the same
  for each device's ``DeviceOffline`` (beyond ``gold.offline_after_seconds``);

and counts what the receiver got: ``notifications_per_incident`` (firing notifications per
incident the bench caused, 1.0 is right), ``lost`` (incidents never notified), ``duplicated``
(an idempotency key received twice), and the example fleet's ``status_changes_per_device_hour``
from ``device_status_history``. Last line: those and ``rate``, ``mode``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleets import SENSOR  # noqa: E402
from procs import stop_now  # noqa: E402  (bench/ is on sys.path)

from ingest.mqtt_client import mqtt_client  # noqa: E402
from lakehouse.settings import load_settings  # noqa: E402
from orchestration.services import free_port  # noqa: E402

HOT = 60.0


class Receiver:
    """A webhook receiver on loopback: every POST's alerts, with their arrival time."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str, dict]] = []  # (arrival, idempotency key, alert)
        self.keys: Counter[str] = Counter()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.time()
                key = self.headers.get("Idempotency-Key", "")
                outer.keys[key] += 1
                for a in body["alerts"]:
                    outer.got.append((now, key, a))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def first(self, alertname: str, status: str, **labels: str) -> float | None:
        for t, _, a in self.got:
            if (a["labels"].get("alertname") == alertname and a["status"] == status
                    and all(a["labels"].get(k) == v for k, v in labels.items())):
                return t
        return None

    def firing(self, alertname: str, **labels: str) -> list[float]:
        return [t for t, _, a in self.got if a["labels"].get("alertname") == alertname
                and a["status"] == "firing" and all(a["labels"].get(k) == v for k, v in labels.items())]


def _payload(device: str, temperature: float) -> bytes:
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps({"schema_version": 1, "device_id": device, "event_id": uuid.uuid4().hex, "ts": now,
                       "temperature": temperature, "humidity": 40.0, "battery": 90.0,
                       "status": "ok"}).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=1000, help="background events/s (the simulator)")
    ap.add_argument("--devices", type=int, default=50, help="background devices")
    ap.add_argument("--warmup", type=float, default=90)
    ap.add_argument("--breaches", type=int, default=20, help="threshold incidents to inject")
    ap.add_argument("--gap", type=float, default=6.0, help="seconds between breaches")
    ap.add_argument("--offline-after", type=int, default=30, help="gold.offline_after_seconds")
    ap.add_argument("--quiet-devices", type=int, default=3, help="devices of the site that goes silent")
    ap.add_argument("--smoke", action="store_true", help="a short run at a low rate")
    ap.add_argument("--keep", action="store_true", help="keep the run's data root (its path on stderr)")
    args = ap.parse_args()
    if args.smoke:
        args.rate, args.devices, args.warmup, args.breaches, args.gap = 50, 5, 10, 2, 2.0
        args.offline_after, args.quiet_devices = 10, 2
    print(json.dumps(run(args)))


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="iotlake-alerts-"))
    recv = Receiver()
    telemetry = {**SENSOR.model_dump(mode="json"), "topic_pattern": "sites/{site}/{device_id}/telemetry"}
    settings = load_settings(
        environ={}, telemetry=telemetry, data_root=str(root / "lake"),
        kafka={"embedded_port": free_port(pair=True)}, mqtt={"embedded_port": free_port()},
        observability={"metrics_port": 0},
        gold={"offline_after_seconds": args.offline_after},
        alerts={"webhook_url": recv.url, "rules": [
            {"name": "DeviceOffline", "kind": "device_offline"},
            {"name": "SiteSilent", "kind": "site_silent", "severity": "critical"},
            {"name": "PipelineStale", "kind": "pipeline_stale", "severity": "critical"},
            {"name": "HighTemperature", "kind": "threshold", "metric": "temperature", "above": HOT}]})
    cfg = settings.save(root / "settings.json")
    env = {**os.environ, "IOTLAKE_CONFIG": str(cfg)}
    child = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "run"], env=env,
                             stdout=open(root / "run.log", "w"), stderr=subprocess.STDOUT)
    sim = None
    t_start = time.time()
    host, port = settings.mqtt_endpoint
    pub = mqtt_client(settings, f"bench-{uuid.uuid4().hex[:6]}")  # the simulator's credential
    hot_device, quiet = "probe-hot", [f"probe-quiet-{i}" for i in range(args.quiet_devices)]
    breaches: list[float] = []
    stop_quiet = threading.Event()
    stop_all = threading.Event()
    last_quiet: list[float] = [0.0]
    hot_now = threading.Event()

    hot_first: list[float] = []  # publish time of each incident's first breaching reading

    def publisher() -> None:
        marked = False
        while not stop_all.is_set():
            hot = hot_now.is_set()
            if hot and not marked:
                hot_first.append(time.time())
            marked = hot
            pub.publish(f"sites/hot-site/{hot_device}/telemetry",
                        _payload(hot_device, HOT + 20 if hot else 21.0), qos=1)
            if not stop_quiet.is_set():
                for d in quiet:
                    pub.publish(f"sites/quiet-site/{d}/telemetry", _payload(d, 21.0), qos=1)
                last_quiet[0] = time.time()
            stop_all.wait(1.0)

    try:
        _wait(lambda: Path(settings.table_path("silver"), "_delta_log").exists() and child.poll() is None,
              180, "pipeline start", root)
        pub.connect(host, port)
        pub.loop_start()
        if args.rate > 0:
            sim = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "simulate", "--rate",
                                    str(args.rate), "--devices", str(args.devices)], env=env,
                                   stdout=open(root / "simulate.log", "w"), stderr=subprocess.STDOUT)
        threading.Thread(target=publisher, daemon=True).start()
        time.sleep(args.warmup)
        sampled_from = time.time()
        for _ in range(args.breaches):
            # the next breaching reading is published at the publisher's next second
            hot_now.set()
            want = len(breaches) + 1
            _wait(lambda want=want: len(recv.firing("HighTemperature", device_id=hot_device)) >= want,
                  60, "a threshold notification", root, fail=False)
            breaches.append(hot_first[-1] if hot_first else time.time())
            hot_now.clear()
            time.sleep(args.gap)
        stop_quiet.set()
        silent_from = last_quiet[0]
        _wait(lambda: recv.first("SiteSilent", "firing", site="quiet-site") is not None
              and all(recv.first("DeviceOffline", "firing", device_id=d) for d in quiet),
              args.offline_after + 90, "site silent", root, fail=False)
        time.sleep(3)  # anything late or duplicated arrives
        sampled_to = time.time()
    finally:
        stop_all.set()
        if sim is not None:
            sim.terminate()
            sim.wait(30)
        if not stop_now(child):
            child.kill()
    fired = recv.firing("HighTemperature", device_id=hot_device)
    # a breach's latency: its first breaching reading's publish -> the incident's firing notification
    lat = []
    hot_fires = sorted(fired)
    for i, t in enumerate(breaches):
        later = [f for f in hot_fires if f >= t and (i + 1 >= len(breaches) or f < breaches[i + 1])]
        if later:
            lat.append(later[0] - t)
    site_t = recv.first("SiteSilent", "firing", site="quiet-site")
    offline_t = [recv.first("DeviceOffline", "firing", device_id=d) for d in quiet]
    silence_extra = [t - silent_from - args.offline_after for t in (site_t, *offline_t) if t is not None]
    incidents = len(breaches) + 1 + len(quiet)
    notified = len(lat) + (site_t is not None) + sum(t is not None for t in offline_t)
    firing_total = (len(fired) + len(recv.firing("SiteSilent", site="quiet-site"))
                    + sum(len(recv.firing("DeviceOffline", device_id=d)) for d in quiet))
    changes = _status_changes(settings, args.devices, sampled_from, sampled_to)
    print("threshold latencies (s):", " ".join(f"{x:.2f}" for x in sorted(lat)), file=sys.stderr)
    if args.keep:
        print(f"kept {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "rate": args.rate, "mode": "micro-batch",
        "threshold_p50_s": round(float(np.percentile(lat, 50)), 3) if lat else None,
        "threshold_p99_s": round(float(np.percentile(lat, 99)), 3) if lat else None,
        "silence_extra_s": round(max(silence_extra), 3) if silence_extra else None,
        "notifications_per_incident": round(firing_total / max(notified, 1), 3),
        "lost": incidents - notified,
        "duplicated": sum(n - 1 for k, n in recv.keys.items() if n > 1),
        "status_changes_per_device_hour": changes,
        "incidents": incidents, "offline_after_seconds": args.offline_after,
        "seconds": round(time.time() - t_start, 1), "load": os.getloadavg()[0],
    }


def _status_changes(settings, devices: int, since: float, until: float) -> float | None:
    """Status changes per background device and hour while sampled (the example fleet's)."""
    from deltalake import DeltaTable

    path = settings.table_path("device_status_history")
    if not Path(path, "_delta_log").exists():
        return 0.0
    t = DeltaTable(path).to_pyarrow_table(columns=["device_id", "changed_at"]).to_pylist()
    n = sum(1 for r in t if not r["device_id"].startswith("probe-")
            and since <= r["changed_at"].timestamp() <= until)
    return round(n / devices / ((until - since) / 3600), 2)


def _wait(pred, timeout: float, what: str, root: Path, fail: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    if fail:
        log = (root / "run.log").read_text(errors="replace")[-3000:] if (root / "run.log").exists() else ""
        raise SystemExit(f"timed out waiting for {what}\n{log}")
    return False


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
