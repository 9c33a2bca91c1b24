"""Kafka security: the embedded broker with SASL/SCRAM-SHA-512 refuses strangers and serves
iotlake's clients (bridge, admin, Spark's Kafka source) with the data root's generated
credential; librdkafka's TLS and SASL settings reach Spark's Kafka source."""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bronze.stream import java_client_options, kafka_stream
from ingest.bridge import Bridge
from ingest.simulator import generate, publish
from lakehouse.kafka import auth as kafka_auth
from lakehouse.kafka.config import client_config
from lakehouse.kafka.topics import ensure_topics
from lakehouse.settings import Settings, SettingsError, load_settings
from orchestration.services import (
    Service,
    ServiceError,
    free_port,
    kafka_controller_port,
    kafka_service,
)
from tests.test_bridge import derive, running


@pytest.fixture(scope="module")
def scram_broker(tmp_path_factory) -> tuple[Service, Settings]:
    """An embedded broker of its own with SCRAM on."""
    port = free_port(pair=True)
    s = load_settings(environ={}, data_root=str(tmp_path_factory.mktemp("scram")),
                      kafka={"embedded_port": port, "embedded_security": "sasl_scram",
                             "partitions": 2})
    broker = kafka_service(s).start()
    try:
        ensure_topics(s)
        yield broker, s
    finally:
        broker.stop()


@pytest.fixture
def scram(scram_broker: tuple[Service, Settings]) -> Settings:
    """Settings of the SCRAM broker's data root."""
    return scram_broker[1]


def _first_error(conf: dict) -> KafkaError | None:
    """The first error a producer reports within 15 s, and whether it saw the cluster."""
    errors: list[KafkaError] = []
    p = Producer({**conf, "error_cb": errors.append, "log_level": 0})
    deadline = time.monotonic() + 15
    while not errors and time.monotonic() < deadline:
        p.poll(0.2)
    return errors[0] if errors else None


def _listed(conf: dict) -> bool:
    try:
        return bool(AdminClient({**conf, "log_level": 0}).list_topics(timeout=3).brokers)
    except Exception:  # noqa: BLE001 - refused
        return False


def test_refuses_strangers_serves_iotlake(scram: Settings) -> None:
    bootstrap = {"bootstrap.servers": scram.kafka_bootstrap}
    user, password = kafka_auth.credential(scram)
    wrong = {**bootstrap, "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
             "sasl.username": user, "sasl.password": password + "x"}
    # no credential: the SASL listener answers nothing but the handshake
    assert not _listed(bootstrap)
    assert _first_error(bootstrap) is not None
    # a wrong password, or another user: authentication fails
    for conf in (wrong, {**wrong, "sasl.username": "someone", "sasl.password": password}):
        assert not _listed(conf)
        err = _first_error(conf)
        assert err is not None and err.code() == KafkaError._AUTHENTICATION, err
    # the controller's listener too asks a login (PLAIN: KRaft controllers cannot check SCRAM)
    controller = {"bootstrap.servers": f"127.0.0.1:{kafka_controller_port(scram, scram.kafka.embedded_port)}",
                  "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                  "sasl.username": user, "sasl.password": password + "x"}
    err = _first_error(controller)
    assert err is not None and err.code() == KafkaError._AUTHENTICATION, err
    # iotlake's own configuration logs in with the data root's credential
    conf = client_config(scram)
    assert conf["sasl.username"] == user and conf["security.protocol"] == "SASL_PLAINTEXT"
    assert _listed(conf) and _first_error(conf) is None
    topics = AdminClient(conf).list_topics(timeout=10).topics
    assert {scram.kafka.topic, scram.kafka.dead_letter_topic} <= set(topics)
    # the credential and the broker's config (its inter-broker login) are owner-only
    for f in (kafka_auth.credential_file(scram),
              scram.run_dir / f"kafka-{scram.kafka.embedded_port}" / "server.properties"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_bridge_delivers_with_the_credential(settings: Settings, scram: Settings) -> None:
    s = derive(settings, data_root=scram.data_root,
               kafka={"bootstrap": "", "embedded_port": scram.kafka.embedded_port,
                      "embedded_security": "sasl_scram", "topic": "bridged", "dead_letter_topic": "bridged-dlq"})
    ensure_topics(s)
    msgs = generate(s, 200, devices=5, seed=3)
    with running(Bridge(s, "b-scram")) as b:
        assert publish(s, msgs) == 200
        got = _consume(s, 200)
        assert b.stats["delivered"] == 200
    assert sorted(json.loads(v)["event_id"] for v in got) == sorted(m.event_id for m in msgs)


def _consume(s: Settings, expect: int, timeout: float = 60.0) -> list[bytes]:
    c = Consumer(client_config(s, **{"group.id": f"t-{time.time_ns()}", "enable.auto.commit": False}))
    try:
        parts = c.list_topics(s.kafka.topic, timeout=10).topics[s.kafka.topic].partitions
        c.assign([TopicPartition(s.kafka.topic, p, -2) for p in parts])
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(out) < expect and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                out.append(m.value())
        return out
    finally:
        c.close()


def test_spark_reads_with_the_credential(spark, scram: Settings) -> None:
    """bronze's Kafka source (``kafka_stream``, options from ``java_client_options``) reads
    every record; one without the credential is refused."""
    s = derive(scram, kafka={"topic": "spark-read", "dead_letter_topic": "spark-read-dlq"})
    ensure_topics(s)
    p = Producer(client_config(s))
    for i in range(50):
        p.produce(s.kafka.topic, key=b"d", value=f"r{i}".encode())
    assert p.flush(30) == 0
    q = (kafka_stream(spark, s).select("value").writeStream.format("memory")
         .queryName("scram_read").trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert q.exception() is None
    got = sorted(bytes(r.value).decode() for r in spark.table("scram_read").collect())
    assert got == sorted(f"r{i}" for i in range(50))
    stranger = (spark.read.format("kafka").option("kafka.bootstrap.servers", s.kafka_bootstrap)
                .option("subscribe", s.kafka.topic).option("kafka.request.timeout.ms", "3000")
                .option("kafka.default.api.timeout.ms", "5000").option("fetchOffset.numRetries", "1"))
    with pytest.raises(Exception):  # noqa: B017, PT011 - a JVM error (timeout: no metadata)
        stranger.load().count()


def test_a_restart_keeps_the_credential(scram_broker: tuple[Service, Settings], scram: Settings) -> None:
    """The log dir was formatted with the credential once; a restart uses it as it is."""
    broker = scram_broker[0]
    broker.stop()
    broker.start()
    assert _listed(client_config(scram))
    assert not _listed({"bootstrap.servers": scram.kafka_bootstrap})


def test_a_log_dir_formatted_without_the_credential_fails_fast(scram: Settings, tmp_path: Path) -> None:
    s = derive(scram, data_root=str(tmp_path))
    run = s.run_dir / f"kafka-{s.kafka.embedded_port}"
    (run / "data").mkdir(parents=True)
    (run / "data" / "meta.properties").write_text("formatted plaintext\n")
    svc = kafka_service(s)
    with pytest.raises(ServiceError, match="formatted without the SCRAM credential"):
        svc.prepare()


# ---- settings and options, no broker ---------------------------------------------------------


def test_scram_settings_fail_fast(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="secures the embedded broker only"):
        load_settings(environ={}, data_root=str(tmp_path),
                      kafka={"bootstrap": "kafka.example.com:9096", "embedded_security": "sasl_scram"})
    with pytest.raises(SettingsError, match="remove sasl.password, sasl.username from kafka.client_config") as e:
        load_settings(environ={}, data_root=str(tmp_path),
                      kafka={"embedded_security": "sasl_scram",
                             "client_config": {"sasl.username": "x", "sasl.password": "S3cret-never-shown"}})
    assert "S3cret-never-shown" not in str(e.value)
    with pytest.raises(SettingsError):
        load_settings(environ={}, data_root=str(tmp_path), kafka={"embedded_security": "scram"})
    plain = load_settings(environ={}, data_root=str(tmp_path))
    assert "security.protocol" not in client_config(plain)
    assert not kafka_auth.credential_file(plain).exists()  # generated only when SCRAM is on


def test_the_credential_is_generated_once_per_data_root(tmp_path: Path) -> None:
    a = load_settings(environ={}, data_root=str(tmp_path / "a"), kafka={"embedded_security": "sasl_scram"})
    b = load_settings(environ={}, data_root=str(tmp_path / "b"), kafka={"embedded_security": "sasl_scram"})
    assert kafka_auth.credential(a) == kafka_auth.credential(a) != kafka_auth.credential(b)
    assert client_config(a)["sasl.password"] == kafka_auth.credential(a)[1]


_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def test_java_client_options_sasl_ssl_scram(tmp_path: Path) -> None:
    """A managed cluster's SASL_SSL + SCRAM, as docs/configuration.md shows it."""
    ca = tmp_path / "ca.pem"
    ca.write_text(_CERT)
    opts = java_client_options({"bootstrap.servers": "b:9096", "security.protocol": "SASL_SSL",
                                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "iot",
                                "sasl.password": 'p"w', "ssl.ca.location": str(ca),
                                "ssl.endpoint.identification.algorithm": "https"})
    assert opts == {
        "kafka.security.protocol": "SASL_SSL", "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.ssl.endpoint.identification.algorithm": "https",
        "kafka.ssl.truststore.location": str(ca), "kafka.ssl.truststore.type": "PEM",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule '
                                  'required username="iot" password="p\\"w";'}


def test_java_client_options_client_certificate(tmp_path: Path) -> None:
    cert, key, both = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ck.pem"
    cert.write_text(_CERT)
    key.write_text(_KEY)
    both.write_text(_KEY + _CERT)
    two = java_client_options({"security.protocol": "SSL", "ssl.certificate.location": str(cert),
                               "ssl.key.location": str(key), "ssl.key.password": "kp"})
    assert two == {"kafka.security.protocol": "SSL", "kafka.ssl.keystore.type": "PEM",
                   "kafka.ssl.keystore.certificate.chain": _CERT, "kafka.ssl.keystore.key": _KEY,
                   "kafka.ssl.key.password": "kp"}
    one = java_client_options({"ssl.certificate.location": str(both), "ssl.key.location": str(both)})
    assert one == {"kafka.ssl.keystore.location": str(both), "kafka.ssl.keystore.type": "PEM"}
    inline = java_client_options({"ssl.ca.pem": _CERT, "ssl.certificate.pem": _CERT, "ssl.key.pem": _KEY})
    assert inline == {"kafka.ssl.truststore.certificates": _CERT, "kafka.ssl.truststore.type": "PEM",
                      "kafka.ssl.keystore.certificate.chain": _CERT, "kafka.ssl.keystore.key": _KEY,
                      "kafka.ssl.keystore.type": "PEM"}
    assert java_client_options({"ssl.ca.location": "probe"}) == {}  # the JVM's own CAs
    p12 = java_client_options({"ssl.keystore.location": "/k.p12", "ssl.keystore.password": "sp"})
    assert p12 == {"kafka.ssl.keystore.location": "/k.p12", "kafka.ssl.keystore.type": "PKCS12",
                   "kafka.ssl.keystore.password": "sp"}


def test_java_client_options_bad_tls_fails_fast(tmp_path: Path) -> None:
    rsa = tmp_path / "rsa.pem"
    rsa.write_text("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\n")
    cert = tmp_path / "c.pem"
    cert.write_text(_CERT)
    with pytest.raises(ValueError, match="openssl pkcs8 -topk8"):
        java_client_options({"ssl.certificate.location": str(cert), "ssl.key.location": str(rsa)})
    with pytest.raises(ValueError, match="needs its key"):
        java_client_options({"ssl.certificate.location": str(cert)})
    with pytest.raises(ValueError, match="point it at a readable PEM file"):
        java_client_options({"ssl.certificate.location": str(cert),
                             "ssl.key.location": str(tmp_path / "missing.pem")})


def _self_signed(tmp_path: Path, password: bytes | None = None) -> tuple[Path, Path]:
    """A certificate and its PKCS#8 key (encrypted with ``password``), as two PEM files."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "iotlake-client")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))
    enc = (serialization.BestAvailableEncryption(password) if password
           else serialization.NoEncryption())
    c, k = tmp_path / "client.crt", tmp_path / "client.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    return c, k


def _java_accepts(spark, options: dict[str, str]) -> None:
    """kafka-clients (Spark's, the version bronze runs) builds a client TLS engine from them."""
    jvm = spark._jvm
    props = jvm.java.util.Properties()
    props.put("bootstrap.servers", "127.0.0.1:1")
    props.put("key.deserializer", "org.apache.kafka.common.serialization.ByteArrayDeserializer")
    props.put("value.deserializer", "org.apache.kafka.common.serialization.ByteArrayDeserializer")
    for k, v in options.items():
        props.put(k.removeprefix("kafka."), v)
    values = jvm.org.apache.kafka.clients.consumer.ConsumerConfig(props).values()
    factory = jvm.org.apache.kafka.common.security.ssl.DefaultSslEngineFactory()
    factory.configure(values)
    try:
        assert factory.createClientSslEngine("kafka.example.com", 9093, "https") is not None
        assert factory.keystore() is not None  # the client certificate was loaded
    finally:
        factory.close()


def test_the_java_client_takes_the_tls_stores(spark, tmp_path: Path) -> None:
    """Each way of giving a client certificate, as the Java client really loads it."""
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    both = tmp_path / "client.pem"
    both.write_text(key.read_text() + cert.read_text())
    base = {"security.protocol": "SSL", "ssl.ca.location": str(cert)}
    _java_accepts(spark, java_client_options({**base, "ssl.certificate.location": str(cert),
                                              "ssl.key.location": str(key)}))
    _java_accepts(spark, java_client_options({**base, "ssl.certificate.location": str(both),
                                              "ssl.key.location": str(both)}))
    # an encrypted key: PBES2 (OpenSSL 3's and cryptography's default) fails fast, as Java 17
    # cannot decrypt it; PBE-SHA1-3DES (openssl pkcs8 -v1) both clients read
    enc = tmp_path / "enc"
    enc.mkdir()
    ecert, pbes2 = _self_signed(enc, b"kp")
    with pytest.raises(ValueError, match="encrypted with PBES2"):
        java_client_options({**base, "ssl.certificate.location": str(ecert),
                             "ssl.key.location": str(pbes2), "ssl.key.password": "kp"})
    v1 = enc / "client.v1.key"
    subprocess.run(["openssl", "pkcs8", "-topk8", "-v1", "PBE-SHA1-3DES", "-in", str(key),
                    "-out", str(v1), "-passout", "pass:kp"], check=True)
    _java_accepts(spark, java_client_options({**base, "ssl.certificate.location": str(cert),
                                              "ssl.key.location": str(v1), "ssl.key.password": "kp"}))
    # and librdkafka (the bridge) reads that key too: a producer with it starts
    Producer({"bootstrap.servers": "127.0.0.1:1", "security.protocol": "SSL", "ssl.ca.location": str(cert),
              "ssl.certificate.location": str(cert), "ssl.key.location": str(v1),
              "ssl.key.password": "kp"})
