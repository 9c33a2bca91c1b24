"""``iotlake run`` (the live pipeline) and ``iotlake demo`` (a bounded, self-checking run).

Both start what the settings do not point elsewhere (embedded Mosquitto and Apache Kafka), the
MQTT -> Kafka bridge and the bronze -> silver -> gold streams, and stop all of it on Ctrl-C or
SIGTERM. ``--role`` runs one piece per process, for deployments with one process per pod.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from lakehouse.delta.read import row_count
from lakehouse.runtime import native_memory
from lakehouse.settings import Settings

log = logging.getLogger(__name__)

ROLES = ("all", "bridge", "streams", "bronze", "silver", "gold")
#: how often a running process hands freed native memory back (``lakehouse.runtime.native_memory``)
RELEASE_MEMORY_SECONDS = 60.0


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event, hurry: threading.Event | None = None) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop`` so shutdown is orderly (queries stopped, brokers closed); a
    second one sets ``hurry``: skip the wait for running batches to finish."""
    previous = {}

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if stop.is_set() and hurry is not None:
            log.warning("signal %s again: stopping now (running batches are replayed at "
                        "restart)", name)
            hurry.set()
            return
        log.info("signal %s: shutting down (again to skip the waits)", name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def bridge_thread(settings: Settings, wait_subscribed: float = 30.0) -> Iterator[object]:
    from prometheus_client import REGISTRY

    from ingest.bridge import Bridge
    from ingest.bridge_metrics import BridgeCollector

    bridge = Bridge(settings)
    # The process-wide registry is what `iotlake run` serves on observability.metrics_port:
    # bridge and stream series on one endpoint (bridge.metrics_port adds a bridge-only one).
    collector: BridgeCollector | None = BridgeCollector(bridge.bridge_id, lambda: bridge.stats,
                                                        bridge.latency)
    try:
        REGISTRY.register(collector)
    except ValueError:  # another in-process bridge already exports these series
        log.warning("bridge %s: metrics not on the process endpoint (another bridge is)",
                    bridge.bridge_id)
        collector = None
    stop = threading.Event()

    def target() -> None:
        try:
            bridge.run(stop)
        except BaseException as e:  # noqa: BLE001 - reported by check_bridge in the run loop
            bridge.failure = e
            log.exception("bridge stopped")

    t = threading.Thread(target=target, name="bridge", daemon=True)
    bridge.failure, bridge.thread, bridge.stop_requested = None, t, stop
    t.start()
    try:
        deadline = time.monotonic() + wait_subscribed
        while not bridge.subscribed.wait(0.1):
            refused = bridge.credentials_refused.is_set()  # no retry can help: fail now
            if refused or time.monotonic() > deadline:
                why = "the broker refused its credentials" if refused else f"within {wait_subscribed:.0f}s"
                raise RuntimeError(f"bridge did not subscribe to MQTT at {settings.mqtt_endpoint}: {why}")
        yield bridge
    finally:
        stop.set()
        t.join(30)
        if collector is not None:
            REGISTRY.unregister(collector)


def check_bridge(bridge) -> None:
    """Fail the run when its bridge thread died: a pipeline without its front door looks
    healthy (the streams idle) while devices' messages pile up in the MQTT broker."""
    if not bridge.thread.is_alive() and not bridge.stop_requested.is_set():
        why = f": {bridge.failure!r}" if bridge.failure is not None else ""
        raise RuntimeError(f"bridge {bridge.bridge_id} stopped{why}")


def release_spark(spark) -> None:
    """Detach our query listener, then stop the session: with the listener attached the JVM can
    still deliver ``onQueryTerminated`` to Python while the interpreter finalizes, which ended
    processes with SIGSEGV after a clean stop. Only for a process that owns its session."""
    detach_metrics(spark)
    spark.stop()


def detach_metrics(spark) -> None:
    """Write what the metrics listener buffered and detach it, stopping its writer thread (a
    session that lives on, e.g. a caller's, must not keep writing this run's metrics)."""
    listener = getattr(spark, "_iotlake_metrics", None)
    if listener is not None:
        listener.close()
        spark.streams.removeListener(listener)
        spark._iotlake_metrics = None


def run(settings: Settings, role: str = "all", simulate: float = 0.0, devices: int = 100,
        stop: threading.Event | None = None, anomalies=None) -> int:
    """Run until ``stop`` is set (or a signal arrives); stops the Spark session it used.
    ``anomalies``: the simulator's labelled faults (an ``ingest.simulator.faults.AnomalyPlan``)."""
    from orchestration.pipeline import LAYERS, Running, check_alive, start_layers
    from orchestration.services import embedded_services

    if role not in ("bridge", "bronze") or simulate:  # these move payloads without reading them
        settings.telemetry.require_metrics()  # before any broker starts
    stop = stop or threading.Event()
    hurry = threading.Event()
    native_memory.fix_mmap_threshold()  # this process lives for weeks: see lakehouse.runtime.native_memory
    with contextlib.ExitStack() as stack:
        stack.enter_context(_stop_on_signals(stop, hurry))
        if role == "all":
            stack.enter_context(embedded_services(settings))
        if settings.observability.metrics_port:
            from lakehouse.monitoring.metrics import serve

            serve(settings.observability.metrics_port, settings.observability.metrics_bind)
        bridge = None
        if role in ("all", "bridge"):
            bridge = stack.enter_context(bridge_thread(settings))
        running = None
        layers = LAYERS if role in ("all", "streams") else (role,) if role in LAYERS else ()
        if layers:
            from lakehouse.spark import spark_session

            spark = spark_session(settings, app_name=f"iotlake-{role}")
            # A new SparkContext replaces the SIGINT handler with one that cancels every job and
            # raises KeyboardInterrupt (Ctrl-C then killed running batches: thousands of lines of
            # stack traces). Ours again, so Ctrl-C stops the queries between batches.
            stack.enter_context(_stop_on_signals(stop, hurry))
            from lakehouse.monitoring.metrics import install

            install(spark, settings)
            stack.callback(release_spark, spark)  # after the queries stopped (callbacks run LIFO)
            running = Running(spark, settings, start_layers(spark, settings, layers))
            stack.callback(running.stop, settings.stream.graceful_stop_seconds, hurry)
            if settings.maintenance.auto and role in ("all", "streams"):
                from orchestration.upkeep import Upkeep

                stack.callback(Upkeep(settings).start().stop)  # stops before the queries do
        sim_stop = threading.Event()
        if simulate > 0:
            from ingest.simulator import run_forever

            t = threading.Thread(target=run_forever, args=(settings, simulate, devices, sim_stop),
                                 kwargs={"anomalies": anomalies}, name="simulator", daemon=True)
            t.start()
            stack.callback(lambda: (sim_stop.set(), t.join(10)))
        log.info("iotlake running (role=%s); Ctrl-C to stop", role)
        from orchestration.status import StatusWriter  # <run_dir>/status.json, once a second

        status = stack.enter_context(StatusWriter(settings, role, running, bridge))
        if running and role in ("all", "streams"):  # where silver's and gold's batches are made
            from orchestration.alerting import alerting

            engine = stack.enter_context(alerting(spark, settings, lambda: status.latest))
            if engine is not None:
                status.alerts = engine.summary
        released = time.monotonic()
        while not stop.wait(1.0):
            status.tick()
            if running:
                check_alive(running.queries)
            if bridge is not None:
                check_bridge(bridge)
            if time.monotonic() - released >= RELEASE_MEMORY_SECONDS:
                # The DataFrames each batch creates sit in Python reference cycles and, through
                # py4j, keep their plans alive in the JVM until CPython's next full collection,
                # minutes apart under this load.
                gc.collect()
                native_memory.release()
                released = time.monotonic()
    log.info("iotlake stopped")
    return 0


def demo(settings: Settings, events: int, devices: int = 10, duplicates: int | None = None,
         malformed: int | None = None, timeout: float = 600.0, start: datetime | None = None,
         seed: int = 0, stop_spark: bool = False) -> dict:
    """Publish ``events`` simulated messages end to end and account for every one of them
    (``stop_spark``: the caller owns the process, so its session is stopped at the end)."""
    from ingest.simulator import generate, publish
    from lakehouse.spark import spark_session
    from orchestration.pipeline import Running, start_layers
    from orchestration.services import embedded_services

    settings.telemetry.require_metrics()
    duplicates = events // 40 if duplicates is None else duplicates
    malformed = events // 100 if malformed is None else malformed
    t0 = time.monotonic()
    with embedded_services(settings), bridge_thread(settings):
        spark = spark_session(settings, app_name="iotlake-demo")
        from lakehouse.monitoring.metrics import install

        install(spark, settings)
        running = Running(spark, settings, start_layers(spark, settings))
        try:
            messages = generate(settings, events, devices=devices, duplicates=duplicates,
                                malformed=malformed, seed=seed, start=start)
            published = publish(settings, messages)
            bronze_path = settings.table_path("bronze")
            running.wait_caught_up(lambda: row_count(bronze_path), published, timeout)
        finally:
            running.stop()
            if stop_spark:
                release_spark(spark)
            else:
                detach_metrics(spark)
    q = _quality_totals(settings)
    result = {
        "published": published,
        "bronze_rows": row_count(settings.table_path("bronze")),
        "silver_rows": row_count(settings.table_path("silver")),
        "quarantine_rows": row_count(settings.table_path("quarantine")),
        "duplicates_dropped": q.get("duplicates", 0),
        "late_quarantined": q.get("late", 0),
        "gold_rows": row_count(settings.table_path("gold_metrics_1m")),
        "seconds": round(time.monotonic() - t0, 2),
    }
    result["ok"] = (result["bronze_rows"] == published and result["silver_rows"]
                    + result["quarantine_rows"] + result["duplicates_dropped"] == result["bronze_rows"])
    return result


def _quality_totals(settings: Settings) -> dict[str, int]:
    from lakehouse.delta.read import read_table, table_exists

    path = settings.table_path("quality_log")
    if not table_exists(path):
        return {}
    t = read_table(path).to_pandas()
    t = t[t["kind"] == "counter"]
    totals: dict[str, int] = {}
    for name, details in zip(t["expectation"], t["details"], strict=True):
        totals[name] = totals.get(name, 0) + json.loads(details)["count"]
    return totals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the pipeline (brokers, bridge, bronze/silver/gold streams)")
    p.add_argument("--role", choices=ROLES, default="all",
                   help="run one piece per process (default: all in this process)")
    p.add_argument("--simulate", type=float, default=0.0, metavar="RATE",
                   help="also publish simulated telemetry at RATE messages/s")
    p.add_argument("--devices", type=int, default=100, help="simulated devices (with --simulate)")
    from ingest.cli import add_anomaly_arguments

    add_anomaly_arguments(p)
    p.set_defaults(func=_run_cmd)

    d = sub.add_parser("demo", help="publish N simulated events end to end and check every layer")
    d.add_argument("--events", type=_positive, default=2000)
    d.add_argument("--devices", type=_positive, default=10)
    d.add_argument("--duplicates", type=int, default=None, help="default: events/40")
    d.add_argument("--malformed", type=int, default=None, help="default: events/100")
    d.add_argument("--timeout", type=float, default=600.0)
    d.add_argument("--start", type=_utc_time, default=None, metavar="ISO_TIME",
                   help="simulated clock start (with --seed: the same bytes every run)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo_cmd)


def _run_cmd(args: argparse.Namespace, settings: Settings) -> int:
    from ingest.cli import anomaly_plan

    if args.anomalies and args.simulate <= 0:
        raise ValueError("--anomalies labels the simulator's faults: give --simulate RATE too")
    if args.anomalies and settings.telemetry.sparkplug:
        raise ValueError("--anomalies needs JSON devices: the simulator's Sparkplug devices keep "
                         "no simulated clock to label faults by")
    return run(settings, args.role, args.simulate, args.devices, anomalies=anomaly_plan(args, settings))


def _demo_cmd(args: argparse.Namespace, settings: Settings) -> int:
    """Each demo gets a fresh data root of its own under ``<data_root>/demo/`` (tables,
    checkpoints and the embedded brokers' logs), so its accounting is its run's alone, never the
    totals of a lake ``iotlake run`` filled."""
    settings = settings.model_copy(deep=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    if settings.remote:
        settings.data_root = f"{settings.data_root.rstrip('/')}/demo/{stamp}"
        settings.storage.checkpoint_root = str(settings.checkpoint_root / "demo" / stamp)
    else:
        settings.data_root = str(settings.root / "demo" / stamp)
    log.info("demo data root: %s (delete it when done)", settings.data_root)
    result = demo(settings, args.events, args.devices, args.duplicates, args.malformed, args.timeout,
                  start=args.start, seed=args.seed, stop_spark=True)
    print(json.dumps({**result, "data_root": settings.data_root}))
    return 0 if result["ok"] else 1


def _utc_time(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO time (e.g. 2026-01-01T00:00:00Z)") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {v})")
    return v
