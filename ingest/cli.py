"""``iotlake bridge`` and ``iotlake simulate`` subcommands.

Several bridge instances run as separate processes (the GIL would serialise threads), each with a
stable client id ``<mqtt.client_id>-<i>`` so the broker keeps each one's session, sharing the
load through an MQTT v5 shared subscription. Children get settings the same way the parent did
(config file + IOTLAKE_* env), so secrets are never put on a command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from lakehouse.settings import Settings

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bridge", help="run the MQTT -> Kafka bridge",
                              description="Move MQTT telemetry into Kafka without loss.")
    p.add_argument("--instances", type=int, default=None, metavar="K",
                   help="bridge processes sharing the load via an MQTT v5 shared subscription "
                        "(default: bridge.instances)")
    p.add_argument("--bridge-id", help="stable MQTT client id of this single instance "
                                       "(default: mqtt.client_id)")
    p.set_defaults(func=lambda args, settings: run_bridge(args, settings))

    s = subparsers.add_parser("simulate", help="publish simulated device telemetry to MQTT")
    s.add_argument("--rate", type=float, default=100.0, help="messages per second (default 100)")
    s.add_argument("--devices", type=int, default=10, help="number of devices (default 10)")
    s.add_argument("--events", type=int, default=0,
                   help="publish exactly this many and exit (default: run until Ctrl-C)")
    s.add_argument("--duplicates", type=float, default=0.0, help="fraction of duplicate re-sends")
    s.add_argument("--malformed", type=float, default=0.0, help="fraction of malformed payloads")
    s.add_argument("--late", type=float, default=0.0, help="fraction of late readings")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--profile", choices=("json", "sparkplug"), default=None,
                   help="what the devices speak (default: sparkplug when telemetry.sparkplug is "
                        "on, else json; --events always publishes json)")
    add_anomaly_arguments(s)
    s.set_defaults(func=lambda args, settings: run_simulator(args, settings))


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction in [0, 1], "
                                         "e.g. 0.2") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1] (got {text}), e.g. 0.2")
    return v


def _readings(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of readings") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 readings (got {v})")
    return v


def add_anomaly_arguments(p: argparse.ArgumentParser) -> None:
    """The labelled-fault flags, the same for ``iotlake simulate`` and ``iotlake run``."""
    p.add_argument("--anomalies", type=fraction, default=0.0, metavar="FRACTION",
                   help="this fraction of the devices gets labelled faults (spike, level shift, "
                        "stuck value, drift, dropout) on a gold metric; the rest stay healthy")
    p.add_argument("--faults-file", default=None, metavar="PATH",
                   help="where the faults' ground truth goes, one JSON line each "
                        "(default: <data_root>/simulator/faults.jsonl)")
    p.add_argument("--anomaly-warmup", type=_readings, default=300, metavar="READINGS",
                   help="readings per device before its first fault (the detectors learn; default 300)")
    p.add_argument("--anomaly-length", type=_readings, default=120, metavar="READINGS",
                   help="readings a sustained fault lasts (a drift twice that; default 120)")


def anomaly_plan(args: argparse.Namespace, settings: Settings):
    """The ``ingest.simulator.faults.AnomalyPlan`` the flags ask for, or None."""
    from pathlib import Path

    from ingest.simulator.faults import AnomalyPlan, default_path

    if not args.anomalies:
        return None
    path = Path(args.faults_file) if args.faults_file else default_path(settings.root)
    plan = AnomalyPlan(args.anomalies, args.anomaly_warmup, args.anomaly_length, path)
    log.info("labelled faults on %.0f%% of the devices; ground truth: %s", 100 * plan.fraction, path)
    return plan


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _ensure_topics(settings: Settings) -> None:
    from lakehouse.kafka.topics import KafkaUnavailable, ensure_topics

    try:
        ensure_topics(settings, timeout=10)
    except KafkaUnavailable as e:  # the bridge itself waits for Kafka (backpressure)
        log.warning("could not ensure Kafka topics: %s", e)


def _run_one(settings: Settings, bridge_id: str | None) -> int:
    """One bridge in this process until SIGTERM/SIGINT."""
    from ingest.bridge import Bridge, tuned_gc

    bridge = Bridge(settings, bridge_id)
    with tuned_gc():
        bridge.run(_stop_on_signals())
    return 0


def bridge_main(argv: list[str] | None = None) -> int:
    """``python -m ingest.bridge``: one bridge instance, what ``iotlake bridge`` supervises."""
    from ingest.bridge import __doc__ as doc
    from lakehouse.settings import SettingsError, load_settings

    p = argparse.ArgumentParser(prog="python -m ingest.bridge", description=doc.splitlines()[0])
    p.add_argument("--config", help="settings file (default: ./iotlake.toml or $IOTLAKE_CONFIG)")
    p.add_argument("--bridge-id", help="stable MQTT client id (default: mqtt.client_id)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run_one(load_settings(args.config), args.bridge_id)
    except SettingsError as e:
        print(f"ingest.bridge: {e}", file=sys.stderr)
        return 2


def run_bridge(args: argparse.Namespace, settings: Settings) -> int:
    instances = args.instances or settings.bridge.instances
    if instances < 1:
        raise ValueError("--instances must be >= 1")
    _ensure_topics(settings)
    if instances == 1 and settings.bridge.instances == 1:
        return _run_one(settings, args.bridge_id)
    if args.bridge_id:
        raise ValueError("--bridge-id names one instance; with --instances K the ids are "
                         "<mqtt.client_id>-0..K-1")
    return _supervise(args, settings, instances)


def _child_env(args: argparse.Namespace, settings: Settings, instances: int, i: int) -> dict[str, str]:
    env = dict(os.environ)
    env["IOTLAKE_BRIDGE__INSTANCES"] = str(instances)
    if getattr(args, "config", None):
        env["IOTLAKE_CONFIG"] = os.path.abspath(args.config)
    if getattr(args, "data_root", None):
        env["IOTLAKE_DATA_ROOT"] = args.data_root
    if settings.bridge.metrics_port:
        env["IOTLAKE_BRIDGE__METRICS_PORT"] = str(settings.bridge.metrics_port + i)
    return env


def _supervise(args: argparse.Namespace, settings: Settings, instances: int) -> int:
    """Run K bridge processes; restart one that dies, stop all on SIGTERM/SIGINT."""
    stop = _stop_on_signals()
    ids = [f"{settings.mqtt.client_id}-{i}" for i in range(instances)]

    def spawn(i: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "ingest.bridge", "--bridge-id", ids[i]]
        if getattr(args, "verbose", False):
            argv.append("-v")
        return subprocess.Popen(argv, env=_child_env(args, settings, instances, i))

    procs = [spawn(i) for i in range(instances)]
    log.info("started %d bridge instances: %s", instances, ", ".join(ids))
    code = 0
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                continue
            if rc == 2:  # configuration error: restarting cannot help
                log.error("bridge %s rejected its configuration; stopping", ids[i])
                stop.set()
                code = 2
                break
            log.warning("bridge %s exited with %s; restarting it", ids[i], rc)
            time.sleep(1.0)
            procs[i] = spawn(i)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + settings.bridge.shutdown_timeout_seconds + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code


def run_simulator(args: argparse.Namespace, settings: Settings) -> int:
    from ingest.simulator import generate, publish, run_forever

    if args.rate <= 0 or args.devices < 1:
        raise ValueError("--rate must be > 0 and --devices >= 1")
    plan = anomaly_plan(args, settings)
    if args.events:
        n = args.events
        msgs = generate(settings, n, devices=args.devices, duplicates=int(n * args.duplicates),
                        malformed=int(n * args.malformed), late=int(n * args.late),
                        seed=args.seed, rate=args.rate, anomalies=plan)
        print(publish(settings, msgs, rate=args.rate))
        return 0
    faults = {"duplicates": args.duplicates, "malformed": args.malformed, "late": args.late,
              "seed": args.seed}
    run_forever(settings, args.rate, args.devices, _stop_on_signals(), faults, args.profile,
                anomalies=plan)
    return 0
