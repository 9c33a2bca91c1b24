"""Chaos bench: kill -9 pipeline roles at random under steady load; nothing lost or duplicated.

Starts Mosquitto and Apache Kafka on free ports, the bridge and the bronze / silver / gold streams as
separate ``iotlake run --role ...`` processes, and publishes known simulated telemetry (with
duplicates and malformed payloads) at ``--rate`` msg/s. ``--kills`` times, at seeded-random
moments, it kill -9s one role (or all of them: "whole run"), waits and restarts it; optionally
it also stops and restarts Mosquitto (``--mosquitto-outages``) or Kafka (``--kafka-outages``;
both keep their data on disk, so an outage must lose nothing). Then it stops the load, waits for every layer to catch up and checks every
guarantee (``bench/chaos_harness.py``). Last line: one JSON object with kills, published, lost,
duplicated, mismatched_windows, final_windows_bad, seconds, bronze_extra and per-role kill counts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos_harness import ChaosConfig, run_chaos, summary_line  # noqa: E402

#: ``--smoke``: a minute or two on a 2-core machine, every kind of disruption once or more.
SMOKE = dict(kills=3, rate=40.0, devices=10, seed=8, roles="bridge,streams", mosquitto_outages=1,
             kafka_outages=1, interval=(2.0, 4.0), downtime=(0.5, 2.0), ready_timeout=90.0,
             drain_timeout=300.0, event_time_speedup=20.0, compactions=1,
             compact_tables="bronze,silver,gold_metrics_1m")  # streams read two, one is MERGEd


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--compact-tables", help="comma-separated tables each compaction rewrites "
                    "(default: every table)")
    ap.add_argument("--event-time-speedup", type=float, default=1.0,
                    help="simulated event seconds per wall second (> 1 closes windows sooner)")
    ap.add_argument("--drain-timeout", type=float, default=600.0,
                    help="seconds to wait for every layer to catch up after the load")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed when ok)")
    ap.add_argument("--smoke", action="store_true",
                    help="the short run tests/test_chaos.py makes: 3 kills (one of the whole run), "
                         "one outage of each broker, one compaction of bronze, silver and gold_metrics_1m, "
                         "event time 20x the clock")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="iotlake-chaos-"))
    cfg = ChaosConfig(root=root, kills=args.kills, rate=args.rate, devices=args.devices,
                      seed=args.seed, interval=tuple(args.interval), downtime=tuple(args.downtime),
                      roles=tuple(args.roles.split(",")), mosquitto_outages=args.mosquitto_outages,
                      kafka_outages=args.kafka_outages, drain_timeout=args.drain_timeout,
                      partitions=args.partitions, ready_timeout=args.ready_timeout,
                      event_time_speedup=args.event_time_speedup, compactions=args.compactions,
                      compact_tables=tuple(args.compact_tables.split(",")) if args.compact_tables else None)
    if args.smoke:  # a short load around the disruptions; 2 s triggers: fewer, fuller batches
        cfg = replace(cfg, warmup_seconds=2, tail_seconds=2, trigger_seconds=2.0)
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
