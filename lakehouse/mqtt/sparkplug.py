"""Sparkplug B (Eclipse Tahu) on the wire: topic names, the payload schema, metric values.

Topics are ``spBv1.0/{group}/{type}/{edge_node}[/{device}]``; payloads are protobuf. Shared by
the bridge (keying a node's messages, rebirth requests) and silver (decoding,
``silver.sparkplug``). The payload schema is the Sparkplug B specification's (the fields iotlake
reads; protobuf skips the rest), declared here rather than generated: Spark's ``from_protobuf``
jar is not on the Maven mirror iotlake installs from, and the Python Sparkplug libraries pin
paho-mqtt 1.x.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

NAMESPACE = "spBv1.0"
BIRTHS, DEATHS = frozenset({"NBIRTH", "DBIRTH"}), frozenset({"NDEATH", "DDEATH"})
DATA = frozenset({"NDATA", "DDATA"})
MESSAGE_TYPES = BIRTHS | DEATHS | DATA | {"NCMD", "DCMD"}
#: Sparkplug B datatypes whose value is a number (Int8..UInt64, Float, Double, Boolean, DateTime)
NUMERIC_TYPES = frozenset(range(1, 12)) | {13}
#: the metric a host application writes in an NCMD to ask an edge node for a new NBIRTH
REBIRTH_METRIC = "Node Control/Rebirth"


@lru_cache(maxsize=1)
def payload_class() -> type:
    """The ``Payload`` protobuf message (fields numbered as the specification numbers them)."""
    f = descriptor_pb2.FieldDescriptorProto
    opt, rep = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    fd = descriptor_pb2.FileDescriptorProto(name="iotlake_sparkplug_b.proto",
                                            package="iotlake.sparkplug", syntax="proto2")
    payload = fd.message_type.add(name="Payload")
    metric = payload.nested_type.add(name="Metric")
    for name, number, kind in (("name", 1, f.TYPE_STRING), ("alias", 2, f.TYPE_UINT64),
                               ("timestamp", 3, f.TYPE_UINT64), ("datatype", 4, f.TYPE_UINT32),
                               ("is_historical", 5, f.TYPE_BOOL), ("is_transient", 6, f.TYPE_BOOL),
                               ("is_null", 7, f.TYPE_BOOL), ("int_value", 10, f.TYPE_UINT32),
                               ("long_value", 11, f.TYPE_UINT64), ("float_value", 12, f.TYPE_FLOAT),
                               ("double_value", 13, f.TYPE_DOUBLE), ("boolean_value", 14, f.TYPE_BOOL),
                               ("string_value", 15, f.TYPE_STRING)):
        metric.field.add(name=name, number=number, type=kind, label=opt)
    payload.field.add(name="timestamp", number=1, type=f.TYPE_UINT64, label=opt)
    payload.field.add(name="metrics", number=2, type=f.TYPE_MESSAGE, label=rep,
                      type_name=".iotlake.sparkplug.Payload.Metric")
    payload.field.add(name="seq", number=3, type=f.TYPE_UINT64, label=opt)
    payload.field.add(name="uuid", number=4, type=f.TYPE_STRING, label=opt)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("iotlake.sparkplug.Payload"))


@dataclass(frozen=True, slots=True)
class Topic:
    group: str
    type: str
    node: str
    device: str | None

    @property
    def node_key(self) -> str:
        return f"{self.group}/{self.node}"

    @property
    def device_id(self) -> str:
        """``group/node/device``, or ``group/node`` for the node's own messages."""
        return f"{self.node_key}/{self.device}" if self.device else self.node_key


def parse_topic(topic: str | None) -> Topic | None:
    """A Sparkplug B topic's parts; None for any other topic (STATE included)."""
    parts = (topic or "").split("/")
    if len(parts) not in (4, 5) or parts[0] != NAMESPACE or parts[2] not in MESSAGE_TYPES:
        return None
    if not all(parts[1:]) or (len(parts) == 5) != parts[2].startswith("D"):
        return None
    return Topic(parts[1], parts[2], parts[3], parts[4] if len(parts) == 5 else None)


def metric_value(m: Any) -> float | None:
    """A metric's value as a float (booleans 0/1); None when null or not numeric."""
    if m.is_null:
        return None
    for name in ("double_value", "float_value", "long_value", "int_value", "boolean_value"):
        if m.HasField(name):
            v = getattr(m, name)
            if name == "int_value" and m.datatype in (1, 2, 3) and v >= 2 ** 31:
                v -= 2 ** 32  # Int8/16/32 travel as two's complement in a uint32
            elif name == "long_value" and m.datatype == 4 and v >= 2 ** 63:
                v -= 2 ** 64
            return float(v)
    return None


def rebirth_request(timestamp_ms: int) -> bytes:
    """An NCMD payload asking an edge node to publish its births again."""
    cls = payload_class()
    p = cls(timestamp=timestamp_ms)
    p.metrics.add(name=REBIRTH_METRIC, timestamp=timestamp_ms, datatype=11, boolean_value=True)
    return p.SerializeToString()
