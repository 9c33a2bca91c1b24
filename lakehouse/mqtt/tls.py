"""The embedded Mosquitto's TLS material, kept under ``<root>/mqtt/tls`` (owner-only files).

- iotlake's CA (``ca.crt``/``ca.key``, made once): it signs the broker's server certificate and
  the client certificates ``iotlake devices add --cert`` issues; the broker trusts no other;
- the server certificate, for 127.0.0.1, localhost, this host's name, ``mqtt.embedded_bind``
  and ``mqtt.tls_server_names``, made again when that list changes; or the user's own
  (``mqtt.tls_server_cert``/``tls_server_key`` with ``tls_ca`` the CA that signed the clients');
- the revocation list (``crl.pem``) of every client certificate of a revoked or re-issued
  device, which the certificate listener checks (``crlfile``).

Made with ``cryptography`` (a well-kept library; no shelling out to openssl): EC P-256 keys.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lakehouse.settings import Settings

#: client certificates live this long; the CA and the server certificate ten years
CLIENT_DAYS, CA_DAYS = 825, 3650


@dataclass(frozen=True)
class BrokerFiles:
    """What the broker's TLS listeners read."""

    ca: Path
    cert: Path
    key: Path
    crl: Path | None  # iotlake's CA's list; None with the user's own CA


def tls_dir(settings: Settings) -> Path:
    return settings.root / "mqtt" / "tls"


def write_private(path: Path, data: bytes | str) -> None:
    """Atomically, owner-only (the broker's key, CA and credential files: ``mqtt_auth`` too):
    the broker reads a whole old or a whole new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ca(settings: Settings) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """iotlake's CA for this data root, made at the first call."""
    d = tls_dir(settings)
    crt, key = d / "ca.crt", d / "ca.key"
    if crt.exists() and key.exists():
        return (x509.load_pem_x509_certificate(crt.read_bytes()),
                serialization.load_pem_private_key(key.read_bytes(), None))
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"iotlake CA {socket.gethostname()}")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), critical=False)
            .sign(k, hashes.SHA256()))
    write_private(key, _key_pem(k))
    write_private(crt, cert.public_bytes(serialization.Encoding.PEM))
    return cert, k


def ca_file(settings: Settings) -> Path:
    """The CA that iotlake's own clients trust and the broker checks client certificates with:
    ``mqtt.tls_ca`` when the broker's certificate is the user's, else iotlake's own."""
    m = settings.mqtt
    if m.tls_server_cert:
        return Path(m.tls_ca)
    _ca(settings)
    return tls_dir(settings) / "ca.crt"


def server_names(settings: Settings) -> list[str]:
    """Names and addresses the server certificate is good for."""
    names = ["127.0.0.1", "localhost", socket.gethostname()]
    bind = settings.mqtt.embedded_bind
    if not ipaddress.ip_address(bind).is_unspecified:
        names.append(bind)
    names += settings.mqtt.tls_server_names
    return list(dict.fromkeys(names))


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def _sign(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, days: int,
          server: list[str] | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    k = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
         .issuer_name(ca.subject).public_key(k.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server is not None
                                               else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                        critical=False))
    if server is not None:
        b = b.add_extension(_san(server), critical=False)
    return b.sign(ca_key, hashes.SHA256()), k


def broker_files(settings: Settings) -> BrokerFiles:
    """The broker's CA, certificate, key and revocation list, made or renewed as needed."""
    m, d = settings.mqtt, tls_dir(settings)
    if m.tls_server_cert:
        return BrokerFiles(Path(m.tls_ca), Path(m.tls_server_cert), Path(m.tls_server_key), None)
    crl = d / "crl.pem"
    if not crl.exists():
        write_crl(settings)
    crt, key, names_file = d / "server.crt", d / "server.key", d / "server.names.json"
    names = server_names(settings)
    if not (crt.exists() and key.exists() and names_file.exists()
            and json.loads(names_file.read_text()) == names):
        cert, k = _sign(*_ca(settings), "iotlake mqtt", CA_DAYS, server=names)
        write_private(key, _key_pem(k))
        write_private(crt, cert.public_bytes(serialization.Encoding.PEM))
        write_private(names_file, json.dumps(names).encode())
    return BrokerFiles(ca_file(settings), crt, key, crl)


# ---- client certificates ---------------------------------------------------------------------


def _issued_file(settings: Settings) -> Path:
    return tls_dir(settings) / "issued.json"


def _issued(settings: Settings) -> dict[str, list]:
    """``{"active": {device: serial}, "revoked": [[serial, epoch s], ...]}``."""
    f = _issued_file(settings)
    return json.loads(f.read_text()) if f.exists() else {"active": {}, "revoked": []}


def issue(settings: Settings, device_ids: list[str]) -> dict[str, dict[str, str]]:
    """A client certificate for each device (its id the common name, which the broker's
    certificate listener takes as the user name and client id) and its key, as PEM, with the
    CA's certificate; a certificate issued to a device before is revoked. One write of the
    book and the revocation list however many. The caller holds ``mqtt_auth.locked``."""
    if settings.mqtt.tls_server_cert:
        raise ValueError("mqtt.tls_server_cert is set: client certificates come from your CA "
                         "(mqtt.tls_ca), not iotlake's; issue them there with CN = the device id")
    book, now = _issued(settings), int(_now().timestamp())
    ca, ca_key = _ca(settings)
    ca_pem, out = ca_file(settings).read_text(), {}
    for device_id in device_ids:
        cert, k = _sign(ca, ca_key, device_id, CLIENT_DAYS)
        old = book["active"].get(device_id)
        if old is not None:
            book["revoked"].append([old, now])
        book["active"][device_id] = str(cert.serial_number)
        out[device_id] = {"certificate": cert.public_bytes(serialization.Encoding.PEM).decode(),
                          "key": _key_pem(k).decode(), "ca_certificate": ca_pem}
    write_private(_issued_file(settings), json.dumps(book).encode())
    if any(r[1] == now for r in book["revoked"]):
        write_crl(settings, book)
    return out


def has_certificate(settings: Settings, device_id: str) -> bool:
    return device_id in _issued(settings)["active"]


def revoke(settings: Settings, device_id: str) -> bool:
    """The device's certificate on the revocation list; False when it has none."""
    book = _issued(settings)
    serial = book["active"].pop(device_id, None)
    if serial is None:
        return False
    book["revoked"].append([serial, int(_now().timestamp())])
    write_private(_issued_file(settings), json.dumps(book).encode())
    write_crl(settings, book)
    return True


def write_crl(settings: Settings, book: dict | None = None) -> Path:
    """The revocation list of iotlake's CA (empty at first: the listener needs one to check)."""
    book = book if book is not None else _issued(settings)
    ca, ca_key = _ca(settings)
    now = _now()
    b = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
         .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=CA_DAYS)))
    for serial, at in book["revoked"]:
        b = b.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(int(serial))
            .revocation_date(dt.datetime.fromtimestamp(at, dt.UTC)).build())
    path = tls_dir(settings) / "crl.pem"
    write_private(path, b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path
