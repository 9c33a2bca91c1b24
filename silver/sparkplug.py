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
request. A sequence gap (messages lost between the node and the broker) asks for a rebirth too,
and the first message after it carries ``"seq_gap": true`` in ``extra``; the message itself is
kept when its aliases resolve.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import StructType

from lakehouse.mqtt.sparkplug import (
    BIRTHS,
    NAMESPACE,
    NUMERIC_TYPES,
    Topic,
    metric_value,
    parse_topic,
    payload_class,
)
from lakehouse.telemetry import TelemetryModel
from silver.parse import mqtt_topic


def event_id(topic: str, payload: bytes) -> str:
    """The same message delivered twice has the same id (silver drops the second)."""
    return hashlib.md5(topic.encode() + b"\x00" + payload).hexdigest()


@dataclass(slots=True)
class Output:
    """What one edge node's messages produced."""

    readings: list[dict[str, Any]] = field(default_factory=list)  # one per message
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
              topic_text: str | None = None) -> dict[str, Any]:
        """Process one message of this node: exactly one row (so silver's accounting holds),
        also appended to ``out.readings``. ``metrics``: Sparkplug metric name -> model metric.

        ``status`` is ``online`` for a birth, ``offline`` for a death (gold takes both at once),
        else None; ``reasons`` is "" or ``not_sparkplug`` / ``unknown_alias``."""
        row: dict[str, Any] = {"device_id": topic.device_id, "sparkplug_group": topic.group,
                               "sparkplug_node": topic.node, "message_type": topic.type,
                               "event_id": event_id(topic_text or topic.device_id, raw),
                               "event_time_ms": None, "status": None, "reasons": "", "values": {}}
        out.readings.append(row)
        try:
            p = payload_class().FromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
            row["reasons"] = "not_sparkplug"
            return row
        row["event_time_ms"] = p.timestamp if p.HasField("timestamp") else None
        if topic.type == "NDEATH":  # the broker publishes the node's will: no seq
            self.seq = None
            row["status"] = "offline"
            return row
        if self._check_seq(p, topic.type, out):
            row["seq_gap"] = True  # messages before this one were lost: flagged in ``extra``
        if topic.type == "DDEATH":
            row["status"] = "offline"
            return row
        if topic.type == "NBIRTH":
            self.aliases.clear()  # every device of the node must rebirth after its node
        elif topic.type == "DBIRTH":
            self.aliases = {a: v for a, v in self.aliases.items() if v[0] != topic.device}
        if topic.type in BIRTHS:
            row["status"] = "online"
        device = topic.device or ""
        values = row["values"]
        unknown = False
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
            if row["event_time_ms"] is None and m.HasField("timestamp"):
                row["event_time_ms"] = m.timestamp
            col = metrics.get(name or "")
            if col is not None and (m.datatype in NUMERIC_TYPES or not m.HasField("datatype")):
                values[col] = metric_value(m)
        if unknown:
            row["reasons"] = "unknown_alias"
            out.rebirth = True
        return row

    def _check_seq(self, p: Any, kind: str, out: Output) -> bool:
        """Track the node's sequence number; True when messages were lost before this one."""
        seq = p.seq if p.HasField("seq") else None
        if kind == "NBIRTH" or seq is None:
            self.seq = seq
            return False
        # the same number again is a redelivery (silver drops it as a duplicate), not a loss
        gap = self.seq is not None and seq not in (self.seq, (self.seq + 1) % 256)
        if gap:
            out.seq_gaps += 1
            out.rebirth = True
        self.seq = seq
        return gap


# ---- in the silver stream -------------------------------------------------------------------
def is_sparkplug(topic: Column) -> Column:
    return topic.startswith(f"{NAMESPACE}/")


def sparkplug_rows(bronze: DataFrame, model: TelemetryModel, parsed_schema: StructType) -> DataFrame:
    """Bronze rows from Sparkplug topics -> rows shaped as ``silver.parse.parse`` returns them,
    one per message, by a stateful step per edge node (its alias table in Spark's state store:
    exactly once, and kept across restarts). Sparkplug context goes to ``extra`` as JSON."""
    names = {m.source: m.name for m in model.metrics}
    longs = {m.name for m in model.metrics if m.type == "long"}
    columns = parsed_schema.fieldNames()

    def fn(key: tuple, pdfs: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        node = EdgeNodeState.from_json(state.get[0] if state.exists else None)
        out = Output()
        frames = [p for p in pdfs if len(p)]
        if not frames:
            return
        df = pd.concat(frames, ignore_index=True).sort_values(["kafka_partition", "kafka_offset"],
                                                              kind="stable", ignore_index=True)
        for t, raw in zip(df["mqtt_topic"], df["value"], strict=True):
            topic = parse_topic(t)
            if topic is None:  # bad_topic (the bridge only subscribes to the six message types)
                out.readings.append({"device_id": None, "event_id": event_id(t or "", raw),
                                     "event_time_ms": None, "status": None,
                                     "reasons": "not_sparkplug", "values": {}, "message_type": None,
                                     "sparkplug_group": None, "sparkplug_node": None})
                continue
            node.apply(topic, bytes(raw), names, out, t)
        state.update((node.to_json(),))
        rows = out.readings
        for r in rows:
            if r["event_time_ms"] is None and not r["reasons"]:
                r["reasons"] = "missing_ts"
        res = pd.DataFrame({
            "value": df["value"], "kafka_topic": df["topic"], "kafka_partition": df["partition"],
            "kafka_offset": df["offset"], "ingest_time": df["ingest_time"],
            "event_id": [r["event_id"] for r in rows], "device_id": [r["device_id"] for r in rows],
            "event_time": pd.to_datetime([r["event_time_ms"] for r in rows], unit="ms", utc=True),
            "status": [r["status"] for r in rows],
            "extra": [json.dumps({"sparkplug_group": r["sparkplug_group"], "sparkplug_node": r["sparkplug_node"],
                                  "message_type": r["message_type"], **({"seq_gap": True} if r.get("seq_gap") else {})})
                      for r in rows],
            "parse_reasons": [r["reasons"] for r in rows],
            "schema_version": 1,
        })
        for m in names.values():
            vals = [r["values"].get(m) for r in rows]
            res[m] = pd.array([None if v is None else int(v) for v in vals], dtype="Int64") \
                if m in longs else pd.array(vals, dtype="Float64")
        for c in columns:
            if c not in res:
                res[c] = None
        yield res[columns]

    return (bronze.withColumn("mqtt_topic", mqtt_topic())
            .where(is_sparkplug(F.col("mqtt_topic")))
            .withColumn("node_key", F.concat_ws("/", *[F.split("mqtt_topic", "/").getItem(i) for i in (1, 3)]))
            .select("node_key", "mqtt_topic", "value", "topic", "partition", "offset", "ingest_time",
                    F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"))
            .groupBy("node_key")
            .applyInPandasWithState(fn, parsed_schema, "node string", "append",
                                    GroupStateTimeout.NoTimeout))
