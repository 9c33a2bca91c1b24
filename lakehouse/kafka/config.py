"""librdkafka client configuration built from settings (security settings passed through)."""

from __future__ import annotations

from typing import Any

from lakehouse.kafka import auth as kafka_auth
from lakehouse.settings import Settings


def client_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    """What every iotlake client of Kafka connects with: bootstrap, the embedded broker's SCRAM
    login when it has one (``kafka.embedded_security``), then ``kafka.client_config``."""
    conf: dict[str, Any] = {"bootstrap.servers": settings.kafka_bootstrap,
                            "log.connection.close": False}
    if kafka_auth.managed(settings):
        conf.update(kafka_auth.client_security(settings))
    conf.update(settings.kafka.client_config)
    conf.update(extra)
    return conf
