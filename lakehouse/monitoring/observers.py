"""In-process subscribers to what a stream's batch produced (e.g. the alert engine to silver's
readings), so a layer hands its rows upward without importing the layer above.

A stream publishes after its batch is parsed and before it commits: a subscriber sees a batch
Spark replays again, so it must be idempotent (the alert engine follows breaches by event time).
A subscriber's failure is logged, never the batch's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow as pa

log = logging.getLogger(__name__)
_subscribers: dict[str, list[Callable[[pa.Table], None]]] = {}


def subscribe(topic: str, fn: Callable[[pa.Table], None]) -> Callable[[], None]:
    """Call ``fn`` with every table published on ``topic``; returns the unsubscribe."""
    _subscribers.setdefault(topic, []).append(fn)
    return lambda: _subscribers.get(topic, []).remove(fn) if fn in _subscribers.get(topic, []) else None


def wanted(topic: str) -> bool:
    return bool(_subscribers.get(topic))


def publish(topic: str, table: pa.Table) -> None:
    for fn in list(_subscribers.get(topic, ())):
        try:
            fn(table)
        except Exception:  # noqa: BLE001 - an observer never fails the stream's batch
            log.exception("observer of %s failed", topic)
