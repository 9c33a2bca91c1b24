"""Who may use the embedded Mosquitto, in Mosquitto's own terms: a password file and an ACL file
iotlake writes under ``<root>/mqtt`` and the broker reloads on SIGHUP.

Why files and not the dynamic security plugin: they give every user its own topics, change
without a restart, and a reload disconnects a client whose credential is gone or changed
(measured on Mosquitto 2.0.11, ``tests/test_device_auth.py``); a fleet's import is one rewrite
and one reload, while the plugin saves its whole JSON configuration after every command.

Users:

- each device, its user name its id: it may publish only to the topics the telemetry model
  gives that id (``device_acl``) and read nothing but its own Sparkplug commands; it logs in
  with a password, or with a client certificate whose common name is its id (``mqtt_tls``; no
  password line: ``""`` in the device store);
- iotlake's own clients: one credential per role (``ROLES``: the bridge reads, the simulator
  writes the fleet's topics, the alert channel its topic), generated, their passwords in
  ``services.json`` (owner-only; whoever reads the data root can write its tables anyway); or,
  instead, the one ``mqtt.username`` the settings name, which may read and write everything.

Device passwords are kept only as Mosquitto's own hashes (PBKDF2-SHA512, what
``mosquitto_passwd`` writes), in ``devices.passwd``; the device registry (``lakehouse.
device_registry``) holds what is not secret. With ``mqtt.embedded_device_port`` devices and
iotlake's clients meet the broker on listeners of their own (``broker_conf``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from lakehouse.mqtt import tls as mqtt_tls
from lakehouse.settings import Settings

log = logging.getLogger(__name__)

#: iotlake's own clients and the user name each logs in with on the embedded broker.
ROLES = {"bridge": "iotlake-bridge", "simulator": "iotlake-simulator", "alerts": "iotlake-alerts"}
#: A device id as a user name: no ``:`` (the password file's separator), no MQTT wildcards,
#: ``/`` only between a Sparkplug group and edge node.
_ID_PART = re.compile(r"^[A-Za-z0-9_.@-]+$")
#: ``mosquitto_passwd``'s: 12 bytes of salt, 101 rounds. Passwords are 192 random bits, which
#: no number of rounds would make easier to guess; every connect costs the broker the rounds.
_ITERATIONS, _SALT_BYTES = 101, 12
_REFUSED = re.compile(rb"^(\d+): Client \S+ disconnected, not authori[sz]ed\.$", re.M)
_RELOADED = b"Reloading config."
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def auth_dir(settings: Settings) -> Path:
    return settings.root / "mqtt"


def password_file(settings: Settings) -> Path:
    return auth_dir(settings) / "passwd"


def acl_file(settings: Settings) -> Path:
    return auth_dir(settings) / "acl"


def _devices_file(settings: Settings) -> Path:
    return auth_dir(settings) / "devices.passwd"


def _services_file(settings: Settings) -> Path:
    return auth_dir(settings) / "services.json"


def new_password() -> str:
    return secrets.token_urlsafe(24)


def hash_password(password: str, salt: bytes | None = None) -> str:
    """Mosquitto 2's password hash (``$7$``: PBKDF2-HMAC-SHA512), as ``mosquitto_passwd`` writes it."""
    salt = salt if salt is not None else secrets.token_bytes(_SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _ITERATIONS)
    return f"$7${_ITERATIONS}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


# ---- who is who ------------------------------------------------------------------------------


def managed(settings: Settings) -> bool:
    """The MQTT broker is one iotlake runs from this data root: the embedded one (``mqtt.host``
    empty, or this machine at ``mqtt.embedded_port``)."""
    m = settings.mqtt
    return not m.host or (m.host in _LOOPBACK and settings.mqtt_endpoint[1] == m.embedded_port)


def reserved_names(settings: Settings) -> set[str]:
    return {*ROLES.values(), *([settings.mqtt.username] if settings.mqtt.username else [])}


def check_device_id(settings: Settings, device_id: str) -> str:
    """``device_id`` if it can be a device's user name and topic level; else ValueError saying why."""
    model = settings.telemetry
    parts = device_id.split("/")
    if len(parts) > 2 or (len(parts) == 2 and not model.sparkplug) or not all(_ID_PART.match(p) for p in parts):
        raise ValueError(f"device id {device_id!r}: use letters, digits and . _ - @ (an MQTT topic "
                         "level and a user name; for a Sparkplug edge node GROUP/EDGE_NODE, with "
                         "telemetry.sparkplug = true)")
    if len(device_id) > model.device_id_max_length:
        raise ValueError(f"device id {device_id!r} is longer than telemetry.device_id_max_length "
                         f"({model.device_id_max_length})")
    if device_id in reserved_names(settings):
        raise ValueError(f"device id {device_id!r} is the user name of one of iotlake's own clients: "
                         "choose another")
    return device_id


def names_devices(settings: Settings) -> bool:
    """The topics a device publishes to name it, so the broker can hold it to its own."""
    if settings.subscribes_to_model:
        return settings.telemetry.device_level is not None
    flt = settings.mqtt.topic_filter
    return flt.count("+") == 1 and "#" not in flt


def device_topics(settings: Settings, device_id: str) -> list[str]:
    """The topics a (non-Sparkplug) device may publish to: the model's topic pattern with its id
    and ``+`` for the other named parts, or, with ``mqtt.topic_filter`` set apart from the
    pattern, that filter with its one ``+`` the id (as the simulator fills it in). A topic that
    does not name the device (``names_devices`` false) is every device's."""
    if settings.subscribes_to_model:
        pattern = settings.telemetry.topic_pattern
        return ["/".join(device_id if level == "{device_id}" else "+" if level.startswith("{") else level
                         for level in pattern.split("/"))]
    flt = settings.mqtt.topic_filter
    return [flt.replace("+", device_id) if names_devices(settings) else flt]


def device_acl(settings: Settings, device_id: str) -> list[str]:
    """The ACL lines of a device: write its own topics; a Sparkplug edge node (``group/node``)
    everything under ``spBv1.0/group/+/node/#`` and read its own commands and host states."""
    if "/" in device_id:
        group, node = device_id.split("/")
        return [f"topic write spBv1.0/{group}/+/{node}/#", f"topic read spBv1.0/{group}/NCMD/{node}",
                f"topic read spBv1.0/{group}/DCMD/{node}/#", "topic read spBv1.0/STATE/#"]
    return [f"topic write {t}" for t in device_topics(settings, device_id)]


def service_acl(settings: Settings) -> dict[str, list[str]]:
    """ACL lines of iotlake's own users."""
    if settings.mqtt.username:
        return {settings.mqtt.username: ["topic readwrite #"]}
    sparkplug = settings.telemetry.sparkplug
    bridge = ["topic read #"]
    if sparkplug and settings.bridge.sparkplug_rebirth:  # NCMD "Node Control/Rebirth"
        bridge.append("topic write spBv1.0/+/NCMD/+")
    simulator = [f"topic write {settings.mqtt.topic_filter}",
                 *(["topic readwrite spBv1.0/#"] if sparkplug else [])]
    alerts = [f"topic write {settings.alerts.mqtt_topic}"] if settings.alerts.mqtt_topic else []
    return {ROLES["bridge"]: bridge, ROLES["simulator"]: simulator, ROLES["alerts"]: alerts}


def client_tls(settings: Settings) -> tuple[str | None, str | None, str | None] | None:
    """(CA, certificate, key) iotlake's own clients connect with; None: plaintext. The broker
    iotlake runs with ``mqtt.tls`` on is trusted by iotlake's CA unless ``mqtt.tls_ca`` names one."""
    m = settings.mqtt
    ca = m.tls_ca or None
    if m.tls and ca is None and managed(settings):
        ca = str(mqtt_tls.ca_file(settings))
    if ca is None and not m.tls_cert and not m.tls:
        return None
    return ca, m.tls_cert or None, m.tls_key or None


def configure_client(client, settings: Settings, role: str) -> None:
    """A paho client with the credential of iotlake's client ``role`` (``login``; never
    logged) and TLS (``client_tls``) applied."""
    credential = login(settings, role)
    if credential is not None:
        client.username_pw_set(*credential)
    tls = client_tls(settings)
    if tls is not None:
        client.tls_set(ca_certs=tls[0], certfile=tls[1], keyfile=tls[2])


def login(settings: Settings, role: str) -> tuple[str, str | None] | None:
    """(user name, password) iotlake's client in ``role`` connects with: ``mqtt.username`` when
    set, the role's generated credential on a broker iotlake runs, else none."""
    m = settings.mqtt
    if m.username:
        return m.username, m.password or None
    if not managed(settings):
        return None
    user = ROLES[role]
    with locked(settings):
        passwords = _read_services(settings)
        if user in passwords:
            return user, passwords[user]
    write_files(settings)  # a data root whose broker has not started yet
    reload(settings)
    return user, _read_services(settings)[user]


# ---- the files -------------------------------------------------------------------------------


_held: dict[Path, int] = {}
_held_lock = threading.RLock()


@contextlib.contextmanager
def locked(settings: Settings) -> Iterator[None]:
    """One writer of the credential files at a time (CLI processes, a starting broker);
    re-entrant within a process."""
    d = auth_dir(settings)
    d.mkdir(parents=True, exist_ok=True)
    with _held_lock:
        if d in _held:
            _held[d] += 1
            try:
                yield
            finally:
                _held[d] -= 1
            return
        with open(d / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            _held[d] = 1
            try:
                yield
            finally:
                del _held[d]
                fcntl.flock(f, fcntl.LOCK_UN)


def _read_services(settings: Settings) -> dict[str, str]:
    f = _services_file(settings)
    return json.loads(f.read_text()) if f.exists() else {}


def read_devices(settings: Settings) -> dict[str, str]:
    """Provisioned devices: id -> password hash."""
    f = _devices_file(settings)
    if not f.exists():
        return {}
    out = {}
    for line in f.read_text().splitlines():
        if line:
            user, _, digest = line.partition(":")
            out[user] = digest
    return out


def write_files(settings: Settings, devices: dict[str, str] | None = None) -> None:
    """Write the device store (``devices``: id -> hash; None: keep it), then the broker's
    password and ACL files from it, iotlake's own users and the telemetry model. The caller
    holds ``locked`` when it read ``devices`` under it."""
    with locked(settings):
        d = auth_dir(settings)
        if devices is None:
            devices = read_devices(settings)
        else:
            mqtt_tls.write_private(_devices_file(settings), "".join(f"{u}:{h}\n" for u, h in devices.items()))
        services = service_acl(settings)
        passwords = _read_services(settings) if not settings.mqtt.username else {}
        if not settings.mqtt.username and set(services) - set(passwords):
            passwords.update({u: new_password() for u in set(services) - set(passwords)})
            mqtt_tls.write_private(_services_file(settings), json.dumps(passwords, indent=1))
        own = {u: settings.mqtt.password if settings.mqtt.username else passwords[u] for u in services}
        own_lines = "".join(f"{u}:{hash_password(p)}\n" for u, p in own.items())
        # a device of a client certificate ("" in the store) has no password: its ACL only
        device_lines = "".join(f"{u}:{h}\n" for u, h in devices.items() if u not in own and h)
        # one file for a broker with one listener; one per kind for the two of a device port
        mqtt_tls.write_private(d / "passwd", own_lines + device_lines)
        mqtt_tls.write_private(d / "passwd-services", own_lines)
        mqtt_tls.write_private(d / "passwd-devices", device_lines)
        acl = ["# written by iotlake (lakehouse/mqtt/auth.py) from the device store and the "
               "telemetry model: change devices with `iotlake devices`, not here"]
        if settings.mqtt.allow_anonymous:  # lines before any user: clients without a user name
            acl.append("topic readwrite #")
        for user, lines in services.items():
            acl += [f"user {user}", *lines]
        for user in devices:
            if user not in own:
                acl += [f"user {user}", *device_acl(settings, user)]
        mqtt_tls.write_private(d / "acl", "\n".join(acl) + "\n")


def _listeners(bind: str, port: int) -> list[str]:
    """``bind``'s listener, and loopback's too when that is one other interface (iotlake's own
    clients connect to 127.0.0.1)."""
    ip = ipaddress.ip_address(bind)
    return [f"listener {port} {ip}", *([] if ip.is_loopback or ip.is_unspecified else [f"listener {port} 127.0.0.1"])]


def _tls(settings: Settings, certificates: bool = False) -> list[str]:
    """A listener's TLS lines (``mqtt.tls``); ``certificates``: its clients log in with a
    client certificate of the CA, its common name their user name and client id."""
    if not settings.mqtt.tls:
        return []
    f = mqtt_tls.broker_files(settings)
    out = [f"cafile {f.ca}", f"certfile {f.cert}", f"keyfile {f.key}", "tls_version tlsv1.2"]
    if certificates:
        out += ["require_certificate true", "use_identity_as_username true",
                "use_username_as_clientid true", *([f"crlfile {f.crl}"] if f.crl else [])]
    return out


def broker_conf(settings: Settings, port: int) -> str:
    """The embedded broker's listeners with their authentication (its files: ``write_files``),
    each TLS-only with ``mqtt.tls``. With a listener for devices (``mqtt.embedded_device_port``,
    ``embedded_cert_port``) each has its own settings (Mosquitto's ``per_listener_settings``):
    iotlake's own users on ``port``, loopback only (with password devices too when there is no
    device port); password devices on theirs at ``mqtt.embedded_bind``, each one's client id its
    user name (``use_username_as_clientid``: Mosquitto resumes a session by client id whoever
    connects, so a device taking the bridge's id would take its queue); certificate devices on
    theirs, the certificate's common name their user name and client id."""
    m = settings.mqtt
    d = auth_dir(settings)
    common = [f"allow_anonymous {'true' if m.allow_anonymous else 'false'}", f"acl_file {acl_file(settings)}"]
    if not (m.embedded_device_port or m.embedded_cert_port):
        out = []
        for listener in _listeners(m.embedded_bind, port):
            out += [listener, *_tls(settings)]
        return "\n".join([*out, *common, f"password_file {password_file(settings)}"]) + "\n"
    own = d / ("passwd-services" if m.embedded_device_port else "passwd")
    out = ["per_listener_settings true", f"listener {port} 127.0.0.1", *_tls(settings), *common,
           f"password_file {own}"]
    if m.embedded_device_port:
        for listener in _listeners(m.embedded_bind, m.embedded_device_port):
            out += [listener, *_tls(settings), *common, f"password_file {d / 'passwd-devices'}",
                    "use_username_as_clientid true"]
    if m.embedded_cert_port:
        for listener in _listeners(m.embedded_bind, m.embedded_cert_port):
            out += [listener, *_tls(settings, certificates=True), *common]
    return "\n".join(out) + "\n"


# ---- the running brokers ---------------------------------------------------------------------


def _brokers(settings: Settings) -> list[tuple[int, Path]]:
    """(pid, log file) of every Mosquitto running from this data root's config files."""
    out = []
    for pid_file in settings.run_dir.glob("mosquitto-*/mosquitto.pid"):
        try:
            pid = int(pid_file.read_text())
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except (OSError, ValueError):
            continue
        if argv[-2:] == ["-c", str(pid_file.with_name("mosquitto.conf"))]:
            out.append((pid, pid_file.with_name("mosquitto.log")))
    return out


def reload(settings: Settings, timeout: float = 10.0) -> int:
    """SIGHUP to this data root's running brokers, each waited for until it logged that it
    reloaded (then a new connect meets the new files); returns how many."""
    brokers = [(pid, f, f.stat().st_size if f.exists() else 0) for pid, f in _brokers(settings)]
    for pid, _, _ in brokers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    for pid, f, size in brokers:
        while True:
            with contextlib.suppress(FileNotFoundError), open(f, "rb") as fh:
                fh.seek(size)
                if _RELOADED in fh.read():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"Mosquitto (pid {pid}) did not reload within {timeout:.0f}s (log: {f})")
            time.sleep(0.02)
    return len(brokers)


def refused(settings: Settings) -> dict[str, object]:
    """Connections the embedded broker refused for their credentials (none, wrong, revoked),
    from its logs: ``{"refused": n, "last": epoch seconds or None}``. (A publish or subscribe
    the ACL denies is dropped without a log line below Mosquitto's debug level.)"""
    n, last = 0, None
    for log_file in settings.run_dir.glob("mosquitto-*/mosquitto.log"):
        for m in _REFUSED.finditer(log_file.read_bytes()):
            n += 1
            last = max(last or 0, int(m.group(1)))
    return {"refused": n, "last": last}


def cut_off(settings: Settings, client_id: str, timeout: float = 10.0) -> None:
    """Disconnect the client connected as ``client_id``, by Mosquitto's own session takeover: a
    connect with the same client id (as iotlake's bridge, on its listener) closes the older
    one, and a clean start drops its session. A reload does not disconnect a client whose
    certificate was revoked (measured on 2.0.11): its next connect is refused by the
    revocation list, and this closes the connected one. Quiet when it is not connected."""
    import paho.mqtt.client as mqtt

    done = threading.Event()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    configure_client(c, settings, "bridge")
    c.on_connect = lambda *_: done.set()
    c.connect("127.0.0.1", settings.mqtt.embedded_port, clean_start=True)
    c.loop_start()
    try:
        if not done.wait(timeout):
            raise TimeoutError(f"could not reach the embedded broker to disconnect {client_id!r}")
    finally:
        c.disconnect()
        c.loop_stop()

