"""Chaos bench: kill -9 pipeline roles at random under steady load; nothing lost or duplicated.

Starts Mosquitto and Apache Kafka on free ports, the bridge and the bronze / silver / gold streams as
separate ``iotlake run --role ...`` processes, and publishes known simulated telemetry (with
duplicates and malformed payloads) at ``--rate`` msg/s. ``--kills`` times, at seeded-random
moments, it kill -9s one role (or all of them: "whole run"), waits and restarts it; optionally
it also stops and restarts Mosquitto (``--mosquitto-outages``) or Kafka (``--kafka-outages``;
both keep their data on disk, so an outage must lose nothing). Then it stops the load, waits for every layer to catch up and checks every
guarantee (``lakehouse/chaos.py``). Last line: one JSON object with kills, published, lost,
duplicated, mismatched_windows, final_windows_bad, seconds, bronze_extra and per-role kill counts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lakehouse.chaos import ChaosConfig, run_chaos, summary_line  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rate", type=float, default=100.0, help="messages per second")
    ap.add_argument("--devices", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, nargs=2, default=(4.0, 10.0), metavar=("MIN", "MAX"),
                    help="seconds between disruptions")
    ap.add_argument("--downtime", type=float, nargs=2, default=(0.5, 4.0), metavar=("MIN", "MAX"))
    ap.add_argument("--roles", default="bridge,bronze,silver,gold",
                    help="role processes (e.g. bridge,streams for one Spark process)")
    ap.add_argument("--partitions", type=int, default=4, help="Kafka partitions")
    ap.add_argument("--ready-timeout", type=float, default=60.0,
                    help="max seconds to wait for a restarted role to work before killing again")
    ap.add_argument("--mosquitto-outages", type=int, default=2)
    ap.add_argument("--kafka-outages", type=int, default=1)
    ap.add_argument("--compactions", type=int, default=0,
                    help="times to compact every table while the streams write")
    ap.add_argument("--event-time-speedup", type=float, default=1.0,
                    help="simulated event seconds per wall second (> 1 closes windows sooner)")
    ap.add_argument("--drain-timeout", type=float, default=600.0,
                    help="seconds to wait for every layer to catch up after the load")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed when ok)")
    args = ap.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="iotlake-chaos-"))
    cfg = ChaosConfig(root=root, kills=args.kills, rate=args.rate, devices=args.devices,
                      seed=args.seed, interval=tuple(args.interval), downtime=tuple(args.downtime),
                      roles=tuple(args.roles.split(",")), mosquitto_outages=args.mosquitto_outages,
                      kafka_outages=args.kafka_outages, drain_timeout=args.drain_timeout,
                      partitions=args.partitions, ready_timeout=args.ready_timeout,
                      event_time_speedup=args.event_time_speedup, compactions=args.compactions)
    result = run_chaos(cfg)
    print(json.dumps(result["detail"]), file=sys.stderr)
    line = {k: v for k, v in result.items() if k != "detail"}
    if not result["ok"]:
        print(f"work directory kept for inspection: {root}", file=sys.stderr)
    elif not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(summary_line(line))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
