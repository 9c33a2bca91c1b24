"""Simulated devices: a stand-in fleet for demos, tests and benchmarks (never read by the
pipeline). ``fleet`` makes the messages (readings shaped by the telemetry model, duplicates,
malformed and late ones, labelled faults from ``faults``), ``sparkplug`` the Sparkplug B edge
nodes, ``publisher`` sends them over MQTT at a rate. What callers use is re-exported here."""

from ingest.simulator.fleet import (
    KINDS,
    SENSOR,
    Fleet,
    Message,
    ModelPayloads,
    device_id,
    device_topic,
    drop_field,
    encode,
    format_ts,
    generate,
    set_field,
)
from ingest.simulator.publisher import publish, run_forever

__all__ = ["KINDS", "SENSOR", "Fleet", "Message", "ModelPayloads", "device_id", "device_topic",
           "drop_field", "encode", "format_ts", "generate", "publish", "run_forever", "set_field"]
