"""Sparkplug B messages, encoded by pysparkplug (a library not ours, run as the edge node in
``.venv-edge``), decoded and resolved per edge node by ``silver.sparkplug``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lakehouse.mqtt.sparkplug import parse_topic, payload_class, rebirth_request
from silver.sparkplug import EdgeNodeState, Output

REPO = Path(__file__).resolve().parents[1]
EDGE_PYTHON = REPO / ".venv-edge" / "bin" / "python"
EDGE = Path(__file__).with_name("edge") / "sparkplug_node.py"


def edge_env(s) -> dict[str, str]:
    """The edge node's environment: the settings' MQTT login (not on its command line)."""
    return {**os.environ, "MQTT_USERNAME": s.mqtt.username, "MQTT_PASSWORD": s.mqtt.password}
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
    assert [(r["device_id"], r["event_time_ms"], r["values"], r["status"], r["reasons"])
            for r in out.readings] == [
        ("plant1/gw1", T0, {}, "online", ""),  # the node's own metrics: none in the model
        ("plant1/gw1/pump7", T0 + 100, {"pressure_bar": 4.2, "running": 1.0, "offset": -3.0}, "online", ""),
        ("plant1/gw1/pump7", T0 + 1000, {"pressure_bar": 4.5}, None, ""),
        ("plant1/gw1/pump7", T0 + 2000, {"pressure_bar": 4.7, "running": 0.0}, None, ""),
    ]
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
    assert [r["reasons"] for r in out.readings] == ["", "unknown_alias"]


def test_sequence_gap_is_counted_and_the_reading_kept() -> None:
    state = EdgeNodeState()
    out = run(state, encode(NBIRTH, DBIRTH, msg("DDATA", 5, 1000, [by_alias(2, 4.4)]),
                            msg("DDATA", 6, 2000, [by_alias(2, 4.5)])))
    assert out.seq_gaps == 1 and out.rebirth
    assert [r["values"]["pressure_bar"] for r in out.readings[2:]] == [4.4, 4.5]
    assert [r.get("seq_gap", False) for r in out.readings] == [False, False, True, False]


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
    assert ids[2] == ids[3] and len(set(ids)) == len(ids) - 1  # silver's dedup drops the second
    assert out.seq_gaps == 0  # a redelivery is not a lost message
    assert [(r["device_id"], r["status"], r["event_time_ms"]) for r in out.readings[-2:]] == [
        ("plant1/gw1/pump7", "offline", T0 + 2000), ("plant1/gw1", "offline", T0 + 3000)]


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


# ---- in the silver stream (real Spark, real Delta files) ------------------------------------

def _bronze(settings, encoded: list[tuple[str, bytes]], first_offset: int, json_rows=()) -> None:
    from datetime import UTC, datetime

    from tests.lakehouse_fixture import write

    rows = [(t, p) for t, p in encoded] + list(json_rows)
    now = datetime.now(UTC)
    n = len(rows)
    write(settings, "bronze", {
        "key": [b"k"] * n, "value": [p for _, p in rows], "topic": [settings.kafka.topic] * n,
        "partition": [0] * n, "offset": list(range(first_offset, first_offset + n)),
        "timestamp": [now] * n, "headers": [[{"key": "mqtt_topic", "value": t.encode()}] for t, _ in rows],
        "ingest_time": [now] * n}, mode="append")


def _silver(spark, settings) -> None:
    import silver.stream
    from lakehouse.streams import release_checkpoints

    try:
        q = silver.stream.start(spark, settings, trigger="available_now")
        q.awaitTermination()
        assert q.exception() is None
    finally:
        release_checkpoints()


def test_silver_decodes_sparkplug_beside_json_exactly_once_across_runs(spark, tmp_path: Path) -> None:
    """Births in one run, data by alias in the next (state from the checkpoint), an unknown alias
    quarantined with its payload, a redelivered DDATA dropped, deaths as ``offline`` rows, and
    JSON devices on the same stream untouched."""
    from deltalake import DeltaTable

    from lakehouse.settings import load_settings
    from lakehouse.telemetry import TelemetryModel
    from silver.default_suite import default_suite

    # a metric's path is its payload field for JSON devices and its Sparkplug metric name
    model = {"sparkplug": True, "metrics": [
        {"name": "pressure_bar", "path": "Pressure", "min": 0.0, "max": 100.0},
        {"name": "running", "path": "Running"}, {"name": "offset", "path": "Offset", "type": "long"}]}
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps(default_suite(TelemetryModel(**model))))
    s = load_settings(environ={}, data_root=str(tmp_path / "lake"),
                      spark={"master": "local[2]", "shuffle_partitions": 2},
                      telemetry={**model, "suite": str(suite)})
    json_row = ("devices/j1/telemetry", json.dumps({"event_id": "e1", "device_id": "j1", "ts": T0 // 1000,
                                                    "Pressure": 3.5}).encode())
    _bronze(s, encode(NBIRTH, DBIRTH), 0, [json_row])
    _silver(spark, s)
    data = msg("DDATA", 2, 1000, [by_alias(2, 4.5), by_alias(4, -7, "INT32")])
    more = encode(data, msg("DDATA", 3, 2000, [by_alias(9, 1.0)]), msg("DDATA", 4, 3000, [by_alias(2, 250.0)]),
                  msg("DDEATH", 5, 4000))
    _bronze(s, [more[0], more[0], *more[1:]], 3)  # the DDATA delivered twice
    _silver(spark, s)

    silver = DeltaTable(s.table_path("silver")).to_pandas().sort_values(["event_time", "device_id"], ignore_index=True)
    silver = silver.astype(object).where(silver.notna(), None)
    assert [(r.device_id, r.pressure_bar, r.running, r.offset, r.status) for r in silver.itertuples()] == [
        ("j1", 3.5, None, None, None),  # a JSON device on the same stream, at the same instant
        ("plant1/gw1", None, None, None, "online"),  # the node's birth: none of its metrics modelled
        ("plant1/gw1/pump7", 4.2, 1.0, -3, "online"),
        ("plant1/gw1/pump7", 4.5, None, -7, None),
        ("plant1/gw1/pump7", None, None, None, "offline")]
    assert json.loads(silver[silver.device_id == "plant1/gw1/pump7"].extra.iloc[0]) == {
        "sparkplug_group": "plant1", "sparkplug_node": "gw1", "message_type": "DBIRTH"}
    q = DeltaTable(s.table_path("quarantine")).to_pandas()
    assert sorted(q.reason) == ["pressure_bar_in_range", "unknown_alias"]
    assert bytes(q[q.reason == "unknown_alias"].value.iloc[0]) == more[1][1]  # nothing lost
    log = DeltaTable(s.table_path("quality_log")).to_pandas()
    counters = log[log.kind == "counter"]
    total = {k: sum(json.loads(d)["count"] for d in counters[counters.expectation == k].details)
             for k in ("rows_in", "silver", "quarantine", "duplicates", "late")}
    assert total == {"rows_in": 8, "silver": 5, "quarantine": 2, "duplicates": 1, "late": 0}


def test_an_edge_node_through_mosquitto_the_bridge_kafka_bronze_and_silver(settings, spark, tmp_path: Path) -> None:
    """pysparkplug publishes as an edge node on the real Mosquitto; the bridge keys the node's
    messages to one Kafka partition in order, bytes untouched, and leaves commands out; bronze
    and silver (Spark's Kafka source, real Delta) resolve the aliases."""
    import time

    from deltalake import DeltaTable
    from test_bridge import consume, derive, running

    import bronze.stream
    from ingest.bridge import Bridge
    from ingest.mqtt_client import mqtt_client
    from lakehouse.streams import release_checkpoints

    group = f"g{time.time_ns()}"
    s = derive(settings, telemetry={"sparkplug": True, "sparkplug_groups": [group], "status_rules": [], "metrics": [
        {"name": "pressure_bar", "path": "Pressure"}, {"name": "running", "path": "Running"},
        {"name": "offset", "path": "Offset", "type": "long"}]})
    script = [msg(*a[:4], group=group) if len(a) == 4 else msg(*a, group=group) for a in (
        ("NBIRTH", 0, 0, NBIRTH["metrics"]), ("DBIRTH", 1, 100, DBIRTH["metrics"]),
        ("DDATA", 2, 1000, [by_alias(2, 4.5)]), ("DDATA", 3, 2000, [by_alias(2, 4.6)]),
        ("DDATA", 4, 3000, [by_alias(2, 4.7)]), ("DDEATH", 5, 4000))]
    host, port = s.mqtt_endpoint
    with running(Bridge(s, "b-sparkplug")):
        subprocess.run([str(EDGE_PYTHON), str(EDGE), "publish", host, str(port)], env=edge_env(s),
                       input=json.dumps(script), text=True, timeout=60, check=True)
        cmd = mqtt_client(s)  # a host's command: not a reading
        cmd.connect(host, port)
        cmd.publish(f"spBv1.0/{group}/NCMD/gw1", rebirth_request(T0), qos=1).wait_for_publish(10)
        cmd.disconnect()
        got = consume(s, s.kafka.topic, expect=len(script))
    expected = encode(*script)
    assert [(m.value(), dict(m.headers())["mqtt_topic"].decode()) for m in got] == \
        [(p, t) for t, p in expected]
    assert {m.key() for m in got} == {f"{group}/gw1".encode()} and len({m.partition() for m in got}) == 1

    try:
        for start in (bronze.stream.start, silver_start):
            q = start(spark, s, trigger="available_now")
            q.awaitTermination()
            assert q.exception() is None
    finally:
        release_checkpoints()
    rows = DeltaTable(s.table_path("silver")).to_pandas().sort_values("event_time", ignore_index=True)
    assert list(rows.pressure_bar.fillna(-1)) == [-1, 4.2, 4.5, 4.6, 4.7, -1]
    assert list(rows.status.fillna("")) == ["online", "online", "", "", "", "offline"]
    assert set(rows.device_id) == {f"{group}/gw1", f"{group}/gw1/pump7"}


def silver_start(spark, settings, trigger):
    import silver.stream

    return silver.stream.start(spark, settings, trigger=trigger)


def test_gold_deaths_take_devices_offline_and_births_bring_them_back(spark, tmp_path: Path) -> None:
    """DDEATH: that device offline at once; NDEATH: every device of the node; a new birth: online."""
    from datetime import UTC, datetime, timedelta

    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    import gold.health
    from lakehouse.settings import load_settings
    from lakehouse.streams import release_checkpoints
    from lakehouse.tables import silver_schema

    s = load_settings(environ={}, data_root=str(tmp_path / "lake"),
                      spark={"master": "local[2]", "shuffle_partitions": 2},
                      gold={"offline_after_seconds": 3600},
                      telemetry={"sparkplug": True, "metrics": [{"name": "pressure_bar", "path": "Pressure"}]})
    t0 = datetime(2026, 11, 25, tzinfo=UTC)

    def row(device: str, sec: int, kind: str, pressure=None, status=None) -> dict:
        node = "/".join(device.split("/")[:2])
        return {"event_id": f"{device}-{sec}-{kind}", "device_id": device, "event_time": t0 + timedelta(seconds=sec),
                "pressure_bar": pressure, "status": status, "schema_version": 1,
                "extra": json.dumps({"sparkplug_group": node.split("/")[0], "sparkplug_node": node.split("/")[1],
                                     "message_type": kind}),
                "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": sec, "ingest_time": t0}

    def run(rows: list[dict]) -> None:
        write_deltalake(s.table_path("silver"), pa.Table.from_pylist(rows, schema=silver_schema(s.telemetry)),
                        mode="append")
        try:
            q = gold.health.start(spark, s, trigger="available_now")
            q.awaitTermination()
            assert q.exception() is None
        finally:
            release_checkpoints()

    a, b = "p/gw1/pump1", "p/gw1/pump2"
    run([row("p/gw1", 0, "NBIRTH", status="online"), row(a, 1, "DBIRTH", 4.0, "online"),
         row(b, 2, "DBIRTH", 4.1, "online"), row(a, 10, "DDATA", 4.2), row(b, 11, "DDATA", 4.3),
         row(a, 20, "DDEATH", status="offline")])
    run([row(a, 30, "DBIRTH", 4.4, "online"), row("p/gw1", 40, "NDEATH", status="offline")])
    hist = DeltaTable(s.table_path("device_status_history")).to_pandas().sort_values(["changed_at", "device_id"])
    assert [(r.device_id, r.status, r.reason) for r in hist.itertuples() if r.device_id != "p/gw1"] == [
        (a, "online", "data"), (b, "online", "data"), (a, "offline", "death"), (a, "online", "data"),
        (a, "offline", "node_death"), (b, "offline", "node_death")]
    cur = DeltaTable(s.table_path("device_current")).to_pandas().set_index("device_id")
    assert cur.status.to_dict() == {"p/gw1": "offline", a: "offline", b: "offline"}
    assert cur.loc[b, "status_since"] == t0 + timedelta(seconds=40)


def test_the_simulator_speaks_sparkplug_as_pysparkplug_reads_it() -> None:
    """``iotlake simulate --profile sparkplug``'s messages: pysparkplug decodes them (aliases
    from the births), and silver's step resolves every one, deaths and rebirths included."""
    import itertools
    import random

    from ingest.simulator.sparkplug import SparkplugFleet
    from lakehouse.settings import load_settings

    s = load_settings(environ={}, telemetry={"sparkplug": True, "sparkplug_groups": ["plant1"], "metrics": [
        {"name": "pressure_bar", "path": "Pressure", "min": 0.0, "max": 10.0},
        {"name": "cycles", "path": "Cycles", "type": "long", "min": 0.0, "max": 1000.0}]})
    msgs = list(itertools.islice(SparkplugFleet(s, 7, random.Random(1), per_node=4, p_death=0.05).messages(), 400))
    decoded = json.loads(subprocess.run(
        [str(EDGE_PYTHON), str(EDGE), "decode"], capture_output=True, text=True, timeout=60, check=True,
        input=json.dumps([{"topic": m.topic, "payload": m.payload.hex()} for m in msgs])).stdout)
    kinds = [d["type"] for d in decoded]
    assert kinds[:5] == ["NBIRTH", "DBIRTH", "DBIRTH", "DBIRTH", "DBIRTH"] and "DDEATH" in kinds
    data = [d for d in decoded if d["type"] == "DDATA"]
    assert data and all([n for n, _ in d["metrics"]] == ["Pressure", "Cycles"] for d in data)
    assert all(0 <= d["metrics"][0][1] <= 10 for d in data)

    states: dict[str, EdgeNodeState] = {}
    out = Output()
    for m in msgs:
        t = parse_topic(m.topic)
        states.setdefault(t.node_key, EdgeNodeState()).apply(t, m.payload, {"Pressure": "pressure_bar",
                                                                            "Cycles": "cycles"}, out, m.topic)
    assert [r["reasons"] for r in out.readings] == [""] * len(msgs)
    assert (out.seq_gaps, out.rebirth) == (0, False)
    assert {r["device_id"].split("/")[0] for r in out.readings} == {"plant1"}


def test_sparkplug_settings_fail_fast() -> None:
    from lakehouse.settings import SettingsError, load_settings

    for bad, words in (({"telemetry": {"sparkplug": True}, "stream": {"dedup": "state_store"}}, 'stream.dedup = "index"'),
                       ({"telemetry": {"sparkplug": True, "sparkplug_groups": ["a/b"]}}, "sparkplug_groups")):
        with pytest.raises((SettingsError, ValueError), match=words):
            load_settings(environ={}, **bad)


def test_the_bridge_asks_a_node_without_a_birth_for_a_rebirth(settings) -> None:
    """Data from an edge node whose NBIRTH the bridge never saw: one NCMD "Node Control/Rebirth"
    (pysparkplug decodes it), not one per message; after the node's birth, none."""
    import threading
    import time

    from test_bridge import derive, running

    from ingest.bridge import Bridge
    from ingest.mqtt_client import mqtt_client

    group = f"r{time.time_ns()}"
    s = derive(settings, telemetry={"sparkplug": True, "sparkplug_groups": [group], "status_rules": [],
                                    "metrics": [{"name": "pressure_bar", "path": "Pressure"}]})
    host, port = s.mqtt_endpoint
    commands: list[tuple[str, bytes]] = []
    got = threading.Event()

    def on_message(client, userdata, m) -> None:
        commands.append((m.topic, m.payload))
        got.set()

    watcher = mqtt_client(s)
    watcher.on_message = on_message
    watcher.connect(host, port)
    watcher.subscribe(f"spBv1.0/{group}/NCMD/+", qos=1)
    watcher.loop_start()
    try:
        time.sleep(0.5)
        data = [msg("DDATA", i, 1000 + i, [{"name": "Pressure", "datatype": "DOUBLE", "value": 1.0}], group=group)
                for i in range(1, 4)]
        with running(Bridge(s, "b-rebirth")):
            subprocess.run([str(EDGE_PYTHON), str(EDGE), "publish", host, str(port)], env=edge_env(s),
                           input=json.dumps(data), text=True, timeout=60, check=True)
            assert got.wait(15), "no rebirth request"
            time.sleep(1.0)
            assert [t for t, _ in commands] == [f"spBv1.0/{group}/NCMD/gw1"]  # once, not per message
            born = [msg("NBIRTH", 0, 5000, group=group), msg("NDATA", 1, 5001, [
                {"name": "Pressure", "datatype": "DOUBLE", "value": 2.0}], group=group)]
            subprocess.run([str(EDGE_PYTHON), str(EDGE), "publish", host, str(port)], env=edge_env(s),
                           input=json.dumps(born), text=True, timeout=60, check=True)
            time.sleep(1.0)
        assert len(commands) == 1
    finally:
        watcher.loop_stop()
        watcher.disconnect()
    decoded = json.loads(subprocess.run(
        [str(EDGE_PYTHON), str(EDGE), "decode"], capture_output=True, text=True, timeout=60, check=True,
        input=json.dumps([{"topic": t, "payload": p.hex()} for t, p in commands])).stdout)
    assert decoded[0]["type"] == "NCMD" and decoded[0]["metrics"] == [["Node Control/Rebirth", True]]
