"""Bridge throughput and latency against the C baseline ``mosquitto_sub | kcat``.

Capacity: with the subscriber's persistent session established and the subscriber stopped, M
QoS-1 messages (~150 bytes) are queued in Mosquitto; then the subscriber starts and drains them.
Rate = messages / (last - first Kafka record timestamp). Latency: steady publishing at --rate
msg/s with the send time in the payload, measured when a Kafka consumer sees the record; the
same records produced straight to Kafka give the floor that Kafka itself sets.
``mosquitto_sub`` and Debian's ``kcat`` are installed with apt-get when missing (as root or with
sudo). ``--bridge-instances K`` also drains with K bridge processes in one shared subscription (an extra
figure: the issue's ``ratio`` is one bridge process against one C pipeline).
``--secure`` also drains through a broker of its own with authentication and TLS on (the
embedded broker's ``mqtt.tls``, 10,000 devices provisioned by ``iotlake devices import``, each
publisher one device's credential over TLS, the bridge its role's): ``secure_ratio`` is its
rate over the plaintext bridge's in the same run, ``provision_10k_s`` the import's wall time.
The last line printed is one JSON object.

Usage: .venv/bin/python bench/bridge_throughput.py [--messages 200000] [--rate 5000] [--secure] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from lakehouse.kafka.topics import ensure_topics
from lakehouse.mqtt import tls as mqtt_tls
from lakehouse.settings import Settings, load_settings
from orchestration.services import embedded_services, free_port

DEVICES = 10
PAD = 150
#: seconds without a new Kafka record that mean the subscriber is done (--smoke: shorter)
QUIET_S = 3.0


def payload(seq: int, sent_ns: int = 0) -> bytes:
    """~150-byte JSON with a unique event id (and the send time for latency)."""
    raw = b'{"event_id":"%032x","device_id":"dev-%05d","seq":%d,"sent_ns":%d,"temperature":21.5,"pad":"' % (
        seq, seq % DEVICES + 1, seq, sent_ns)
    return raw + b"x" * max(0, PAD - len(raw) - 2) + b'"}'


def topic_of(prefix: str, seq: int) -> str:
    return f"{prefix}/dev-{seq % DEVICES + 1:05d}/t"


def variant(base: Settings, name: str, protocol: str = "5") -> Settings:
    s = load_settings(environ={}, **{
        **base.model_dump(),
        "kafka": {**base.kafka.model_dump(), "topic": f"bench-{name}", "dead_letter_topic": f"bench-{name}-dlq"},
        "mqtt": {**base.mqtt.model_dump(), "client_id": f"bench-{name}", "topic_filter": f"{name}/+/t",
                 "protocol": protocol},
    })
    ensure_topics(s)
    return s


class CPublisher:
    """One ``mosquitto_pub -l -q 1`` per device topic fed through stdin: a publisher fast enough
    not to be the bottleneck (a Python publisher competes with the bridge for the 2 cores)."""

    def __init__(self, s: Settings, logins: dict[str, str] | None = None) -> None:
        """``logins``: device id -> password, each publisher its device's over TLS."""
        host, port = s.mqtt_endpoint
        self.prefix = s.mqtt.topic_filter.split("/")[0]

        def secure(d: int) -> list[str]:
            if logins is None:
                return []
            device = f"dev-{d % DEVICES + 1:05d}"
            return ["--cafile", str(mqtt_tls.ca_file(s)), "-u", device, "-P", logins[device]]

        self.procs = [subprocess.Popen(["mosquitto_pub", "-h", host, "-p", str(port), "-q", "1", "-l",
                                        "-i", f"pub-{self.prefix}-{d}", "-t", topic_of(self.prefix, d),
                                        *secure(d)],
                                       stdin=subprocess.PIPE) for d in range(DEVICES)]

    def send(self, seq: int, data: bytes, flush: bool = False) -> None:
        w = self.procs[seq % DEVICES].stdin
        w.write(data + b"\n")
        if flush:
            w.flush()

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            if p.wait(120) != 0:
                raise RuntimeError(f"mosquitto_pub exited with {p.returncode}")


class KafkaPublisher:
    """The latency floor: the same records produced straight to Kafka (the bridge's producer
    settings), no MQTT: what a consumer sees of them is Kafka's own publish-to-visible time."""

    def __init__(self, s: Settings) -> None:
        self.topic = s.kafka.topic
        self.p = Producer({"bootstrap.servers": s.kafka_bootstrap, "linger.ms": s.bridge.linger_ms,
                           "acks": "all", "enable.idempotence": True})

    def send(self, seq: int, data: bytes, flush: bool = False) -> None:
        self.p.produce(self.topic, data, key=b"dev-%05d" % (seq % DEVICES + 1))
        self.p.poll(0)

    def close(self) -> None:
        self.p.flush(30)


def kafka_env(s: Settings) -> dict[str, str]:
    # IOTLAKE_BRIDGE__* from the caller tune the bridge (e.g. max_inflight, linger_ms)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("IOTLAKE_") or k.startswith("IOTLAKE_BRIDGE__")}
    host, port = s.mqtt_endpoint
    env.update({"IOTLAKE_KAFKA__BOOTSTRAP": s.kafka_bootstrap, "IOTLAKE_KAFKA__TOPIC": s.kafka.topic,
                "IOTLAKE_KAFKA__DEAD_LETTER_TOPIC": s.kafka.dead_letter_topic,
                "IOTLAKE_MQTT__HOST": host, "IOTLAKE_MQTT__PORT": str(port),
                "IOTLAKE_MQTT__CLIENT_ID": s.mqtt.client_id, "IOTLAKE_MQTT__TOPIC_FILTER": s.mqtt.topic_filter,
                "IOTLAKE_MQTT__PROTOCOL": s.mqtt.protocol,
                "IOTLAKE_DATA_ROOT": s.data_root, "IOTLAKE_BRIDGE__LOG_INTERVAL_SECONDS": "5"})
    if s.mqtt.tls:  # the secure broker: the bridge logs in with its role's credential over TLS
        env.update({"IOTLAKE_MQTT__TLS": "true", "IOTLAKE_MQTT__ALLOW_ANONYMOUS": "false",
                    "IOTLAKE_MQTT__EMBEDDED_PORT": str(port)})
    return env


class Subscriber:
    """The bridge (``python -m ingest.bridge``) or the baseline pipeline, as a process group."""

    def __init__(self, kind: str, s: Settings, workdir: Path, instances: int = 1) -> None:
        self.kind, self.s, self.workdir = kind, s, workdir
        self.instances = instances
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"{s.kafka.topic}.log"

    def start(self) -> None:
        out = open(self.log, "ab")
        if self.kind == "bridge":
            argv = [sys.executable, "-m", "ingest.bridge"]
            if self.instances > 1:  # `iotlake bridge --instances K`: a shared subscription
                argv = [sys.executable, "-m", "orchestration.cli", "bridge", "--instances",
                        str(self.instances)]
            elif os.environ.get("BENCH_PROFILE"):  # cProfile output per bridge run, for tuning
                argv[1:1] = ["-m", "cProfile", "-o", f"{os.environ['BENCH_PROFILE']}.{self.s.kafka.topic}"]
            env = kafka_env(self.s)
        else:
            host, port = self.s.mqtt_endpoint
            argv = ["sh", "-c", f"mosquitto_sub -q 1 -c -i {self.s.mqtt.client_id} -h {host} -p {port} "
                                f"-t '{self.s.mqtt.topic_filter}' | "
                                f"kcat -P -b {self.s.kafka_bootstrap} -t {self.s.kafka.topic} -X linger.ms=5"]
            env = dict(os.environ)
        self.proc = subprocess.Popen(argv, env=env, cwd=self.workdir, stdout=out,
                                     stderr=out, start_new_session=True)
        out.close()
        if self.kind == "bridge":
            deadline = time.monotonic() + 30
            while self.log.read_text().count("subscribed to") < self.instances:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bridge did not start:\n{self.log.read_text()[-2000:]}")
                time.sleep(0.02)
        else:
            time.sleep(1.5)  # mosquitto_sub has no readiness signal

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def watermarks(c: Consumer, topic: str) -> int:
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts)


def wait_drained(s: Settings, quiet: float | None = None, timeout: float = 600.0) -> int:
    """Until the topic stops growing for ``quiet`` seconds (the subscriber may still be working);
    the number of records it then holds."""
    quiet = QUIET_S if quiet is None else quiet
    c = Consumer({"bootstrap.servers": s.kafka_bootstrap, "group.id": "bench-wm"})
    try:
        last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            wm = watermarks(c, s.kafka.topic)
            if wm != last:
                last, since = wm, time.monotonic()
            elif wm > 0 and time.monotonic() - since > quiet:
                return wm
            time.sleep(0.25)
    finally:
        c.close()
    raise TimeoutError(f"{s.kafka.topic} still growing after {timeout:.0f} s")


def read_all(s: Settings, idle: float | None = None, total: int | None = None) -> Iterator:
    """Every record of the topic: ``total`` of them when known, else until none for ``idle`` s."""
    idle = QUIET_S if idle is None else idle
    c = Consumer({"bootstrap.servers": s.kafka_bootstrap, "group.id": f"bench-{time.time_ns()}",
                  "enable.auto.commit": False})
    try:
        parts = c.list_topics(s.kafka.topic, timeout=10).topics[s.kafka.topic].partitions
        c.assign([TopicPartition(s.kafka.topic, p, -2) for p in parts])
        last, got = time.monotonic(), 0
        while time.monotonic() - last < idle and got != total:
            for m in c.consume(10_000, 0.5):
                if not m.error():
                    last, got = time.monotonic(), got + 1
                    yield m
    finally:
        c.close()


def capacity(kind: str, s: Settings, n: int, workdir: Path, instances: int = 1,
             logins: dict[str, str] | None = None) -> dict:
    sub = Subscriber(kind, s, workdir, instances)
    sub.start()  # establish the persistent session ...
    sub.stop()  # ... and go away: the broker queues from now on
    t = time.monotonic()
    pub = CPublisher(s, logins)
    for i in range(n):
        pub.send(i, payload(i))
    pub.close()
    pub_s = time.monotonic() - t
    t = time.monotonic()
    sub.start()
    try:
        total = wait_drained(s)
    finally:
        sub.stop()
    wall = time.monotonic() - t
    seen, ts = set(), []
    for m in read_all(s, total=total):
        seen.add(json.loads(m.value())["seq"])
        ts.append(m.timestamp()[1])
    span = (max(ts) - min(ts)) / 1000 if ts else float("nan")
    ts.sort()
    # the longest pause between consecutive records: a stall (e.g. Kafka producer warm-up)
    # shows here, not in the rate
    gap = max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0)
    res = {"msgs_per_s": round(len(seen) / span) if span else 0, "span_s": round(span, 2),
           "records": len(ts), "distinct": len(seen), "lost": n - len(seen & set(range(n))),
           "missing_sample": sorted(set(range(n)) - seen)[:5],
           "publish_msgs_per_s": round(n / pub_s), "wall_s_incl_start": round(wall, 2),
           "longest_gap_ms": gap}
    print(f"capacity {kind}{f' x{instances}' if instances > 1 else ''}: {res}", flush=True)
    return res


def secure_capacity(base: Settings, n: int, workdir: Path, fleet: int) -> tuple[dict, float]:
    """The bridge's capacity through a broker with authentication and TLS on, and the wall time
    of ``iotlake devices import`` of ``fleet`` devices onto it (running: one reload)."""
    port = free_port()
    sec = load_settings(environ={}, **{
        **base.model_dump(), "data_root": str(workdir / "secure"),
        "kafka": {**base.kafka.model_dump(), "topic": "bench-capsec", "dead_letter_topic": "bench-capsec-dlq"},
        "mqtt": {**base.mqtt.model_dump(), "host": "", "port": 0, "embedded_port": port,
                 "allow_anonymous": False, "tls": True, "username": "", "password": "",
                 "client_id": "bench-capsec", "topic_filter": "capsec/+/t", "protocol": "5"}})
    ensure_topics(sec)
    csv = workdir / "fleet.csv"
    csv.write_text("device_id,site,labels\n" + "".join(f"dev-{i:05d},site-{i % 20},\n" for i in range(1, fleet + 1)))
    cfg = sec.save(workdir / "secure.json")
    with embedded_services(sec, kafka=False):
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "orchestration.cli", "--config", str(cfg), "devices",
                              "import", str(csv)], capture_output=True, text=True, check=True).stdout
        provision_s = time.monotonic() - t
        logins = {c["device_id"]: c["password"] for c in map(json.loads, out.splitlines())}
        assert len(logins) == fleet, f"{len(logins)} of {fleet} provisioned"
        res = capacity("bridge", load_settings(environ={}, **{**sec.model_dump(), "mqtt": {
            **sec.mqtt.model_dump(), "host": "127.0.0.1", "port": port}}), n, workdir, logins=logins)
    print(f"provisioned {fleet} devices in {provision_s:.1f} s", flush=True)
    return res, provision_s


def latency(kind: str, s: Settings, rate: float, seconds: float, warmup: float,
            workdir: Path) -> dict:
    n = int(rate * seconds)
    skip = int(rate * warmup)
    lat_ms: dict[int, float] = {}
    stop = threading.Event()

    def consume() -> None:
        c = Consumer({"bootstrap.servers": s.kafka_bootstrap, "group.id": f"lat-{time.time_ns()}",
                      "enable.auto.commit": False, "fetch.wait.max.ms": 5, "fetch.min.bytes": 1})
        parts = c.list_topics(s.kafka.topic, timeout=10).topics[s.kafka.topic].partitions
        c.assign([TopicPartition(s.kafka.topic, p, -2) for p in parts])
        while not stop.is_set():
            # poll() returns with the first record; consume(n, t) would wait the whole t for n
            # records and add up to t to every latency (it did: 50 ms at p99 before)
            first = c.poll(0.05)
            if first is None:
                continue
            now = time.time_ns()
            for m in [first, *c.consume(1000, 0)]:
                if m.error():
                    continue
                d = json.loads(m.value())
                lat_ms.setdefault(d["seq"], (now - d["sent_ns"]) / 1e6)
        c.close()

    sub = Subscriber(kind, s, workdir) if kind != "kafka" else None
    if sub:
        sub.start()
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        pub = CPublisher(s) if sub else KafkaPublisher(s)
        t0 = time.monotonic()
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pub.send(i, payload(i, time.time_ns()), flush=True)
        pub.close()
        # every record in, or none for QUIET_S (the baseline pipeline drops a few at times)
        deadline, seen, since = time.monotonic() + 30, -1, time.monotonic()
        while len(lat_ms) < n and time.monotonic() < deadline:
            if len(lat_ms) != seen:
                seen, since = len(lat_ms), time.monotonic()
            elif time.monotonic() - since > QUIET_S:
                break
            time.sleep(0.1)
    finally:
        stop.set()
        reader.join(10)
        if sub:
            sub.stop()
    vals = sorted(v for k, v in lat_ms.items() if k >= skip)
    q = (lambda p: round(vals[min(len(vals) - 1, int(p * len(vals)))], 2)) if vals else (lambda p: None)
    res = {"p50_ms": q(0.50), "p99_ms": q(0.99), "max_ms": round(vals[-1], 2) if vals else None,
           "measured": len(vals), "lost": n - len(lat_ms)}
    print(f"latency {kind} at {rate:.0f} msg/s: {res}", flush=True)
    return res


def ensure_tools() -> str | None:
    """``mosquitto_sub`` and ``kcat`` on PATH, installed from Debian's packages if missing;
    otherwise the reason they are not there."""
    import shutil

    missing = [pkg for tool, pkg in (("mosquitto_sub", "mosquitto-clients"), ("kcat", "kcat"))
               if not shutil.which(tool)]
    if not missing:
        return None
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"] if shutil.which("sudo") else None
    if shutil.which("apt-get") and sudo is not None:
        print(f"installing {' '.join(missing)} (apt-get)", file=sys.stderr, flush=True)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                        *missing], stdout=subprocess.DEVNULL, check=False,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    still = [pkg for tool, pkg in (("mosquitto_sub", "mosquitto-clients"), ("kcat", "kcat"))
             if not shutil.which(tool)]
    return f"missing {' '.join(still)}: apt-get install -y {' '.join(still)}" if still else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--rate", type=float, default=5000.0)
    p.add_argument("--latency-seconds", type=float, default=12.0)
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--kafka-port", type=int, default=int(os.environ.get("BENCH_KAFKA_PORT", 0)),
                   help="default: a free port")
    p.add_argument("--mqtt-port", type=int, default=int(os.environ.get("BENCH_MQTT_PORT", 0)),
                   help="default: a free port")
    p.add_argument("--only", choices=("capacity", "latency"),
                   help="run one half (for tuning); the JSON then has zeros for the other")
    p.add_argument("--bridge-instances", type=int, default=2,
                   help="also drain with `iotlake bridge --instances K` (shared subscription); "
                        "0 or 1 skips it")
    p.add_argument("--secure", action="store_true",
                   help="also drain with authentication and TLS on (secure_ratio, provision_10k_s)")
    p.add_argument("--fleet", type=int, default=10_000, help="--secure: devices provisioned")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check that every part runs (1,500 messages, 2 s at 500 msg/s, "
                        "--secure with 200 devices)")
    args = p.parse_args()
    if args.smoke:
        args.messages, args.rate, args.latency_seconds, args.warmup_seconds = 1500, 500.0, 2.0, 0.5
        args.bridge_instances, args.fleet, args.secure = 0, min(args.fleet, 200), True
        global QUIET_S
        QUIET_S = 1.5
    args.kafka_port = args.kafka_port or free_port(pair=True)
    args.mqtt_port = args.mqtt_port or free_port()
    why = ensure_tools()
    if why:
        print(why, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="iotlake-bench-") as tmp:
        work = Path(tmp)
        base = load_settings(environ={}, data_root=str(work / "data"),
                             kafka={"embedded_port": args.kafka_port, "partitions": 4},
                             # anonymous: mosquitto_pub / mosquitto_sub and the bridge as before
                             # authentication (the measured bridge is the same either way)
                             mqtt={"embedded_port": args.mqtt_port, "allow_anonymous": True})
        with embedded_services(base):
            base = load_settings(environ={}, **{**base.model_dump(),
                                                "kafka": {**base.kafka.model_dump(), "bootstrap": base.kafka_bootstrap},
                                                "mqtt": {**base.mqtt.model_dump(), "host": "127.0.0.1",
                                                         "port": args.mqtt_port}})
            skip = {"msgs_per_s": 0, "lost": 0, "p50_ms": None, "p99_ms": None}
            cap_b = cap_b3 = cap_k = cap_bk = lat_b = lat_k = lat_f = skip
            if args.only != "latency":
                cap_b = capacity("bridge", variant(base, "capb"), args.messages, work)
                cap_b3 = capacity("bridge", variant(base, "capb3", "3.1.1"), args.messages, work)
                cap_k = capacity("baseline", variant(base, "capk"), args.messages, work)
                if args.bridge_instances > 1:
                    cap_bk = capacity("bridge", variant(base, "capbk"), args.messages, work,
                                      args.bridge_instances)
            cap_s, provision_s = skip, None
            if args.secure and args.only != "latency":
                cap_s, provision_s = secure_capacity(base, args.messages, work, args.fleet)
            if args.only != "capacity":
                lat_b = latency("bridge", variant(base, "latb"), args.rate, args.latency_seconds,
                                args.warmup_seconds, work)
                lat_k = latency("baseline", variant(base, "latk"), args.rate, args.latency_seconds,
                                args.warmup_seconds, work)
                lat_f = latency("kafka", variant(base, "latf"), args.rate, args.latency_seconds,
                                args.warmup_seconds, work)
    result = {
        "messages": args.messages,
        "bridge_msgs_per_s": cap_b["msgs_per_s"],
        "baseline_msgs_per_s": cap_k["msgs_per_s"],
        "bridge_mqtt311_msgs_per_s": cap_b3["msgs_per_s"],
        "ratio": round(cap_b["msgs_per_s"] / cap_k["msgs_per_s"], 3) if cap_k["msgs_per_s"] else None,
        # the same bridge scaled out on this machine (not the ratio: one process each)
        "bridge_instances": args.bridge_instances,
        "bridge_instances_msgs_per_s": cap_bk["msgs_per_s"],
        "ratio_instances": (round(cap_bk["msgs_per_s"] / cap_k["msgs_per_s"], 3)
                            if cap_k["msgs_per_s"] else None),
        "bridge_p50_ms": lat_b["p50_ms"],
        "bridge_p99_ms": lat_b["p99_ms"],
        "baseline_p50_ms": lat_k["p50_ms"],
        "baseline_p99_ms": lat_k["p99_ms"],
        # Kafka's own produce -> consumer-visible time for the same records: no MQTT path beats it
        "kafka_floor_p50_ms": lat_f["p50_ms"],
        "kafka_floor_p99_ms": lat_f["p99_ms"],
        "latency_rate_msgs_per_s": args.rate,
        # --secure: authentication + TLS over plaintext, the same bridge in the same run
        "secure_msgs_per_s": cap_s["msgs_per_s"] if args.secure else None,
        "secure_ratio": (round(cap_s["msgs_per_s"] / cap_b["msgs_per_s"], 3)
                         if args.secure and cap_b["msgs_per_s"] else None),
        "provision_10k_s": round(provision_s, 2) if provision_s is not None else None,
        "provisioned": args.fleet if args.secure else None,
        "lost": cap_b["lost"] + cap_b3["lost"] + cap_bk["lost"] + lat_b["lost"] + cap_s["lost"],
        "baseline_lost": cap_k["lost"] + lat_k["lost"],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
