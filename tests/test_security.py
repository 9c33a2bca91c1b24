"""Security: secrets stay out of logs and errors, endpoints are loopback-only by default, and
names or SQL from users cannot reach outside the data root."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lakehouse.settings import Settings, SettingsError, load_settings
from orchestration.cli import build_parser
from orchestration.cli import main as cli_main
from orchestration.services import free_port

ROOT = Path(__file__).resolve().parent.parent


def listen_addresses(port: int) -> set[str]:
    """Addresses a local TCP socket LISTENs on for ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(name):
            continue
        for line in Path(name).read_text().splitlines()[1:]:
            parts = line.split()
            ip_hex, port_hex = parts[1].split(":")
            if parts[3] != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(ip_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word endianness
            out.add(socket.inet_ntop(family, raw))
    return out


def _wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = listen_addresses(port)
        if found:
            return found
        assert proc is None or proc.poll() is None, "server exited before listening"
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


# ---- secrets ----------------------------------------------------------------------------------


def test_wrong_mqtt_password_never_printed(settings: Settings, tmp_path: Path) -> None:
    """`iotlake -v run --role bridge` with a wrong password (and a Kafka SASL password) fails
    with a clear message; neither secret appears in its stdout or stderr."""
    from orchestration.services import mosquitto_service

    port = free_port()
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(tmp_path / "passwd"), "bridge", "the-right-one"],
                   check=True, capture_output=True)
    broker = mosquitto_service(settings, port, extra_conf=f"password_file {tmp_path / 'passwd'}\n").start()
    secret, kafka_secret = f"Wr0ng-{uuid.uuid4().hex}", f"K4fka-{uuid.uuid4().hex}"
    data = settings.model_dump()
    data["mqtt"].update(host="127.0.0.1", port=port, username="bridge", password=secret)
    data["kafka"]["client_config"] = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                                      "sasl.username": "u", "sasl.password": kafka_secret}
    data["kafka"]["bootstrap"] = f"127.0.0.1:{free_port()}"  # nothing there: connect errors get logged
    cfg = Settings.model_validate(data).save(tmp_path / "settings.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    env["IOTLAKE_CONFIG"] = str(cfg)
    try:
        p = subprocess.run([sys.executable, "-m", "orchestration.cli", "-v", "run", "--role", "bridge"],
                           env=env, cwd=ROOT, capture_output=True, timeout=120)
    finally:
        broker.stop()
    out = p.stdout.decode(errors="replace") + p.stderr.decode(errors="replace")
    assert p.returncode != 0
    assert "refused the connection" in out and "did not subscribe" in out  # the failure is explained
    assert secret not in out and kafka_secret not in out
    assert "the-right-one" not in out


def test_secrets_not_in_errors_repr_or_redacted_dump(tmp_path: Path) -> None:
    secret = f"S3cret-{uuid.uuid4().hex}"
    s = load_settings(environ={}, data_root=str(tmp_path), mqtt={"password": secret},
                      kafka={"client_config": {"sasl.password": secret, "ssl.key.password": secret}})
    assert secret not in repr(s) and secret not in str(s)
    assert secret not in str(s.redacted())
    with pytest.raises(SettingsError) as e:  # a bad value elsewhere: the message names only it
        load_settings(environ={"IOTLAKE_MQTT__PASSWORD": secret, "IOTLAKE_MQTT__QOS": "7"})
    assert "mqtt.qos" in str(e.value) and secret not in str(e.value)
    with pytest.raises(SettingsError) as e:  # a bad password value itself is never echoed
        load_settings(environ={}, mqtt={"password": {"nested": secret}})
    assert "mqtt.password" in str(e.value) and secret not in str(e.value)
    saved = s.save(tmp_path / "x.json")
    assert saved.stat().st_mode & 0o077 == 0  # the saved settings (with secrets) are owner-only


def test_wrong_password_publish_error_has_no_secret(settings: Settings) -> None:
    """A refused MQTT connection raises without the password (embedded broker allows anonymous
    access, so use a password broker)."""
    from ingest.simulator import Message, publish
    from orchestration.services import mosquitto_service

    port = free_port()
    pw = Path(settings.data_root) / "passwd"
    pw.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(pw), "dev", "right"], check=True, capture_output=True)
    broker = mosquitto_service(settings, port, extra_conf=f"password_file {pw}\n").start()
    secret = f"Wr0ng-{uuid.uuid4().hex}"
    s = load_settings(environ={}, mqtt={"host": "127.0.0.1", "port": port, "username": "dev",
                                        "password": secret})
    try:
        with pytest.raises(ConnectionError) as e:
            publish(s, [Message("devices/dev-00001/telemetry", b"{}", None, "valid")])
    finally:
        broker.stop()
    assert "refused" in str(e.value) and secret not in str(e.value) and secret not in repr(e.value)


# ---- endpoints bind to loopback by default ------------------------------------------------------


def test_endpoint_defaults_are_loopback() -> None:
    s = load_settings(environ={})
    assert s.observability.metrics_bind == "127.0.0.1"
    assert build_parser().parse_args(["dashboard"]).host == "127.0.0.1"


def test_stream_metrics_endpoint_binds_loopback(tmp_path: Path) -> None:
    port = free_port()
    code = f"from lakehouse.monitoring.metrics import serve; serve({port}); import time; time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        assert _wait_listening(port, p) == {"127.0.0.1"}
    finally:
        p.kill()
        p.wait(10)


def test_bridge_metrics_endpoint_binds_loopback() -> None:
    from ingest.bridge_metrics import BridgeCollector, LatencyHistogram, serve

    port = free_port()
    stop = serve(port, BridgeCollector("b-sec", lambda: dict.fromkeys(
        ("received", "delivered", "dead_lettered", "failed", "acked", "reconnects", "in_flight",
         "connected"), 0), LatencyHistogram()))
    try:
        assert _wait_listening(port, timeout=10) == {"127.0.0.1"}
    finally:
        stop()


def test_dashboard_binds_loopback(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    p = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "--data-root", str(tmp_path / "lake"),
                          "dashboard", "--port", str(port)], cwd=tmp_path, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_listening(port, p, timeout=90) == {"127.0.0.1"}
    finally:
        p.terminate()
        p.wait(30)


# ---- user-supplied names and SQL stay inside the data root ---------------------------------------


@pytest.mark.parametrize("name", ["../x", "..", "../../etc", "a/b", "/etc/passwd", "silver/../../x",
                                  "", ".", "silver\x00", "silver/", "~root", "x y", "c:\\x"])
def test_table_path_rejects_escapes(tmp_path: Path, name: str) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path))
    with pytest.raises(SettingsError):
        s.table_path(name)


def _cli(tmp_path: Path, capsys, *argv: str) -> tuple[int, str]:
    rc = cli_main(["--data-root", str(tmp_path / "lake"), *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("sql", [
    "SELECT * FROM ../../etc",
    'SELECT * FROM "../../etc"',
    "SELECT * FROM '../../etc/passwd'",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_parquet('../../**/*.parquet')",
    "ATTACH '/tmp/iotlake-escape.duckdb' AS x",
    "INSTALL delta",
])
def test_query_cannot_read_outside_the_lake(tmp_path: Path, capsys, sql: str) -> None:
    rc, out = _cli(tmp_path, capsys, "query", sql)
    assert rc == 2, out
    assert "root:" not in out and "Traceback" not in out


def test_query_cannot_write_outside_the_lake(tmp_path: Path, capsys) -> None:
    target = tmp_path / "escaped.csv"
    rc, out = _cli(tmp_path, capsys, "query", f"COPY (SELECT 42 AS x) TO '{target}'")
    assert rc == 2, out
    assert not target.exists()


@pytest.mark.parametrize("argv", [["validate", "../x"], ["validate", "../../etc/passwd"],
                                  ["history", "../x"], ["restore", "../x", "--version", "1"],
                                  ["compact", "--table", "../x"], ["vacuum", "--table", "../x"]])
def test_table_arguments_cannot_escape(tmp_path: Path, capsys, argv: list[str]) -> None:
    rc, out = _cli(tmp_path, capsys, *argv)
    assert rc == 2, out
    assert "Traceback" not in out
    assert not (tmp_path / "x").exists() and not (tmp_path / "lake" / "x").exists()
