"""TLS on the embedded Mosquitto (``mqtt.tls``): every listener TLS-only, iotlake's own CA and
server certificate, devices with a password over TLS or with a client certificate of that CA
(``iotlake devices add --cert``) at ``mqtt.embedded_cert_port``; the bridge and the simulator
speak TLS to it. Real Mosquitto, real paho clients, the session's Kafka."""

from __future__ import annotations

import json
import ssl
import time
from pathlib import Path

import pytest

from ingest.simulator import Message, publish
from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.mqtt import tls as mqtt_tls
from lakehouse.settings import Settings, SettingsError, load_settings
from orchestration.run import bridge_thread
from orchestration.services import free_port, mosquitto_service
from tests.test_bridge import consume
from tests.test_device_auth import (
    NOT_AUTHORIZED,
    Client,
    clients,
    devices,
    own_broker,
    payload,
    topic,
)


@pytest.fixture
def secure(settings: Settings, tmp_path: Path):
    """``settings`` on an embedded broker of their own, TLS only, with a certificate listener."""
    port = free_port()
    s = own_broker(settings, port, tls=True, embedded_cert_port=free_port())
    broker = mosquitto_service(s, port).start()
    try:
        yield s
    finally:
        broker.stop()


def pem_files(tmp_path: Path, name: str, cred: dict[str, str]) -> dict[str, str]:
    """A device's certificate, key and CA as files, as paho's ``tls_set`` takes them."""
    out = {}
    for arg, key in (("certfile", "certificate"), ("keyfile", "key"), ("ca_certs", "ca_certificate")):
        f = tmp_path / f"{name}.{key}.pem"
        f.write_text(cred[key])
        out[arg] = str(f)
    return out


def ca_only(s: Settings) -> dict[str, str]:
    return {"ca_certs": str(mqtt_tls.ca_file(s))}


def test_tls_only_a_password_device_and_the_bridge_to_kafka(secure: Settings, tmp_path: Path, capsys) -> None:
    """Plaintext to a TLS listener is refused; a device with a password over TLS publishes as
    itself; the bridge and the simulator reach the broker over TLS, and into Kafka."""
    rc, (cred,), _ = devices(secure, tmp_path, capsys, "add", "dev-p")
    assert rc == 0
    plain = Client(secure, "dev-p", cred["password"], wait=False)
    assert not plain.answered.wait(3) or plain.connack != 0  # no CONNACK over plaintext
    plain.close()
    with bridge_thread(secure), clients(Client(secure, "dev-p", cred["password"], tls=ca_only(secure))) as (dev,):
        assert dev.connack == 0
        assert dev.publish(topic(secure, "dev-q"), payload("dev-q", 1)) == NOT_AUTHORIZED
        assert publish(secure, [Message(topic(secure, "dev-s"), payload("dev-s", 2), "dev-s-2", "valid")]) == 1
        assert dev.publish(topic(secure, "dev-p"), payload("dev-p", 3)) == 0
        got = consume(secure, secure.kafka.topic, expect_ids={"dev-p-3", "dev-s-2"})
    assert sorted(json.loads(m.value())["event_id"] for m in got) == ["dev-p-3", "dev-s-2"]


def test_a_certificate_device_its_topics_and_foreign_certificates(secure: Settings, tmp_path: Path, capsys) -> None:
    rc, (cred,), _ = devices(secure, tmp_path, capsys, "add", "dev-c", "--cert", "--site", "north")
    assert rc == 0 and set(cred) == {"device_id", "username", "certificate", "key", "ca_certificate"}
    assert cred["username"] == "dev-c" and "password" not in cred
    cert = ssl._ssl._test_decode_cert(pem_files(tmp_path, "c", cred)["certfile"])  # noqa: SLF001
    assert dict(x[0] for x in cert["subject"])["commonName"] == "dev-c"
    assert "dev-c:" not in mqtt_auth.password_file(secure).read_text()  # no password to guess

    # a CA of another data root: same common name, not iotlake's CA here
    other = load_settings(environ={}, data_root=str(tmp_path / "other"),
                          mqtt={"tls": True, "embedded_cert_port": 1})
    foreign = mqtt_tls.issue(other, ["dev-c"])["dev-c"]
    port = secure.mqtt.embedded_cert_port
    with clients(Client(secure, None, None, port=port, tls=pem_files(tmp_path, "c", cred)),
                 Client(secure, *mqtt_auth.login(secure, "bridge"), service=True, tls=ca_only(secure))) as (dev, bridge):
        assert dev.connack == 0
        bridge.subscribe(secure.mqtt.topic_filter)
        assert dev.publish(topic(secure, "dev-d"), payload("dev-d", 1)) == NOT_AUTHORIZED
        assert dev.publish(topic(secure, "dev-c"), payload("dev-c", 2)) == 0
        deadline = time.monotonic() + 10
        while not bridge.messages and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bridge.messages == [topic(secure, "dev-c")]
    for tls in ({**pem_files(tmp_path, "f", foreign), "ca_certs": str(mqtt_tls.ca_file(secure))}, ca_only(secure)):
        c = Client(secure, None, None, port=port, tls=tls, wait=False)  # foreign, then none at all
        assert not c.answered.wait(3) or c.connack != 0
        c.close()


def test_a_revoked_certificate_is_cut_off_and_refused_and_rotation(secure: Settings, tmp_path: Path, capsys) -> None:
    port = secure.mqtt.embedded_cert_port
    rc, (first,), _ = devices(secure, tmp_path, capsys, "add", "dev-r", "--cert")
    connected = Client(secure, None, None, port=port, tls=pem_files(tmp_path, "r1", first))
    assert connected.connack == 0
    rc, (second,), _ = devices(secure, tmp_path, capsys, "rotate", "dev-r")
    assert rc == 0 and second["certificate"] != first["certificate"] and "password" not in second
    assert connected.disconnected.wait(10)  # the old certificate's client is cut off
    connected.close()
    old = Client(secure, None, None, port=port, tls=pem_files(tmp_path, "r1", first), wait=False)
    assert not old.answered.wait(3) or old.connack != 0  # on the revocation list
    old.close()
    now = Client(secure, None, None, port=port, tls=pem_files(tmp_path, "r2", second))
    assert now.connack == 0 and now.publish(topic(secure, "dev-r"), payload("dev-r", 1)) == 0
    rc, (revoked,), _ = devices(secure, tmp_path, capsys, "revoke", "dev-r")
    assert rc == 0 and revoked["revoked"]
    assert now.disconnected.wait(10)
    now.close()
    again = Client(secure, None, None, port=port, tls=pem_files(tmp_path, "r2", second), wait=False)
    assert not again.answered.wait(3) or again.connack != 0
    again.close()


def test_tls_settings_fail_fast(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="mqtt.tls = true"):
        load_settings(environ={}, data_root=str(tmp_path), mqtt={"embedded_cert_port": 8883})
    with pytest.raises(SettingsError, match="tls_server_key and mqtt.tls_ca"):
        load_settings(environ={}, data_root=str(tmp_path), mqtt={"tls": True, "tls_server_cert": "/x.pem"})
    with pytest.raises(SettingsError, match="must differ"):
        load_settings(environ={}, data_root=str(tmp_path),
                      mqtt={"tls": True, "embedded_port": 8883, "embedded_cert_port": 8883})


def test_add_cert_needs_the_certificate_listener(settings: Settings, tmp_path: Path, capsys) -> None:
    s = own_broker(settings, free_port())
    rc, _, err = devices(s, tmp_path, capsys, "add", "dev-x", "--cert")
    assert rc == 2 and "mqtt.embedded_cert_port" in err
