"""Sparkplug B messages to silver readings, per edge node, in the order the node sent them.

Births (NBIRTH for the node's own metrics, DBIRTH per device) declare metric names and aliases;
data messages (NDATA / DDATA) then usually carry aliases alone; deaths (NDEATH, the node's MQTT
will, and DDEATH) say a node or device is gone. The bridge keys an edge node's Kafka records by
the node, so its messages share a partition and keep their order.

``EdgeNodeState.apply`` is the per-node step: it keeps the node's alias table (the state that
must survive micro-batches and restarts) and turns each message into at most one silver-shaped
reading (the model's metrics by Sparkplug metric name: ``Metric.path`` is the name) or a status
event. A data message with an alias no birth declared loses nothing: it becomes a reading with
reason ``unknown_alias`` (quarantined with its raw payload) and the node is marked for a rebirth
request. A sequence gap (messages lost between the node and the broker) is counted and also asks
for a rebirth; the message itself is kept when its aliases resolve.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from lakehouse.sparkplug import BIRTHS, NUMERIC_TYPES, Topic, metric_value, payload_class


def event_id(topic: str, payload: bytes) -> str:
    """The same message delivered twice has the same id (silver drops the second)."""
    return hashlib.md5(topic.encode() + b"\x00" + payload).hexdigest()


@dataclass(slots=True)
class Output:
    """What one edge node's messages produced."""

    readings: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # births and deaths, for status
    seq_gaps: int = 0
    rebirth: bool = False  # the node should be asked for a new NBIRTH


@dataclass(slots=True)
class EdgeNodeState:
    """One edge node's alias table (alias -> (device or "", metric name)) and last sequence."""

    aliases: dict[int, tuple[str, str]] = field(default_factory=dict)
    seq: int | None = None

    def to_json(self) -> str:
        return json.dumps({"aliases": [[a, d, n] for a, (d, n) in sorted(self.aliases.items())],
                           "seq": self.seq})

    @classmethod
    def from_json(cls, text: str | None) -> EdgeNodeState:
        if not text:
            return cls()
        d = json.loads(text)
        return cls({int(a): (dev, n) for a, dev, n in d["aliases"]}, d["seq"])

    def apply(self, topic: Topic, raw: bytes, metrics: dict[str, str], out: Output,
              topic_text: str | None = None, coords: dict[str, Any] | None = None) -> None:
        """Process one message of this node; ``metrics``: Sparkplug metric name -> model metric."""
        base = {"device_id": topic.device_id, "sparkplug_group": topic.group,
                "sparkplug_node": topic.node, "message_type": topic.type, **(coords or {})}
        if topic.type in ("NCMD", "DCMD"):
            return
        try:
            p = payload_class().FromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
            out.readings.append({**base, "reasons": "not_sparkplug", "event_time_ms": None,
                                 "event_id": event_id(topic_text or topic.device_id, raw), "values": {}})
            return
        if topic.type == "NDEATH":  # the broker publishes the will: no seq
            self.seq = None
            out.events.append({**base, "event": "death", "time_ms": p.timestamp or None})
            return
        self._check_seq(p, topic.type, out)
        if topic.type == "NBIRTH":
            self.aliases.clear()  # every device of the node must rebirth after its node
        if topic.type == "DBIRTH":
            self.aliases = {a: v for a, v in self.aliases.items() if v[0] != topic.device}
        if topic.type == "DDEATH":
            out.events.append({**base, "event": "death", "time_ms": p.timestamp or None})
            return
        device = topic.device or ""
        values: dict[str, float | None] = {}
        unknown = False
        first_ts = None
        for m in p.metrics:
            name = m.name if m.HasField("name") else None
            if topic.type in BIRTHS and name is not None and m.HasField("alias"):
                self.aliases[m.alias] = (device, name)
            if name is None and m.HasField("alias"):
                found = self.aliases.get(m.alias)
                if found is None or found[0] != device:
                    unknown = True
                    continue
                name = found[1]
            first_ts = first_ts or (m.timestamp if m.HasField("timestamp") else None)
            col = metrics.get(name or "")
            if col is not None and (m.datatype in NUMERIC_TYPES or not m.HasField("datatype")):
                values[col] = metric_value(m)
        if topic.type in BIRTHS:
            out.events.append({**base, "event": "birth", "time_ms": p.timestamp or first_ts})
        if unknown:
            out.rebirth = True
        if not values and not unknown:
            return  # nothing the model reads (e.g. a node's control metrics)
        out.readings.append({**base, "event_time_ms": p.timestamp or first_ts,
                             "event_id": event_id(topic_text or topic.device_id, raw),
                             "reasons": "unknown_alias" if unknown else "", "values": values})

    def _check_seq(self, p: Any, kind: str, out: Output) -> None:
        seq = p.seq if p.HasField("seq") else None
        if kind == "NBIRTH" or seq is None:
            self.seq = seq
            return
        if self.seq is not None and seq != (self.seq + 1) % 256:
            out.seq_gaps += 1
            out.rebirth = True
        self.seq = seq
