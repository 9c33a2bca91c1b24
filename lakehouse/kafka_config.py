"""librdkafka client configuration built from settings (security settings passed through)."""

from __future__ import annotations

from typing import Any

from lakehouse.settings import Settings


def client_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {"bootstrap.servers": settings.kafka_bootstrap,
                            "log.connection.close": False}
    conf.update(settings.kafka.client_config)
    conf.update(extra)
    return conf
