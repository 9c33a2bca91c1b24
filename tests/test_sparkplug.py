"""Sparkplug B messages, encoded by pysparkplug (a library not ours, run as the edge node in
``.venv-edge``), decoded and resolved per edge node by ``silver.sparkplug``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lakehouse.sparkplug import parse_topic, payload_class, rebirth_request
from silver.sparkplug import EdgeNodeState, Output

REPO = Path(__file__).resolve().parents[1]
EDGE_PYTHON = REPO / ".venv-edge" / "bin" / "python"
EDGE = Path(__file__).with_name("edge") / "sparkplug_node.py"
T0 = 1_764_000_000_000
MODEL = {"Pressure": "pressure_bar", "Running": "running", "Offset": "offset"}


def encode(*messages: dict) -> list[tuple[str, bytes]]:
    """(topic, payload) of each message, as pysparkplug encodes it."""
    if not EDGE_PYTHON.exists():
        pytest.fail(f"{EDGE_PYTHON} missing: `make test` creates it (pysparkplug, the test edge node)")
    out = subprocess.run([str(EDGE_PYTHON), str(EDGE), "encode"], input=json.dumps(messages),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [(m["topic"], bytes.fromhex(m["payload"])) for m in json.loads(out)]


def msg(kind: str, seq: int | None, t: int, metrics=(), device: str | None = "pump7", **kw) -> dict:
    d = {"type": kind, "group": "plant1", "node": "gw1", "timestamp": T0 + t, **kw}
    if kind.startswith("D"):
        d["device"] = device
    if seq is not None:
        d["seq"] = seq
    if metrics:
        d["metrics"] = list(metrics)
    return d


def by_alias(alias: int, value, datatype: str = "DOUBLE") -> dict:
    return {"alias": alias, "datatype": datatype, "value": value}


NBIRTH = msg("NBIRTH", 0, 0, [{"name": "Uptime", "alias": 1, "datatype": "INT64", "value": 5}])
DBIRTH = msg("DBIRTH", 1, 100, [{"name": "Pressure", "alias": 2, "datatype": "DOUBLE", "value": 4.2},
                                {"name": "Running", "alias": 3, "datatype": "BOOLEAN", "value": True},
                                {"name": "Offset", "alias": 4, "datatype": "INT32", "value": -3},
                                {"name": "Label", "alias": 5, "datatype": "STRING", "value": "P-7"}])


def run(state: EdgeNodeState, encoded: list[tuple[str, bytes]]) -> Output:
    out = Output()
    for topic, raw in encoded:
        state.apply(parse_topic(topic), raw, MODEL, out, topic)
    return out


def test_births_then_data_by_alias_and_by_name() -> None:
    state = EdgeNodeState()
    out = run(state, encode(NBIRTH, DBIRTH,
                            msg("DDATA", 2, 1000, [by_alias(2, 4.5)]),
                            msg("DDATA", 3, 2000, [{"name": "Pressure", "datatype": "DOUBLE", "value": 4.7},
                                                   by_alias(3, False, "BOOLEAN")])))
    assert [(r["device_id"], r["event_time_ms"], r["values"], r["reasons"]) for r in out.readings] == [
        ("plant1/gw1/pump7", T0 + 100, {"pressure_bar": 4.2, "running": 1.0, "offset": -3.0}, ""),
        ("plant1/gw1/pump7", T0 + 1000, {"pressure_bar": 4.5}, ""),
        ("plant1/gw1/pump7", T0 + 2000, {"pressure_bar": 4.7, "running": 0.0}, ""),
    ]
    assert [(e["device_id"], e["event"]) for e in out.events] == [
        ("plant1/gw1", "birth"), ("plant1/gw1/pump7", "birth")]
    assert (out.seq_gaps, out.rebirth) == (0, False)
    assert {r["sparkplug_group"] for r in out.readings} == {"plant1"}


def test_a_birth_from_an_earlier_batch_and_across_a_restart() -> None:
    first = EdgeNodeState()
    run(first, encode(NBIRTH, DBIRTH))
    restarted = EdgeNodeState.from_json(first.to_json())  # what the state store keeps
    out = run(restarted, encode(msg("DDATA", 2, 1000, [by_alias(2, 5.0)])))
    assert [r["values"] for r in out.readings] == [{"pressure_bar": 5.0}]
    assert (out.seq_gaps, out.rebirth) == (0, False)


def test_unknown_alias_is_kept_for_quarantine_and_asks_for_a_rebirth() -> None:
    state = EdgeNodeState()
    out = run(state, encode(NBIRTH, DBIRTH, msg("DDATA", 2, 1000, [by_alias(2, 4.4), by_alias(9, 1.0)])))
    bad = out.readings[-1]
    assert bad["reasons"] == "unknown_alias" and bad["values"] == {"pressure_bar": 4.4}
    assert out.rebirth
    # a node that restarted (NBIRTH) forgets its devices' aliases until they are born again
    out = run(state, encode(msg("NBIRTH", 0, 3000, [{"name": "Uptime", "alias": 1, "datatype": "INT64",
                                                     "value": 0}]),
                            msg("DDATA", 1, 3100, [by_alias(2, 4.9)])))
    assert [r["reasons"] for r in out.readings] == ["unknown_alias"]


def test_sequence_gap_is_counted_and_the_reading_kept() -> None:
    state = EdgeNodeState()
    out = run(state, encode(NBIRTH, DBIRTH, msg("DDATA", 5, 1000, [by_alias(2, 4.4)]),
                            msg("DDATA", 6, 2000, [by_alias(2, 4.5)])))
    assert out.seq_gaps == 1 and out.rebirth
    assert [r["values"]["pressure_bar"] for r in out.readings[1:]] == [4.4, 4.5]


def test_sequence_wraps_at_256() -> None:
    state = EdgeNodeState(seq=254)
    out = run(state, encode(msg("DDATA", 255, 1, [{"name": "Pressure", "datatype": "DOUBLE", "value": 1.0}]),
                            msg("DDATA", 0, 2, [{"name": "Pressure", "datatype": "DOUBLE", "value": 2.0}])))
    assert out.seq_gaps == 0 and len(out.readings) == 2


def test_deaths_and_duplicates() -> None:
    state = EdgeNodeState()
    data = msg("DDATA", 2, 1000, [by_alias(2, 4.5)])
    encoded = encode(NBIRTH, DBIRTH, data, msg("DDEATH", 3, 2000), msg("NDEATH", None, 3000, bd_seq=0))
    out = run(state, encoded[:3] + [encoded[2]] + encoded[3:])  # the DDATA delivered twice
    ids = [r["event_id"] for r in out.readings]
    assert ids[1] == ids[2] and len(set(ids)) == 2  # silver's dedup drops the second
    assert [(e["device_id"], e["event"], e["time_ms"]) for e in out.events[2:]] == [
        ("plant1/gw1/pump7", "death", T0 + 2000), ("plant1/gw1", "death", T0 + 3000)]


def test_not_sparkplug() -> None:
    assert parse_topic("devices/dev-1/telemetry") is None
    assert parse_topic("spBv1.0/STATE/host1") is None
    assert parse_topic("spBv1.0/g/DDATA/n") is None  # a device message needs a device
    assert parse_topic("spBv1.0/g/NDATA/n/d") is None
    out = Output()
    EdgeNodeState().apply(parse_topic("spBv1.0/g/NDATA/n"), b"\xff\xff\xff", MODEL, out)
    assert [r["reasons"] for r in out.readings] == ["not_sparkplug"]


def test_rebirth_request() -> None:
    p = payload_class().FromString(rebirth_request(T0))
    assert [(m.name, m.boolean_value, m.datatype) for m in p.metrics] == [("Node Control/Rebirth", True, 11)]
