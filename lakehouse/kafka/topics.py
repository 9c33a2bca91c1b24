"""iotlake's Kafka topics: created with their partition counts before anyone produces or reads.

The brokers iotlake embeds (and the ones it recommends) run with ``auto.create.topics.enable``
off, so a topic gets the configured partitions rather than the broker's default.
"""

from __future__ import annotations

import time

from lakehouse.kafka.config import client_config
from lakehouse.settings import Settings


class KafkaUnavailable(RuntimeError):
    """The broker did not answer, or refused to create a topic."""


def ensure_topics(settings: Settings, timeout: float = 30.0) -> None:
    """Create the telemetry and dead-letter topics if missing (idempotent)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_config(settings))
    wanted = {settings.kafka.topic: settings.kafka.partitions, settings.kafka.dead_letter_topic: 1}
    for t in settings.bridge.topic_map.values():
        wanted.setdefault(t, settings.kafka.partitions)
    deadline = time.monotonic() + timeout
    while True:
        try:
            existing = set(admin.list_topics(timeout=5).topics)
            break
        except Exception as e:  # noqa: BLE001 - broker still starting
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"Kafka at {settings.kafka_bootstrap} unreachable: {e}") from e
            time.sleep(0.5)
    new = [NewTopic(t, num_partitions=n, replication_factor=1) for t, n in wanted.items() if t not in existing]
    if not new:
        return
    for topic, fut in admin.create_topics(new, operation_timeout=timeout).items():
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001
            if "TOPIC_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
                raise KafkaUnavailable(f"could not create Kafka topic {topic!r}: {e}") from e
