"""Embedded brokers: Mosquitto (MQTT) and Apache Kafka (one KRaft node) on the project's own ports.

Used when no external broker is configured. Each service is a child process with its config,
data and log under ``<data_root>/run``; it is health-checked before use and stopped cleanly
(SIGTERM, then SIGKILL) on exit, so nothing is left behind. Both keep their data on disk there:
restarting a broker, or ``iotlake run``, loses nothing it had acknowledged.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lakehouse.kafka import auth as kafka_auth
from lakehouse.kafka.topics import ensure_topics
from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.runtime import jars, native_memory
from lakehouse.runtime.jars import kafka_classpath
from lakehouse.settings import Settings

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """An embedded service could not start; the message says why and what to do."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(pair: bool = False) -> int:
    """A free loopback port for a throwaway server (tests, benchmarks); ``pair``: its successor is
    free too (the embedded Kafka's controller port).

    Chosen below the kernel's ephemeral range: a port the kernel handed out (bind to 0) is also
    what it hands to outgoing connections, so another process's client socket could take it
    between this check and the server's bind."""
    import random

    lo, hi = _ephemeral_range()
    bottom, top = (10000, lo - 2) if lo > 12000 else (hi + 1, 65533)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(bottom, top)
        if _bindable(port) and (not pair or _bindable(port + 1)):
            return port
    raise ServiceError("no free port pair found on 127.0.0.1")


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


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if not found:
        raise ServiceError("mosquitto is not installed: run `make install` (apt-get install mosquitto)")
    return found


def _alive(pid: int) -> bool:
    """Running (not exited, nor a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Service:
    name: str
    port: int
    argv: list[str]
    log_file: Path
    #: The setting (as its environment variable) that moves ``port``, for the "in use" error.
    port_env: str = ""
    #: Further ports the service listens on (with the variable that moves each).
    other_ports: dict[int, str] = field(default_factory=dict)
    #: Before each start (Kafka: write its config, format its log dir the first time); after
    #: the port opened: until the service answers.
    prepare: Callable[[], None] | None = field(default=None, repr=False)
    ready: Callable[[float], None] | None = field(default=None, repr=False)
    start_timeout: float = 20.0
    stop_timeout: float = 10.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pid_file(self) -> Path:
        return self.log_file.with_suffix(".pid")

    def _stop_leftover(self) -> None:
        """A broker left running by a process killed with -9 (it runs in its own session) still
        holds the ports and the data dir: stop it, as the run that started it would have."""
        try:
            pid = int(self.pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if [a.decode(errors="replace") for a in cmdline if a] != self.argv:
            return  # another process reuses the pid
        log.warning("stopping %s (pid %d) left running by an earlier run", self.name, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)

    def start(self, timeout: float | None = None) -> Service:
        timeout = self.start_timeout if timeout is None else timeout
        self._stop_leftover()
        for port, env in {self.port: self.port_env, **self.other_ports}.items():
            if port_in_use(port):
                raise ServiceError(
                    f"cannot start embedded {self.name}: port {port} is already in use. Stop the "
                    f"process using it, or choose another port in iotlake.toml / the environment "
                    f"({env}), or point iotlake at an existing broker.")
        if self.prepare is not None:
            self.prepare()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        self.pid_file.write_text(str(self.proc.pid))
        t0 = time.monotonic()
        try:
            wait_for_port(self.port, self.proc, timeout, self.name, self.log_file)
            if self.ready is not None:
                self.ready(max(1.0, timeout - (time.monotonic() - t0)))
        except BaseException:
            self.stop()
            raise
        log.info("started %s on 127.0.0.1:%d (pid %d)", self.name, self.port, self.proc.pid)
        return self

    def stop(self, timeout: float | None = None) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs of SIGTERM: killing it", self.name,
                        self.stop_timeout if timeout is None else timeout)
            self.proc.kill()
            self.proc.wait(5)
        log.info("stopped %s", self.name)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def mosquitto_service(settings: Settings, port: int | None = None, extra_conf: str = "") -> Service:
    """Mosquitto with its users and ACLs (``lakehouse.mqtt.auth``, rewritten from the device
    store and the telemetry model at every start), unless ``extra_conf`` brings a password file
    of its own."""
    port = port or settings.mqtt.embedded_port
    run = settings.run_dir / f"mosquitto-{port}"
    run.mkdir(parents=True, exist_ok=True)
    conf = run / "mosquitto.conf"
    own_auth = "password_file" not in extra_conf
    # Persistent sessions + large queues: a stopped bridge must find its QoS-1 messages waiting.
    conf.write_text(
        (mqtt_auth.broker_conf(settings, port) if own_auth else f"listener {port} 127.0.0.1\n")
        + f"persistence true\npersistence_location {run}/\n"
        "max_queued_messages 0\nmax_inflight_messages 0\nmax_queued_bytes 0\n"
        "persistent_client_expiration 1d\nset_tcp_nodelay true\n"
        # information: "Reloading config." (mqtt_auth.reload waits for it); notice: refusals;
        # stderr: unbuffered, each line in the log file when it happens
        "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
        # as root, mosquitto would switch to the 'mosquitto' user and lose access to our data dir
        + ("user root\n" if os.geteuid() == 0 and "user " not in extra_conf else "")
        + extra_conf
    )

    def prepare() -> None:
        if not own_auth:
            return
        mqtt_auth.write_files(settings)
        m = settings.mqtt
        if m.allow_anonymous:
            log.warning("mqtt.allow_anonymous = true: any client that reaches %s:%d can publish as "
                        "any device", m.embedded_bind, port)
        if not mqtt_auth.names_devices(settings):
            log.warning("the devices' MQTT topics (%s) do not name the device: a device can publish "
                        "as another; put {device_id} in telemetry.topic_pattern",
                        settings.telemetry.topic_pattern if settings.subscribes_to_model
                        else m.topic_filter)

    m = settings.mqtt
    others = {m.embedded_device_port: "IOTLAKE_MQTT__EMBEDDED_DEVICE_PORT",
              m.embedded_cert_port: "IOTLAKE_MQTT__EMBEDDED_CERT_PORT"} if own_auth else {}
    return Service("mosquitto", port, [mosquitto_binary(), "-c", str(conf)], run / "mosquitto.log",
                   port_env="IOTLAKE_MQTT__EMBEDDED_PORT", prepare=prepare,
                   other_ports={p: env for p, env in others.items() if p})


def java_binary() -> str:
    found = jars.java_binary()
    if not found:
        raise ServiceError("java is not installed: run `make install` (apt-get install openjdk-17-jre-headless)")
    return found


#: WARN and above into the service's log file (its stdout), plus the broker's "started" line.
KAFKA_LOG4J2 = """\
status = warn
shutdownHook = disable
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.out.ref = out
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = info
"""


def kafka_controller_port(settings: Settings, port: int) -> int:
    """``kafka.embedded_controller_port``, 0 meaning the broker's port + 1 (also for a broker on
    another port than the configured one: test workers 100 ports apart never collide)."""
    configured = settings.kafka.embedded_controller_port
    return configured if configured and port == settings.kafka.embedded_port else port + 1


def _listeners(settings: Settings, port: int) -> dict[str, object]:
    """The listeners' security. SCRAM: the client listener is also the inter-broker one (a
    plaintext listener for the node itself would be a port any local process could use without
    the credential; one node replicates to no other broker). The controller's takes SASL/PLAIN
    with the same credential, from a static JAAS line: KRaft controllers cannot check SCRAM,
    whose credentials live in their own log, and a plaintext controller port would let any
    local process delete topics or change credentials through it."""
    if not kafka_auth.scram_on(settings):
        return {"listeners": f"PLAINTEXT://127.0.0.1:{port}",
                "inter.broker.listener.name": "PLAINTEXT",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"}
    user, password = kafka_auth.credential(settings)
    login = f'username="{user}" password="{password}"'
    mech = kafka_auth.MECHANISM
    return {"listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": mech,
            "sasl.mechanism.inter.broker.protocol": mech,
            f"listener.name.sasl_plaintext.{mech.lower()}.sasl.jaas.config":
                f"org.apache.kafka.common.security.scram.ScramLoginModule required {login};",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                f'org.apache.kafka.common.security.plain.PlainLoginModule required {login} '
                f'user_{user}="{password}";'}


def kafka_properties(settings: Settings, port: int, controller_port: int, log_dir: Path) -> str:
    """One KRaft node, broker and controller in one JVM, on loopback only; with
    ``kafka.embedded_security = "sasl_scram"`` both listeners require a login (``_listeners``)."""
    k = settings.kafka
    client = _listeners(settings, port)
    props = {
        "process.roles": "broker,controller",
        "node.id": 1,
        # static voters: `format --standalone` would write a dynamic quorum, which conflicts
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        **client,
        "listeners": f"{client['listeners']},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": client["listeners"],
        "controller.listener.names": "CONTROLLER",
        "log.dirs": log_dir,
        "auto.create.topics.enable": "false",  # ensure_topics creates ours with their partitions
        "num.partitions": k.partitions,
        "offsets.topic.replication.factor": 1,
        "offsets.topic.num.partitions": 4,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "transaction.state.log.num.partitions": 4,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
        # After a kill -9 the restarted node waits out its own previous broker session before it
        # serves (Kafka's default, 9 s, held up every restart after a crash); one node has no
        # other broker to fail over to, so a shorter session only makes a crash's restart quicker.
        "broker.session.timeout.ms": 4000,
        "broker.heartbeat.interval.ms": 1000,
        "num.network.threads": 2,
        "num.io.threads": 4,
        # Retention: per partition, by age and by size. Deletion works on closed segments, so
        # segments roll at least daily and at embedded_segment_bytes.
        "log.retention.hours": k.embedded_retention_hours,
        "log.retention.bytes": k.embedded_retention_bytes,
        "log.segment.bytes": k.embedded_segment_bytes,
        "log.roll.hours": max(1, min(24, k.embedded_retention_hours)),
        "log.retention.check.interval.ms": 60_000,
    }
    return "".join(f"{key}={value}\n" for key, value in props.items())


def kafka_service(settings: Settings, port: int | None = None, record_archive: Path | None = None) -> Service:
    """Apache Kafka (KRaft, one node) from the Maven-resolved jars, its log under
    ``<data_root>/run/kafka-<port>/data``: formatted once, then reused by every start, so records
    and offsets survive a restart of the broker or of ``iotlake run``. It maps its classes from
    ``jars.kafka_class_archive()`` when there is one; ``record_archive``: write that archive
    when the broker exits instead."""
    port = port or settings.kafka.embedded_port
    cport = kafka_controller_port(settings, port)
    run = settings.run_dir / f"kafka-{port}"
    data = run / "data"
    conf, log4j = run / "server.properties", run / "log4j2.properties"
    java, classpath = java_binary(), kafka_classpath()
    heap = settings.kafka.embedded_heap_mb
    # Serial GC and C1 only: on a small machine the broker starts in about half the time, with
    # no slower produce, and RSS stays near the heap (docs/history/benchmarks.md).
    # The class archive: the broker starts in ~40% less time and CPU (docs/history/benchmarks.md).
    cds = [] if record_archive else jars.archive_options(jars.kafka_class_archive())
    jvm = [java, f"-Xmx{heap}m", f"-Xms{min(64, heap)}m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
           "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true", *native_memory.jvm_options(java),
           *cds, f"-Dlog4j2.configurationFile={log4j}", "-cp", classpath]
    broker = [*jvm, *([f"-XX:ArchiveClassesAtExit={record_archive}"] if record_archive else []),
              "kafka.Kafka", str(conf)]

    def prepare() -> None:
        run.mkdir(parents=True, exist_ok=True)
        _write_private(conf, kafka_properties(settings, port, cport, data))  # may hold the password
        log4j.write_text(KAFKA_LOG4J2)
        if (data / "meta.properties").exists():
            _check_scram_format(settings, run, data)
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # "=": a cluster id may start with "-"
        with _scram_format_args(settings, run) as scram:
            r = subprocess.run([*jvm, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
                                f"--config={conf}", *scram], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise ServiceError(f"formatting Kafka's log dir {data} failed:\n{r.stdout}{r.stderr}")
        if kafka_auth.scram_on(settings):
            (run / _SCRAM_MARK).write_text(kafka_auth.fingerprint(settings))

    def ready(timeout: float) -> None:
        wait_for_kafka(f"127.0.0.1:{port}", timeout, svc, kafka_auth.client_security(settings))

    svc = Service("kafka", port, broker, run / "kafka.log",
                  port_env="IOTLAKE_KAFKA__EMBEDDED_PORT",
                  other_ports={cport: "IOTLAKE_KAFKA__EMBEDDED_CONTROLLER_PORT"},
                  prepare=prepare, ready=ready, start_timeout=120.0, stop_timeout=60.0)
    return svc


#: Beside the log dir: the fingerprint of the SCRAM credential it was formatted with.
_SCRAM_MARK = "scram-formatted"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)


@contextlib.contextmanager
def _scram_format_args(settings: Settings, run: Path) -> Iterator[list[str]]:
    """``--add-scram``: KRaft takes SCRAM credentials into its metadata log at format time.
    The password goes in an owner-only argument file (``java @file``), not on the command
    line, where any local process could read it."""
    if not kafka_auth.scram_on(settings):
        yield []
        return
    user, password = kafka_auth.credential(settings)
    args = run / ".format-args"
    _write_private(args, f"--add-scram={kafka_auth.MECHANISM}=[name={user},password={password}]\n")
    try:
        yield [f"@{args}"]
    finally:
        args.unlink(missing_ok=True)


def _check_scram_format(settings: Settings, run: Path, data: Path) -> None:
    """A log dir formatted without this data root's credential would refuse every login."""
    if not kafka_auth.scram_on(settings):
        return
    mark = run / _SCRAM_MARK
    if not mark.exists() or mark.read_text().strip() != kafka_auth.fingerprint(settings):
        raise ServiceError(
            f"the embedded Kafka's log dir {data} was formatted without the SCRAM credential in "
            f"{kafka_auth.credential_file(settings)}, so the broker would refuse iotlake's clients: "
            f"set kafka.embedded_security = \"plaintext\" again, or delete {run} (its records are "
            f"lost) to format it anew with SCRAM")


def wait_for_kafka(bootstrap: str, timeout: float, svc: Service | None = None,
                   security: dict[str, object] | None = None) -> None:
    """Until the broker answers metadata with itself in it (its port opens earlier);
    ``security``: the login it asks for (``kafka_auth.client_security``)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log.connection.close": False, **(security or {})})
    deadline = time.monotonic() + timeout
    while True:
        if svc is not None and svc.proc is not None and svc.proc.poll() is not None:
            tail = svc.log_file.read_text(errors="replace")[-2000:] if svc.log_file.exists() else ""
            raise ServiceError(f"kafka exited with code {svc.proc.returncode} during start-up:\n{tail}")
        try:
            if admin.list_topics(timeout=2).brokers:
                return
        except Exception:  # noqa: BLE001, S110 - not answering yet
            pass
        if time.monotonic() > deadline:
            raise ServiceError(f"Kafka at {bootstrap} did not answer within {timeout:.0f}s")
        time.sleep(0.2)


@contextlib.contextmanager
def embedded_services(settings: Settings, *, mqtt: bool = True, kafka: bool = True) -> Iterator[list[Service]]:
    """Start what the settings do not point elsewhere; stop it all on exit."""
    started: list[Service] = []
    try:
        if kafka and not settings.kafka.bootstrap:
            started.append(kafka_service(settings).start())
        if mqtt and not settings.mqtt.host:
            started.append(mosquitto_service(settings).start())
        if kafka:
            ensure_topics(settings)
        yield started
    finally:
        for s in reversed(started):
            s.stop()
