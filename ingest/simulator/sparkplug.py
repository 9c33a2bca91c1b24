"""The simulator's Sparkplug B profile: edge nodes with devices, as a Sparkplug edge node runs.

Each node publishes an NBIRTH, then a DBIRTH per device declaring the model's metrics (their
``path`` is the Sparkplug metric name) with aliases, then DDATA by alias alone, the node's
sequence number running 0-255. Now and then a device dies (DDEATH) and is born again (DBIRTH)
a few messages later. Values walk inside each metric's declared range.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from ingest.simulator.fleet import Message
from lakehouse.mqtt.sparkplug import NAMESPACE, payload_class
from lakehouse.settings import Settings

#: Sparkplug B datatypes used for the model's metric types
_DOUBLE, _INT64 = 10, 4


class SparkplugFleet:
    """``devices`` devices on edge nodes of ``per_node`` devices each, in the model's first group."""

    def __init__(self, settings: Settings, devices: int, rng: random.Random, per_node: int = 5,
                 p_death: float = 0.002) -> None:
        model = settings.telemetry
        groups = [g for g in model.sparkplug_groups if g != "+"]
        self.group = groups[0] if groups else "iotlake-sim"
        self.metrics = [(m.source, m.type, m.min, m.max) for m in model.metrics]
        self.rng, self.p_death = rng, p_death
        self.devices = [(f"node-{i // per_node:03d}", f"device-{i:05d}") for i in range(devices)]
        self.nodes = sorted({n for n, _ in self.devices})
        self.seq = dict.fromkeys(self.nodes, 0)
        self.born_nodes: set[str] = set()
        self.dead: dict[tuple[str, str], int] = {}  # device -> messages until its rebirth
        self.values = {d: [self._start(lo, hi) for _, _, lo, hi in self.metrics] for d in self.devices}
        self._cls = payload_class()

    def _start(self, lo: float | None, hi: float | None) -> float:
        lo, hi = (lo if lo is not None else 0.0), (hi if hi is not None else 100.0)
        return lo + (hi - lo) * self.rng.uniform(0.3, 0.7)

    def _alias(self, device_index: int, metric_index: int) -> int:
        return 1 + device_index * len(self.metrics) + metric_index

    def _payload(self, node: str, ts: int, metrics: list[dict], seq: bool = True) -> bytes:
        p = self._cls(timestamp=ts)
        if seq:
            p.seq = self.seq[node]
            self.seq[node] = (self.seq[node] + 1) % 256
        for m in metrics:
            p.metrics.add(timestamp=ts, **m)
        return p.SerializeToString()

    def _value(self, i: int, k: int, name: str | None) -> dict:
        _, typ, lo, hi = self.metrics[k]
        lo, hi = (lo if lo is not None else 0.0), (hi if hi is not None else 100.0)
        v = self.values[self.devices[i]][k]
        v = min(hi, max(lo, v + self.rng.gauss(0, (hi - lo) * 0.01)))
        self.values[self.devices[i]][k] = v
        m = {"alias": self._alias(i, k)} | ({"name": name} if name else {})
        return m | ({"datatype": _INT64, "long_value": int(v)} if typ == "long"
                    else {"datatype": _DOUBLE, "double_value": round(v, 3)})

    def _topic(self, kind: str, node: str, device: str | None = None) -> str:
        return "/".join([NAMESPACE, self.group, kind, node, *([device] if device else [])])

    def messages(self) -> Iterator[Message]:
        """Births first, then data by alias round the fleet, with occasional deaths."""
        i = 0
        while True:
            node, dev = self.devices[i]
            ts = int(time.time() * 1000)
            if node not in self.born_nodes:
                self.born_nodes.add(node)
                self.seq[node] = 0
                yield Message(self._topic("NBIRTH", node), self._payload(node, ts, []), None, "birth")
                for j, (n, _) in enumerate(self.devices):
                    if n == node:
                        yield self._birth(j, ts)
            elif self.dead.get((node, dev)):
                self.dead[(node, dev)] -= 1
                if not self.dead[(node, dev)]:
                    del self.dead[(node, dev)]
                    yield self._birth(i, ts)
            elif self.rng.random() < self.p_death:
                self.dead[(node, dev)] = 3
                yield Message(self._topic("DDEATH", node, dev), self._payload(node, ts, []), None, "death")
            else:
                metrics = [self._value(i, k, None) for k in range(len(self.metrics))]
                yield Message(self._topic("DDATA", node, dev), self._payload(node, ts, metrics), None, "valid")
            i = (i + 1) % len(self.devices)

    def _birth(self, i: int, ts: int) -> Message:
        node, dev = self.devices[i]
        metrics = [self._value(i, k, self.metrics[k][0]) for k in range(len(self.metrics))]
        return Message(self._topic("DBIRTH", node, dev), self._payload(node, ts, metrics), None, "birth")
