"""Bridge observability: a cheap latency histogram and a Prometheus collector over ``Bridge.stats``.

The hot path only bumps plain integers; Prometheus reads them at scrape time through a custom
collector, so metrics cost nothing per message beyond one bisect for the latency histogram.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
COUNTERS = {
    "received": "MQTT messages received",
    "delivered": "messages confirmed by Kafka on the target topic",
    "dead_lettered": "messages confirmed by Kafka on the dead-letter topic",
    "failed": "Kafka delivery failures (retried or dead-lettered, never dropped)",
    "acked": "MQTT acknowledgements sent",
    "reconnects": "MQTT reconnects",
}
GAUGES = {"in_flight": "received but not yet acknowledged", "connected": "1 when connected to MQTT"}


class LatencyHistogram:
    """Fixed-bucket histogram (seconds) with a bucket-resolution quantile estimate."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float, n: int = 1) -> None:
        """``n`` observations of ``seconds`` (records confirmed together share one latency)."""
        self.counts[bisect.bisect_left(self.bounds, seconds)] += n
        self.total += seconds * n
        self.n += n

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (inf beyond the last bucket)."""
        if not self.n:
            return math.nan
        rank, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return self.bounds[i] if i < len(self.bounds) else math.inf
        return math.inf

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


class BridgeCollector(Collector):
    """Exposes a bridge's ``stats`` and latency histogram, labelled by bridge id."""

    def __init__(self, bridge_id: str, stats: Callable[[], dict[str, Any]], latency: LatencyHistogram) -> None:
        self.bridge_id, self.stats, self.latency = bridge_id, stats, latency

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        for name, doc in COUNTERS.items():
            m = CounterMetricFamily(f"iotlake_bridge_{name}", doc, labels=["bridge_id"])
            m.add_metric([self.bridge_id], s[name])
            yield m
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(f"iotlake_bridge_{name}", doc, labels=["bridge_id"])
            g.add_metric([self.bridge_id], s[name])
            yield g
        h = HistogramMetricFamily("iotlake_bridge_delivery_latency_seconds",
                                  "MQTT receive to Kafka delivery confirmation", labels=["bridge_id"])
        h.add_metric([self.bridge_id], self.latency.cumulative(), self.latency.total)
        yield h


def serve(port: int, collector: BridgeCollector, addr: str = "127.0.0.1") -> Callable[[], None]:
    """Serve /metrics on ``addr:port`` (own registry, so several bridges per process work); returns
    a stopper. Loopback by default, like every iotlake endpoint."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("bridge metrics on http://%s:%d/metrics", addr, port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
