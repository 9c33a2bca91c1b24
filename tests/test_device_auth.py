"""Who can publish: on the embedded Mosquitto (authentication on by default) only provisioned
devices get in, each may publish only as itself and read nobody's data, iotlake's own clients
each have their role's credential; `iotlake devices` provisions, revokes, rotates and imports on
the running broker; silver quarantines an unregistered device's readings when asked to.

Real Mosquitto (its own per test, the settings' data root's files) and the session's Kafka."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from ingest.simulator import Message, publish
from lakehouse import device_registry
from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.settings import Settings, SettingsError, load_settings
from orchestration.cli import main as cli_main
from orchestration.devices_cli import Device, provision
from orchestration.run import bridge_thread
from orchestration.services import free_port, mosquitto_service
from tests.test_bridge import consume, derive
from tests.test_security import listen_addresses

ROOT = Path(__file__).resolve().parent.parent
NOT_AUTHORIZED = 135  # MQTT 5 reason code (CONNACK, PUBACK)


def own_broker(settings: Settings, port: int, device_port: int = 0, **mqtt) -> Settings:
    """``settings`` on an embedded broker of their own at ``port`` (and ``device_port``),
    iotlake's clients with their roles' generated credentials."""
    return derive(settings, mqtt={"host": "", "port": 0, "embedded_port": port, "username": "", "password": "",
                                  "embedded_device_port": device_port, **mqtt})


@pytest.fixture
def auth(settings: Settings, tmp_path: Path):
    """``settings`` on an embedded broker of their own (authentication on, the default) with a
    listener for devices; the session's Kafka."""
    port = free_port()
    s = own_broker(settings, port, free_port())
    broker = mosquitto_service(s, port).start()
    try:
        yield s
    finally:
        broker.stop()


class Client:
    """A device-like paho client: what it was told (CONNACK, PUBACKs, messages, disconnects)."""

    def __init__(self, s: Settings, username: str | None, password: str | None, client_id: str = "",
                 v5: bool = True, wait: bool = True, service: bool = False, clean: bool = True,
                 port: int | None = None, tls: dict[str, str] | None = None) -> None:
        self.v5 = v5
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                             **({} if v5 else {"clean_session": clean}))
        if username is not None:
            self.c.username_pw_set(username, password)
        if tls is not None:  # ca_certs, certfile, keyfile
            self.c.tls_set(**tls)
        self.connack: int | None = None
        self.pubacks: dict[int, int] = {}
        self.messages: list[str] = []
        self.disconnected = threading.Event()
        self.subscribed = threading.Event()
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *_: self.disconnected.set()
        self.c.on_publish = lambda _c, _u, mid, rc, _p: self.pubacks.__setitem__(mid, rc.value)
        self.c.on_message = lambda _c, _u, m: self.messages.append(m.topic)
        self.c.on_subscribe = lambda *_: self.subscribed.set()
        self.answered = threading.Event()
        # a device at the devices' listener (when there is one), iotlake's clients at theirs
        host, own = s.mqtt_endpoint
        if port is None:
            port = s.mqtt.embedded_device_port if s.mqtt.embedded_device_port and not service else own
        self.c.connect(host, port, clean_start=clean if v5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY)
        self.c.loop_start()
        if wait:
            assert self.answered.wait(10), "no CONNACK"

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if self.connack is None:
            self.connack = reason_code.value
        if reason_code.is_failure:
            client.disconnect()  # once: paho would retry, and each refusal is counted
        self.answered.set()

    @property
    def refused(self) -> bool:
        return self.connack not in (None, 0)

    def publish(self, topic: str, payload: bytes = b"{}") -> int:
        """QoS 1, waited for: the PUBACK's reason code (0 = accepted, with or without a
        subscriber; 3.1.1 always says 0)."""
        info = self.c.publish(topic, payload, qos=1)
        deadline = time.monotonic() + 10
        while info.mid not in self.pubacks:
            assert time.monotonic() < deadline, f"no PUBACK for {topic}"
            time.sleep(0.01)
        rc = self.pubacks[info.mid]
        return 0 if rc == 16 else rc  # 16: accepted, "no matching subscribers"

    def subscribe(self, topic: str) -> None:
        self.subscribed.clear()
        self.c.subscribe(topic, qos=1)
        assert self.subscribed.wait(10)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def devices(s: Settings, tmp_path: Path, capsys, *argv: str) -> tuple[int, list[dict], str]:
    """``iotlake devices ARGV`` against ``s`` (saved as a settings file): exit code, stdout's
    JSON lines (or its one JSON array), stderr."""
    cfg = s.save(tmp_path / "settings.json")
    capsys.readouterr()
    rc = cli_main(["--config", str(cfg), "devices", *argv])
    out = capsys.readouterr()
    lines = ([json.loads(out.out)] if out.out.startswith("[")
             else [json.loads(line) for line in out.out.splitlines() if line.startswith("{")])
    return rc, lines, out.err


def topic(s: Settings, device_id: str) -> str:
    (t,) = mqtt_auth.device_topics(s, device_id)
    return t


def payload(device_id: str, n: int) -> bytes:
    return json.dumps({"device_id": device_id, "event_id": f"{device_id}-{n}", "ts": "2026-03-01T12:00:00Z",
                       "temperature": 20.0, "humidity": 40.0, "battery": 90.0}).encode()


@contextlib.contextmanager
def clients(*made: Client):
    try:
        yield made
    finally:
        for c in made:
            c.close()


# ---- refusals -------------------------------------------------------------------------------


def test_anonymous_and_wrong_password_are_refused_and_counted(auth: Settings, tmp_path: Path, capsys) -> None:
    (cred,) = provision(auth, [Device("dev-a")])
    rc, (before,), _ = devices(auth, tmp_path, capsys, "refused")
    assert rc == 0 and before["refused"] == 0
    with clients(Client(auth, None, None), Client(auth, "dev-a", "not-its-password"),
                 Client(auth, "nobody", cred["password"]), Client(auth, "dev-a", cred["password"])) as (
            anonymous, wrong, unknown, right):
        assert anonymous.connack == wrong.connack == unknown.connack == NOT_AUTHORIZED
        assert right.connack == 0
    rc, (after,), _ = devices(auth, tmp_path, capsys, "refused")
    assert rc == 0 and after["refused"] == 3 and after["last"]


def test_a_device_publishes_only_as_itself_and_nothing_else_reaches_kafka(auth: Settings) -> None:
    """A on its own topic: in Kafka. A on B's topic (MQTT 5: PUBACK "not authorized"; 3.1.1: a
    PUBACK, the message dropped), the bridge's credential publishing, anonymous: none in Kafka.
    The simulator, with its own credential, gets in on the fleet's topics."""
    a, b = provision(auth, [Device("dev-a"), Device("dev-b")])
    with bridge_thread(auth), clients(Client(auth, "dev-a", a["password"]),
                                      Client(auth, "dev-a", a["password"], v5=False),
                                      Client(auth, *mqtt_auth.login(auth, "bridge"), service=True)) as (v5, v311, bridge):
        assert v5.publish(topic(auth, "dev-b"), payload("dev-b", 1)) == NOT_AUTHORIZED
        assert v311.publish(topic(auth, "dev-b"), payload("dev-b", 2)) == 0  # acked, dropped
        assert v5.publish("some/other/topic", payload("dev-b", 3)) == NOT_AUTHORIZED
        assert bridge.publish(topic(auth, "dev-b"), payload("dev-b", 4)) == NOT_AUTHORIZED
        assert publish(auth, [Message(topic(auth, "dev-c"), payload("dev-c", 5), "dev-c-5", "valid")]) == 1
        assert v5.publish(topic(auth, "dev-a"), payload("dev-a", 6)) == 0  # last: the others are ahead
        got = consume(auth, auth.kafka.topic, expect_ids={"dev-a-6"})
    assert sorted(json.loads(m.value())["event_id"] for m in got) == ["dev-a-6", "dev-c-5"]
    assert {dict(m.headers())["mqtt_topic"].decode() for m in got} == {topic(auth, "dev-a"), topic(auth, "dev-c")}


def test_a_device_reads_nothing_of_others(auth: Settings) -> None:
    """Mosquitto 2.0 grants a device's SUBSCRIBE and checks its read access per message: A, on
    ``#`` and on B's topic, gets none of B's messages, which the bridge's credential does get."""
    a, b = provision(auth, [Device("dev-a"), Device("dev-b")])
    with clients(Client(auth, "dev-a", a["password"]), Client(auth, "dev-b", b["password"]),
                 Client(auth, *mqtt_auth.login(auth, "bridge"), service=True)) as (ca, cb, bridge):
        ca.subscribe("#")
        ca.subscribe(topic(auth, "dev-b"))
        bridge.subscribe(auth.mqtt.topic_filter)
        for n in range(3):
            assert cb.publish(topic(auth, "dev-b"), payload("dev-b", n)) == 0
        deadline = time.monotonic() + 10
        while len(bridge.messages) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert bridge.messages == [topic(auth, "dev-b")] * 3
        assert ca.messages == []


# ---- provisioning ---------------------------------------------------------------------------


def test_add_rotate_revoke_on_the_running_broker(auth: Settings, tmp_path: Path, capsys) -> None:
    rc, (cred,), _ = devices(auth, tmp_path, capsys, "add", "pump-7", "--site", "plant-1",
                             "--label", "floor=3", "--label", "line=a")
    assert rc == 0 and set(cred) == {"device_id", "username", "password"}
    assert cred["device_id"] == cred["username"] == "pump-7"
    stored = mqtt_auth.password_file(auth).read_text()
    assert cred["password"] not in stored and "pump-7:$7$101$" in stored  # hashed, as mosquitto_passwd
    first = Client(auth, "pump-7", cred["password"], client_id="pump-7-first")
    assert first.connack == 0 and first.publish(topic(auth, "pump-7")) == 0
    assert devices(auth, tmp_path, capsys, "add", "pump-7")[0] == 2  # once only

    rc, (new,), _ = devices(auth, tmp_path, capsys, "rotate", "pump-7")
    assert rc == 0 and new["password"] != cred["password"]
    assert first.disconnected.wait(10)  # the reload cut off the client of the old password
    first.close()
    with clients(Client(auth, "pump-7", cred["password"]), Client(auth, "pump-7", new["password"])) as (old, ok):
        assert old.connack == NOT_AUTHORIZED and ok.connack == 0

    second = Client(auth, "pump-7", new["password"], client_id="pump-7-second")
    assert second.connack == 0
    rc, (revoked,), _ = devices(auth, tmp_path, capsys, "revoke", "pump-7")
    assert rc == 0 and revoked["device_id"] == "pump-7" and revoked["revoked"]
    assert second.disconnected.wait(10)  # a connected device is cut off at the reload
    second.close()
    with clients(Client(auth, "pump-7", new["password"])) as (again,):
        assert again.connack == NOT_AUTHORIZED
    assert devices(auth, tmp_path, capsys, "revoke", "pump-7")[0] == 2
    assert devices(auth, tmp_path, capsys, "rotate", "pump-7")[0] == 2

    rc, (listed,), _ = devices(auth, tmp_path, capsys, "list", "--format", "json")
    assert rc == 0 and len(listed) == 1
    row = listed[0]
    assert (row["device_id"], row["site"], row["labels"]) == ("pump-7", "plant-1", {"floor": "3", "line": "a"})
    assert row["created"] and row["revoked"] == revoked["revoked"]


def test_registry_is_a_delta_table_spark_reads(auth: Settings, spark) -> None:
    provision(auth, [Device("d1", "s1", {"k": "v"}), Device("d2")])
    rows = {r["device_id"]: r for r in spark.read.format("delta").load(device_registry.path(auth)).collect()}
    assert set(rows) == {"d1", "d2"} and rows["d1"]["site"] == "s1" and json.loads(rows["d1"]["labels"]) == {"k": "v"}
    assert rows["d2"]["site"] is None and rows["d2"]["revoked"] is None


def test_import_of_2000_devices_is_one_reload_and_they_connect(auth: Settings, tmp_path: Path, capsys) -> None:
    n = 2000
    csv = tmp_path / "fleet.csv"
    csv.write_text("device_id,site,labels\n" + "".join(
        f"imp-{i:05d},site-{i % 7},floor={i % 4};model=x{i % 3}\n" for i in range(n)))
    log = mqtt_auth.acl_file(auth).parent.parent / "run" / f"mosquitto-{auth.mqtt.embedded_port}" / "mosquitto.log"
    reloads = log.read_text().count("Reloading config.")
    t0 = time.monotonic()
    rc, creds, err = devices(auth, tmp_path, capsys, "import", str(csv))
    took = time.monotonic() - t0
    assert rc == 0, err
    assert len(creds) == n and len({c["password"] for c in creds}) == n
    assert took < 20, f"import of {n} devices took {took:.1f}s"
    assert log.read_text().count("Reloading config.") == reloads + 1
    for c in (creds[0], creds[n // 2], creds[-1]):
        with clients(Client(auth, c["username"], c["password"])) as (cl,):
            assert cl.connack == 0 and cl.publish(topic(auth, c["device_id"])) == 0
            assert cl.publish(topic(auth, "imp-99999")) == NOT_AUTHORIZED
    listed = device_registry.read(auth)
    assert listed.num_rows == n
    # a second import of any of them changes nothing
    csv.write_text("device_id,site,labels\nimp-00001,,\nnew-1,,\n")
    rc, _, err = devices(auth, tmp_path, capsys, "import", str(csv))
    assert rc == 2 and "already provisioned: imp-00001" in err
    assert "new-1" not in mqtt_auth.read_devices(auth) and device_registry.read(auth).num_rows == n


@pytest.mark.parametrize(("device_id", "why"), [
    ("a/b", "Sparkplug"), ("a:b", "letters"), ("+", "letters"), ("", "letters"), ("x" * 200, "longer"),
    ("iotlake-bridge", "iotlake's own"), ("dev a", "letters")])
def test_bad_device_ids_fail_fast(auth: Settings, tmp_path: Path, capsys, device_id: str, why: str) -> None:
    rc, out, err = devices(auth, tmp_path, capsys, "add", device_id)
    assert rc == 2 and not out and why in err


def test_bad_csv_and_labels_fail_fast(auth: Settings, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("id,site\nx,y\n")
    assert devices(auth, tmp_path, capsys, "import", str(bad))[0] == 2
    bad.write_text("device_id,site,labels\nx,y,nolabel\n")
    rc, _, err = devices(auth, tmp_path, capsys, "import", str(bad))
    assert rc == 2 and "line 2" in err
    with pytest.raises(SystemExit) as e:
        devices(auth, tmp_path, capsys, "add", "x", "--label", "novalue")
    assert e.value.code == 2
    assert mqtt_auth.read_devices(auth) == {}


# ---- what the telemetry model gives each device ----------------------------------------------


def test_acls_follow_the_telemetry_model(tmp_path: Path) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path),
                      telemetry={"topic_pattern": "plant/{site}/{device_id}/telemetry"})
    assert mqtt_auth.device_acl(s, "p-1") == ["topic write plant/+/p-1/telemetry"]
    sp = load_settings(environ={}, data_root=str(tmp_path), telemetry={"sparkplug": True})
    assert mqtt_auth.device_acl(sp, "line1/edge-7") == [
        "topic write spBv1.0/line1/+/edge-7/#", "topic read spBv1.0/line1/NCMD/edge-7",
        "topic read spBv1.0/line1/DCMD/edge-7/#", "topic read spBv1.0/STATE/#"]
    assert mqtt_auth.device_acl(sp, "dev-1") == ["topic write devices/dev-1/telemetry"]
    # the bridge reads; on Sparkplug it may ask a node for its births (NCMD) and nothing else
    assert mqtt_auth.service_acl(s)["iotlake-bridge"] == ["topic read #"]
    assert mqtt_auth.service_acl(sp)["iotlake-bridge"] == ["topic read #", "topic write spBv1.0/+/NCMD/+"]
    assert mqtt_auth.service_acl(s)["iotlake-simulator"] == ["topic write plant/+/+/telemetry"]


def test_a_sparkplug_edge_node_publishes_only_under_its_own_node(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    s = derive(settings, mqtt={"host": "", "port": 0, "embedded_port": port, "username": "", "password": ""},
               telemetry={**settings.telemetry.model_dump(), "sparkplug": True})
    broker = mosquitto_service(s, port).start()
    try:
        (node,) = provision(s, [Device("g1/edge-1")])
        with clients(Client(s, node["username"], node["password"])) as (c,):
            assert c.publish("spBv1.0/g1/NDATA/edge-1") == 0
            assert c.publish("spBv1.0/g1/DDATA/edge-1/pump") == 0
            assert c.publish("spBv1.0/g1/NDATA/edge-2") == NOT_AUTHORIZED
            assert c.publish("spBv1.0/g2/NDATA/edge-1") == NOT_AUTHORIZED
    finally:
        broker.stop()


# ---- listen address, anonymous access ---------------------------------------------------------


def test_listening_beyond_loopback_needs_authentication(tmp_path: Path, capsys) -> None:
    env = {"IOTLAKE_MQTT__EMBEDDED_BIND": "0.0.0.0", "IOTLAKE_MQTT__ALLOW_ANONYMOUS": "true"}
    with pytest.raises(SettingsError) as e:
        load_settings(environ=env)
    assert "needs authentication" in str(e.value) and "allow_anonymous = false" in str(e.value)
    cfg = tmp_path / "open.toml"
    cfg.write_text('[mqtt]\nembedded_bind = "0.0.0.0"\nallow_anonymous = true\n')
    assert cli_main(["--config", str(cfg), "devices", "list"]) == 2
    assert "needs authentication" in capsys.readouterr().err
    # the infra/ reference broker is not anonymous on every interface either
    conf = (ROOT / "infra" / "mosquitto" / "mosquitto.conf").read_text()
    assert "allow_anonymous false" in conf and "allow_anonymous true" not in conf


def test_the_embedded_broker_listens_where_it_is_told(settings: Settings, tmp_path: Path) -> None:
    """Opened to the network, the devices' listener is on every interface and iotlake's own on
    loopback; opened without a devices' listener, it fails fast."""
    port, device_port = free_port(), free_port()
    s = own_broker(settings, port, device_port, embedded_bind="0.0.0.0")
    broker = mosquitto_service(s, port).start()
    try:
        assert listen_addresses(device_port) == {"0.0.0.0"} and listen_addresses(port) == {"127.0.0.1"}
        with clients(Client(s, None, None)) as (anonymous,):
            assert anonymous.connack == NOT_AUTHORIZED
    finally:
        broker.stop()
    loopback = own_broker(settings, port)
    broker = mosquitto_service(loopback, port).start()
    try:
        assert listen_addresses(port) == {"127.0.0.1"} and listen_addresses(device_port) == set()
    finally:
        broker.stop()
    with pytest.raises(SettingsError) as e:
        load_settings(environ={"IOTLAKE_MQTT__EMBEDDED_BIND": "0.0.0.0"})
    assert "mqtt.embedded_device_port" in str(e.value)


def test_a_device_cannot_take_over_the_bridges_session(auth: Settings) -> None:
    """Mosquitto resumes a session by client id whoever connects: a device taking the bridge's
    id would be handed (and, by its ACL, drop) what the broker queued for the bridge. On the
    devices' listener a device's client id is its user name; on iotlake's own listener a
    device's credential is refused."""
    a, b = provision(auth, [Device("dev-a"), Device("dev-b")])
    with bridge_thread(auth):
        pass  # the bridge's persistent session exists, and it is gone: the broker queues for it
    with clients(Client(auth, "dev-a", a["password"]),
                 Client(auth, "dev-b", b["password"], client_id=auth.mqtt.client_id, clean=False),
                 Client(auth, "dev-b", b["password"], client_id=auth.mqtt.client_id, service=True)) as (
            ca, thief, on_ours):
        assert thief.connack == 0 and on_ours.connack == NOT_AUTHORIZED
        for n in range(3):
            assert ca.publish(topic(auth, "dev-a"), payload("dev-a", n)) == 0
        time.sleep(0.5)
        assert thief.messages == []
    log = (auth.run_dir / f"mosquitto-{auth.mqtt.embedded_port}" / "mosquitto.log").read_text()
    as_b = [line for line in log.splitlines() if "u'dev-b'" in line]  # "... as CLIENT_ID (..., u'dev-b')"
    assert as_b and all(" as dev-b (" in line for line in as_b)
    with bridge_thread(auth):
        got = consume(auth, auth.kafka.topic, expect_ids={"dev-a-0", "dev-a-1", "dev-a-2"})
    assert sorted(json.loads(m.value())["event_id"] for m in got) == ["dev-a-0", "dev-a-1", "dev-a-2"]


def test_allow_anonymous_is_warned_and_devices_stay_confined(settings: Settings, caplog) -> None:
    port = free_port()
    s = derive(settings, mqtt={"host": "", "port": 0, "embedded_port": port, "username": "",
                               "password": "", "allow_anonymous": True})
    with caplog.at_level(logging.WARNING, "orchestration.services"):
        broker = mosquitto_service(s, port).start()
    try:
        assert any("allow_anonymous = true" in r.getMessage() for r in caplog.records)
        (a,) = provision(s, [Device("dev-a")])
        with clients(Client(s, None, None), Client(s, "dev-a", a["password"])) as (anonymous, dev):
            assert anonymous.connack == 0 and anonymous.publish(topic(s, "dev-b")) == 0
            assert dev.publish(topic(s, "dev-b")) == NOT_AUTHORIZED
    finally:
        broker.stop()


# ---- the registry in silver ------------------------------------------------------------------


@pytest.mark.parametrize("dedup", ["index", "state_store"])
def test_require_registered_quarantines_unknown_devices(spark, tmp_path: Path, dedup: str) -> None:
    from fleets import SENSOR

    import tests.test_silver as ts

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"),
                      spark={"master": "local[2]", "shuffle_partitions": 2}, stream={"dedup": dedup},
                      telemetry={**SENSOR.model_dump(mode="json"), "require_registered": True})
    device_registry.upsert(s, ts_rows(["dev-00001", "dev-00002"]))
    bronze = ts.Bronze(s)
    # event i belongs to dev-(i % 50 + 1): 0 and 1 registered, 2 not; 3 is not JSON at all
    bronze.append(ts.payload(0), ts.payload(1), ts.payload(2), b"not json",
                  ts.payload(52, temperature="hot"))  # dev-00003 and a wrong type
    ts.run(spark, s)
    q = ts.quarantined(s)
    assert q == {2: "unknown_device", 3: "not_json", 4: "wrong_type:temperature,unknown_device"}
    assert ts.silver_offsets(s) == {0, 1}
    counts = {r["expectation"]: json.loads(r["details"]).get("failed", json.loads(r["details"]).get("count"))
              for r in ts.table(s, "quality_log").to_pylist()}
    assert "unknown_device" in counts
    # a device registered later is known from the next batch on
    device_registry.upsert(s, ts_rows(["dev-00003"]))
    bronze.append(ts.payload(102))
    ts.run(spark, s)
    assert 5 in ts.silver_offsets(s)


def ts_rows(ids: list[str]):
    import pyarrow as pa

    from lakehouse.tables import DEVICES

    return pa.Table.from_pylist([{"device_id": i, "site": None, "labels": "{}", "created": None,
                                  "revoked": None} for i in ids], schema=DEVICES)
