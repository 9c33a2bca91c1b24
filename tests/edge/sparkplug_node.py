"""A Sparkplug B edge node built on pysparkplug (Eclipse Tahu's protocol, a library not ours).

Runs in its own venv (``.venv-edge``: pysparkplug pins paho-mqtt<2). Reads a JSON list of
messages on stdin, each ``{"type": "DDATA", "group": "g", "node": "n", "device": "d", "seq": 1,
"timestamp": 1764000000000, "metrics": [{"name": "Pressure", "alias": 1, "datatype": "DOUBLE",
"value": 4.2}, ...]}`` (a DEATH takes ``bd_seq`` instead of metrics for NDEATH), and either
prints ``[{"topic": ..., "payload": hex}, ...]`` (``encode``) or publishes them with QoS 1
(``publish HOST PORT``, as ``$MQTT_USERNAME`` / ``$MQTT_PASSWORD`` when set); ``decode`` reads ``[{"topic", "payload": hex}]`` and prints what
pysparkplug decodes (aliases resolved from the births before them).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pysparkplug as sp

KINDS = {"NBIRTH": sp.NBirth, "DBIRTH": sp.DBirth, "NDATA": sp.NData, "DDATA": sp.DData,
         "DDEATH": sp.DDeath}


def metric(m: dict, ts: int) -> sp.Metric:
    return sp.Metric(timestamp=m.get("timestamp", ts), name=m.get("name"),
                     datatype=sp.DataType[m["datatype"]], value=m.get("value"),
                     alias=m.get("alias"), is_null=m.get("value") is None)


def build(d: dict) -> tuple[sp.Topic, object]:
    topic = sp.Topic(message_type=sp.MessageType[d["type"]], group_id=d["group"],
                     edge_node_id=d["node"], device_id=d.get("device"))
    ts = d["timestamp"]
    if d["type"] == "NDEATH":
        bd = sp.Metric(timestamp=ts, name="bdSeq", datatype=sp.DataType.INT64, value=d.get("bd_seq", 0))
        return topic, sp.NDeath(timestamp=ts, bd_seq_metric=bd)
    if d["type"] == "DDEATH":
        return topic, sp.DDeath(timestamp=ts, seq=d["seq"])
    return topic, KINDS[d["type"]](timestamp=ts, seq=d["seq"],
                                   metrics=tuple(metric(m, ts) for m in d.get("metrics", ())))


def decode(items: list[dict]) -> list[dict]:
    births: dict[tuple, object] = {}
    out = []
    for item in items:
        topic = sp.Topic.from_str(item["topic"])
        raw = bytes.fromhex(item["payload"])
        kind = topic.message_type.value if hasattr(topic.message_type, "value") else str(topic.message_type)
        cls = {"NBIRTH": sp.NBirth, "DBIRTH": sp.DBirth, "NDATA": sp.NData, "DDATA": sp.DData,
               "DDEATH": sp.DDeath, "NDEATH": sp.NDeath, "NCMD": sp.NCmd}[kind]
        key = (topic.group_id, topic.edge_node_id, topic.device_id)
        p = cls.decode(raw, birth=births.get(key)) if kind in ("NDATA", "DDATA") else cls.decode(raw)
        if kind in ("NBIRTH", "DBIRTH"):
            births[key] = p
        out.append({"type": kind, "seq": getattr(p, "seq", None), "timestamp": p.timestamp,
                    "metrics": [[m.name, m.value] for m in getattr(p, "metrics", ())]})
    return out


def main() -> None:
    if sys.argv[1] == "decode":
        print(json.dumps(decode(json.load(sys.stdin))))
        return
    messages = [build(d) for d in json.load(sys.stdin)]
    if sys.argv[1] == "encode":
        print(json.dumps([{"topic": str(t), "payload": p.encode(include_dtypes=True).hex()}
                          for t, p in messages]))
        return
    host, port = sys.argv[2], int(sys.argv[3])
    client = sp.Client(client_id=f"iotlake-test-edge-{time.time_ns()}",
                       username=os.environ.get("MQTT_USERNAME") or None,
                       password=os.environ.get("MQTT_PASSWORD") or None)
    client.connect(host, port=port, blocking=False)
    time.sleep(0.5)
    for t, p in messages:
        client.publish(sp.Message(topic=t, payload=p, qos=sp.QoS.AT_LEAST_ONCE, retain=False),
                       include_dtypes=True)
    time.sleep(0.5)
    client.disconnect()


if __name__ == "__main__":
    main()
