"""Who may use the embedded Kafka: with ``kafka.embedded_security = "sasl_scram"`` one generated
SCRAM-SHA-512 credential per data root, which every iotlake client of that broker logs in with.

The credential lives in ``<root>/kafka/scram.json`` (owner-only, as ``mqtt_auth`` keeps
``services.json``: whoever reads the data root can write its tables anyway). The broker learns
it when its log dir is formatted (``kafka-storage format --add-scram``; KRaft keeps SCRAM
credentials in its metadata log), so it is generated once and never changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from lakehouse.settings import Settings

USER = "iotlake"
MECHANISM = "SCRAM-SHA-512"
_LOOPBACK = ("127.0.0.1", "localhost")


def scram_on(settings: Settings) -> bool:
    return settings.kafka.embedded_security == "sasl_scram"


def managed(settings: Settings) -> bool:
    """Kafka is the embedded broker of this data root (``kafka.bootstrap`` empty, or this
    machine at ``kafka.embedded_port``)."""
    b = settings.kafka.bootstrap
    return not b or b in {f"{h}:{settings.kafka.embedded_port}" for h in _LOOPBACK}


def credential_file(settings: Settings) -> Path:
    return settings.root / "kafka" / "scram.json"


def credential(settings: Settings) -> tuple[str, str]:
    """(user, password) of this data root, created the first time it is asked for; racing
    processes agree, since only the first hard link of a complete file wins."""
    f = credential_file(settings)
    if not f.exists():
        f.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = f.with_name(f".{f.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"user": USER, "password": secrets.token_urlsafe(24)}, out)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, f)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    d = json.loads(f.read_text())
    return d["user"], d["password"]


def fingerprint(settings: Settings) -> str:
    """What a log dir records of the credential it was formatted with (not the password)."""
    user, password = credential(settings)
    return hashlib.sha256(f"{user}\0{password}".encode()).hexdigest()


def client_security(settings: Settings) -> dict[str, Any]:
    """librdkafka properties an iotlake client of the embedded broker adds (none when SCRAM
    is off)."""
    if not scram_on(settings):
        return {}
    user, password = credential(settings)
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": MECHANISM,
            "sasl.username": user, "sasl.password": password}
