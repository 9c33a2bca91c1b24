"""Any fleet by configuration: the telemetry model drives silver's parsing, identity and columns.

Parsing is checked on real Spark with bronze rows as the Kafka source gives them (headers with
the bridge's ``mqtt_topic``); the schema change of a running deployment on a real silver stream
and Delta table.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from fleets import ROOT, SENSOR

import silver.stream
from lakehouse.settings import SettingsError, load_settings
from lakehouse.tables import BRONZE, silver_schema
from lakehouse.telemetry import TelemetryModel
from orchestration.cli import main as cli_main
from silver.default_suite import default_suite
from silver.expectations import load_suite, suite_for
from silver.parse import only_known_members, parse, payload_struct

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)

#: An industrial pump fleet: id only in the topic, nested readings, epoch-second times, no
#: event ids, a site in the topic.
PUMP = {
    "topic_pattern": "plant/{site}/{device_id}/telemetry",
    "device_id_path": "", "event_id_path": "", "status_path": "", "schema_version_path": "",
    "event_time_path": "ts", "event_time_format": "epoch_s",
    "metrics": [
        {"name": "pressure", "path": "readings.pressure_bar", "unit": "bar", "min": 0, "max": 40},
        {"name": "flow", "path": "readings.flow_m3h", "unit": "m3/h", "min": 0},
        {"name": "vibration", "path": "readings.vibration_mm_s", "unit": "mm/s"},
        {"name": "rpm", "path": "readings.rpm", "type": "long"},
        {"name": "motor_temperature", "path": "readings.motor_temp_c", "unit": "°C", "gold": False},
    ],
}


def bronze_rows(spark, records: list[tuple[str | None, bytes]]):
    """Bronze rows as the Kafka source reads what the bridge wrote: (MQTT topic, payload)."""
    rows = [{"key": None, "value": payload, "topic": "telemetry", "partition": 0, "offset": i,
             "timestamp": NOW, "ingest_time": NOW,
             "headers": [{"key": "mqtt_topic", "value": topic.encode()}] if topic else []}
            for i, (topic, payload) in enumerate(records)]
    return spark.createDataFrame(pa.Table.from_pylist(rows, schema=BRONZE).to_pandas())


def parsed(spark, model: TelemetryModel, records, suite=None) -> list[dict]:
    df = silver.stream.validated(bronze_rows(spark, records), suite, model)
    return [r.asDict() for r in df.orderBy("kafka_offset").collect()]


def test_a_pump_fleet_by_configuration_only(spark, tmp_path: Path) -> None:
    model = TelemetryModel(**PUMP)
    payload = json.dumps({"ts": 1764000000, "meta": {"fw": "2.1"},
                          "readings": {"pressure_bar": 4.2, "flow_m3h": 12.5, "vibration_mm_s": 0.8,
                                       "rpm": 1450, "motor_temp_c": 61.5}}).encode()
    rows = parsed(spark, model, [
        ("plant/north/pump-7f3a/telemetry", payload),
        ("plant/north/pump-7f3a/telemetry", payload),  # a redelivery: the same derived event id
        ("plant/south/pump-0001/telemetry", json.dumps({"ts": 1764000060123,  # ms: wrong unit
                                                        "readings": {"rpm": "fast"}}).encode()),
        ("elsewhere/x", payload),  # not the pattern's topic: no device
    ], suite=load_suite(_suite_file(model, tmp_path)))
    first = rows[0]
    assert first["device_id"] == "pump-7f3a" and first["site"] == "north"
    assert first["event_time"] == datetime(2025, 11, 24, 16, 0)  # naive UTC (session time zone)
    assert (first["pressure"], first["flow"], first["vibration"], first["rpm"],
            first["motor_temperature"]) == (4.2, 12.5, 0.8, 1450, 61.5)
    assert json.loads(first["extra"]) == {"meta": '{"fw":"2.1"}'}
    assert first["reasons"] == ""
    assert first["event_id"] == hashlib.md5(b"pump-7f3a\x00" + payload).hexdigest()
    assert rows[1]["event_id"] == first["event_id"]
    assert rows[2]["reasons"] == "bad_ts,wrong_type:rpm,event_time_not_null"
    assert rows[3]["device_id"] is None and "device_id_not_null" in rows[3]["reasons"]
    assert silver_schema(model).names[:9] == [
        "event_id", "device_id", "event_time", "pressure", "flow", "vibration", "rpm",
        "motor_temperature", "site"]
    assert silver_schema(model).field("rpm").type == pa.int64()
    assert model.gold_metrics == ("pressure", "flow", "vibration", "rpm")


def _suite_file(model: TelemetryModel, tmp: Path) -> Path:
    f = tmp / "suite.json"
    f.write_text(json.dumps(default_suite(model)))
    return f


def sensor(device: str, event_id: str = "e1", **over) -> bytes:
    rec = {"device_id": device, "event_id": event_id, "ts": "2026-11-25T11:59:00Z",
           "temperature": 21.0, "humidity": 40.0, "battery": 80.0}
    return json.dumps({**rec, **over}, ensure_ascii=False).encode()


def test_topic_parts_are_whole_levels_of_a_matching_topic(spark) -> None:
    """A topic matches the pattern when it has as many levels, the literal ones equal and the
    named ones not empty; its named parts are then those levels, whatever they hold."""
    from silver.parse import topic_device

    model = TelemetryModel(**PUMP)
    topics = {"plant/n/p1/telemetry": ("p1", "n"), "plant/ü/ß.x-1/telemetry": ("ß.x-1", "ü"),
              "plant/a b/c+d/telemetry": ("c+d", "a b"), "plant//p1/telemetry": None,
              "plant/n//telemetry": None, "plant/n/p1/telemetry/x": None, "plant/n/p1": None,
              "x/n/p1/telemetry": None, "plant/n/p1/telemetryx": None, "/plant/n/p1/telemetry": None,
              "plant/n/p1/telemetry/": None, "": None, "plant/n/p1/telemetry\n": None}
    rows = [([{"key": "mqtt_topic", "value": t.encode()}],) for t in topics] + [([],)]
    device, parts = topic_device(model)
    got = spark.createDataFrame(rows, "headers array<struct<key:string,value:binary>>").select(
        device.alias("d"), parts["site"].alias("s")).collect()
    assert [None if r.d is None and r.s is None else (r.d, r.s) for r in got] == [*topics.values(), None]


def test_topic_and_payload_must_name_the_same_device(spark) -> None:
    records = [("devices/dev-00010/telemetry", sensor("dev-00009")),
               ("devices/dev-00010/telemetry", sensor("dev-00010", "e2")),
               (None, sensor("dev-00009", "e3"))]  # no bridge header: the payload alone
    rows = parsed(spark, SENSOR, records)
    assert [(r["device_id"], r["reasons"]) for r in rows] == [
        ("dev-00009", "device_mismatch"), ("dev-00010", ""), ("dev-00009", "")]
    trusted = parsed(spark, TelemetryModel(**{**SENSOR.model_dump(), "on_device_mismatch": "trust_topic"}),
                     records)
    assert [(r["device_id"], r["reasons"]) for r in trusted] == [
        ("dev-00010", ""), ("dev-00010", ""), ("dev-00009", "")]


#: Nested members of several depths and types, a metric at the top, ids and times nested too.
DEEP = {
    "topic_pattern": "devices/{device_id}/telemetry", "device_id_path": "", "status_path": "",
    "event_id_path": "meta.id", "event_time_path": "meta.ts", "schema_version_path": "v",
    "metrics": [{"name": "a", "path": "r.a"}, {"name": "b", "path": "r.x.b", "type": "long"},
                {"name": "c", "path": "r.x.c"}, {"name": "d", "path": "top"},
                {"name": "e", "path": "s.e", "type": "long"}],
}
#: JSON values a device may put where a number belongs
ODD_VALUES = ["1", "-2.5", "1e3", "1E-7", "1.0", "1500.0", "-0", "0.0", "12345678901234567890",
              "9223372036854775807", "9223372036854775808", "-9223372036854775809", "1e400",
              "-1e400", '"3.5"', '" 4 "', '"1e3"', '"NaN"', "NaN", '"Infinity"', "Infinity",
              "-Infinity", '"INF"', '"-INF"', "true", "null", '"x"', "[]", "[1, 2]", "{}",
              '{"q": 1}', '""', '"\u0661\u0662"', '"7"', "0.1", "2.5e-3"]

#: Values with colons and escapes: silver tells a payload's unknown members by its colons
COLONS = ['"12:30:00"', '"a\\u003ab"', '"q\\"u:"', '{"k:1": "v:2"}', '[{"k": ":"}]']


def _odd_payloads(model: TelemetryModel, n: int, seed: int = 7) -> list[tuple[str, bytes]]:
    """Payloads shaped by the model, with members and values of every kind: odd values, members
    that are not objects, missing keys, unknown fields, ISO and epoch times, broken JSON."""
    rng = random.Random(seed)
    out = []

    def put(tree: dict, path: str, value: str) -> None:
        *parents, leaf = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {}) if isinstance(node.get(name, {}), dict) else {}
        node[leaf] = value

    for i in range(n):
        tree: dict = {}
        for m in model.metrics:
            if rng.random() < 0.1:
                continue
            good = str(rng.randrange(5000)) if m.type == "long" else repr(round(rng.uniform(0, 99), 3))
            # (a number beyond a double's range at the top: infinity in the struct, a wrong type
            # in the map, as silver.parse says)
            odd = ODD_VALUES if "." in m.source else [v for v in ODD_VALUES if "e400" not in v]
            put(tree, m.source, rng.choice(odd) if rng.random() < 0.15 else good)
        device = f"dev-{i % 7}"
        event_id = rng.choice([f'"e{i}"'] * 8 + [f'"e:{i}"', f'"e\\u003a{i}"'])
        for path, good in ((model.event_id_path, event_id), (model.device_id_path, f'"{device}"'),
                           (model.status_path, '"ok"'), (model.schema_version_path, "1")):
            if path and rng.random() < 0.9:
                # (a number beyond a double's range where a string is read: quoted in the struct
                # only, as silver.parse says)
                strange = [v for v in ODD_VALUES if "e400" not in v] + COLONS + ['"dev-0"']
                put(tree, path, good if rng.random() < 0.9 else rng.choice(strange))
        if rng.random() < 0.9:  # mostly a good time, so most rows get as far as their metrics
            put(tree, model.event_time_path, str(1764071940 + i) if rng.random() < 0.8
                else f'"2025-11-25T11:{i % 60:02d}:00Z"')
        if rng.random() < 0.1:  # an unknown field, or a member of another shape
            tree[rng.choice(["extra", "fw", "r", "readings", "s", "ts", "a:b"])] = rng.choice(ODD_VALUES + COLONS)
        nested = [v for v in tree.values() if isinstance(v, dict)]
        if nested and rng.random() < 0.05:  # a member no path names, inside a known object
            rng.choice(nested)[rng.choice(["zz", "k:"])] = rng.choice(ODD_VALUES + COLONS)

        def dump(node) -> str:
            if not isinstance(node, dict):
                return node
            # (no name twice: the struct keeps the last, the map the first, as silver.parse says)
            return "{" + ", ".join(f'{json.dumps(k)}: {dump(v)}' for k, v in node.items()) + "}"

        text = dump(tree)
        if rng.random() < 0.05:
            text = text[: rng.randrange(1, max(2, len(text)))]  # truncated
        topic = model.topic_pattern.replace("{device_id}", device)
        out.append((re.sub(r"\{\w+\}", "s1", topic), text.encode()))
    return out


@pytest.mark.parametrize("model", [TelemetryModel(**PUMP), TelemetryModel(**DEEP), SENSOR],
                         ids=["pump", "deep", "sensor"])
def test_the_typed_parse_reads_payloads_as_the_map_does(spark, model) -> None:
    """Payloads are read from one typed parse of the model's fields; a payload that does not fit
    it is read from its map of members and JSON paths. Both give the same columns and reasons as
    the map alone, whatever the payload holds."""
    assert payload_struct(model) is not None
    records = _odd_payloads(model, 600)
    records += [(t, p.replace(b"readings", b"READINGS")) for t, p in records[:20]]
    bronze = bronze_rows(spark, records).repartition(2)  # run as a stream would (no local folding)
    typed = parse(bronze, model)
    assert "__iotlake_unfit" in typed._jdf.queryExecution().executedPlan().toString()

    def rows(df) -> list[tuple]:
        return [tuple(repr(v) for v in r) for r in df.orderBy("kafka_offset").collect()]

    got, reference = rows(typed), rows(parse(bronze, model, typed=False))
    assert got == reference
    reasons = " ".join(r[-1] for r in got)
    first_metric = model.metrics[0].name
    assert f"wrong_type:{first_metric}" in reasons and "not_json" in reasons
    assert sum(r[-1] == "''" for r in got) > 100  # many rows parse cleanly too


def test_fields_that_cannot_be_one_struct_are_read_from_the_map() -> None:
    """Paths that cannot form one struct: no struct, and ``parse`` reads every payload from its
    map, as with ``typed=False``."""
    fine = TelemetryModel(device_id_path="id", metrics=[{"name": "a", "path": "r.x"}, {"name": "c", "path": "q.x"}])
    assert payload_struct(fine).simpleString() == (
        "struct<id:string,event_id:string,ts:string,status:string,schema_version:string,"
        "r:struct<x:double>,q:struct<x:double>>")
    for metrics, ids in (
            ([{"name": "a", "path": "r.Speed"}, {"name": "b", "path": "r.speed"}], {}),  # case
            ([{"name": "a", "path": "r.x"}, {"name": "b", "path": "r.x.y"}], {}),  # leaf and object
            ([{"name": "a", "path": "R.x"}, {"name": "b", "path": "r.y"}], {}),  # tops by case
            ([{"name": "a", "path": "id"}], {}),  # a metric and the id: two types
            ([{"name": "a", "path": "r.x"}], {"event_id_path": "r"}),  # a string and an object
    ):
        assert payload_struct(TelemetryModel(**{"device_id_path": "id", **ids, "metrics": metrics})) is None


def test_a_payload_without_unknown_members_is_told_by_its_colons(spark) -> None:
    """The map of members is parsed only where the colons do not prove that the payload holds
    nothing but the struct's members: never missing an unknown one, nested, named with a colon
    or hidden behind an escape."""
    from pyspark.sql import functions as F

    struct = payload_struct(TelemetryModel(device_id_path="id", metrics=[{"name": "a", "path": "r.x"}]))
    cases = {
        '{"id": "d1", "ts": "2025-11-25T11:00:00Z", "r": {"x": 1.5}}': True,
        '{"id": "d:1", "ts": "12:00", "event_id": "e:1:2", "schema_version": 1}': True,
        '{"status": {"k:1": ["v:2", {"w": ":"}]}}': True,  # a string field holding JSON
        '{"r": {}}': True, "{}": True, ' { "id" :"d1" , "r" : { "x" : 2 } } ': True,
        '{"id": "d1", "fw": "2"}': False, '{"id": "d1", "r": {"x": 1, "y": 2}}': False,
        '{"id": "d1", "a:b": 1}': False, '{"id": "d1", "r": {"x": 1, "k:": 2}}': False,
        '{"id": "d\\u003a1", "fw": 2}': False, '{"id": "d\\u003a1"}': False,
        '{"id": null}': False, '{"id": "a", "id": "b"}': False, '{"id": "a", "fw": {"q": 1}}': False,
    }
    df = spark.createDataFrame([(t,) for t in cases], "text string")
    got = df.select("text", only_known_members(F.col("text"), F.from_json("text", struct), struct).alias("k"))
    assert {r["text"]: r["k"] for r in got.collect()} == cases


def test_real_fleet_ids_pass_the_generated_suite(spark) -> None:
    """Hyphens, dots, slashes, unicode and UUID event ids are ids; blanks and control
    characters are not, nor is an id longer than the model allows."""
    good = ["sensor-a1", "plant.7.pump", "site/3/unit-4", "Kühlraum-Ost", "传感器-7", "a"]
    bad = {"has space": "device_id_printable", "tab\there": "device_id_printable",
           "x" * 129: "device_id_length"}
    records = [(None, sensor(d, f"3f2b8c1e-4a5d-4e6f-9a7b-{i:012d}")) for i, d in enumerate(good)]
    records += [(None, sensor(d, f"bad-{i}")) for i, d in enumerate(bad)]
    model = SENSOR.model_copy(update={"suite": ""})
    rows = parsed(spark, model, records, suite_for(model))  # generated from the model
    assert [r["reasons"] for r in rows[:len(good)]] == [""] * len(good)
    assert [r["device_id"] for r in rows[:len(good)]] == good
    assert [r["reasons"] for r in rows[len(good):]] == list(bad.values())


@pytest.mark.parametrize(("fmt", "ts", "expected"), [
    ("auto", "2026-11-25T11:59:00.250Z", datetime(2026, 11, 25, 11, 59, 0, 250000)),
    ("auto", 1764071940, datetime(2025, 11, 25, 11, 59)),
    ("auto", 1764071940250, datetime(2025, 11, 25, 11, 59, 0, 250000)),
    ("auto", 1764071940250001, datetime(2025, 11, 25, 11, 59, 0, 250001)),
    ("epoch_s", 1764071940.5, datetime(2025, 11, 25, 11, 59, 0, 500000)),
    ("epoch_ms", 1764071940250, datetime(2025, 11, 25, 11, 59, 0, 250000)),
    ("epoch_us", 1764071940250001, datetime(2025, 11, 25, 11, 59, 0, 250001)),
    ("iso8601", 1764071940, None),
    ("epoch_s", "2026-11-25T11:59:00Z", None),
])
def test_event_time_formats(spark, fmt, ts, expected) -> None:
    model = TelemetryModel(event_time_format=fmt)
    (row,) = parsed(spark, model, [(None, sensor("d1", ts=ts))])
    assert row["event_time"] == expected
    assert row["reasons"] == ("" if expected else "bad_ts")


def test_a_metric_added_to_a_running_deployment(spark, tmp_path: Path) -> None:
    """Next start after the model gains a metric: the column is added (older rows null), the
    stream resumes from its checkpoint; a metric removed later keeps its column."""
    base = dict(environ={}, data_root=str(tmp_path / "lake"),
                spark={"master": "local[2]", "shuffle_partitions": 2})
    before = load_settings(**base, telemetry=SENSOR.model_dump(mode="json"))
    bronze = before.table_path("bronze")
    write_deltalake(bronze, BRONZE.empty_table())

    def append(*payloads: bytes, first: int) -> None:
        n = len(payloads)
        write_deltalake(bronze, pa.table({
            "key": [None] * n, "value": list(payloads), "topic": ["t"] * n, "partition": [0] * n,
            "offset": list(range(first, first + n)), "timestamp": [NOW] * n, "headers": [[]] * n,
            "ingest_time": [NOW] * n}, schema=BRONZE), mode="append")

    def run(settings) -> None:
        q = silver.stream.start(spark, settings, trigger="available_now")
        q.awaitTermination(300)
        assert q.exception() is None

    append(sensor("d1", "e1", pressure=1.5), first=0)
    run(before)
    metrics = [*before.telemetry.model_dump()["metrics"], {"name": "pressure", "min": 0}]
    after = load_settings(**base, telemetry={"metrics": metrics})
    append(sensor("d1", "e2", pressure=2.5), first=1)
    run(after)
    t = DeltaTable(after.table_path("silver")).to_pandas().sort_values("event_id")
    assert list(t.event_id) == ["e1", "e2"]
    assert t.pressure.isna().tolist() == [True, False] and t.pressure.iloc[1] == 2.5
    assert json.loads(t.extra.iloc[0]) == {"pressure": "1.5"}  # undeclared then: kept in extra
    assert t.extra.isna().iloc[1]

    fewer = [m for m in metrics if m["name"] != "humidity"]
    removed = load_settings(**base, telemetry={"metrics": fewer})
    append(sensor("d1", "e3"), first=2)
    run(removed)
    t = DeltaTable(after.table_path("silver")).to_pandas().sort_values("event_id")
    assert "humidity" in t.columns and t.humidity.isna().tolist() == [False, False, True]


@pytest.mark.parametrize("fleet", ["sensor", "pump"])
def test_an_example_fleets_suite_is_its_models_generated_one(fleet) -> None:
    model = load_settings(ROOT / "examples" / f"{fleet}.toml", environ={}).telemetry
    suite = ROOT / model.suite
    assert suite.parent == ROOT / "examples"
    assert json.loads(suite.read_text()) == json.loads(json.dumps(default_suite(model), ensure_ascii=False))
    names = [c.name for c in load_suite(suite).checks]
    assert not any("format" in n for n in names)  # no id pattern of one fleet
    generated = suite_for(model.model_copy(update={"suite": ""}))  # a model without a suite file
    assert [c.name for c in generated.checks] == names


def test_a_model_without_metrics_fails_fast_naming_the_key(tmp_path: Path, capsys) -> None:
    """iotlake declares no fleet: without metrics a pipeline does not start, and says how."""
    cfg = tmp_path / "iotlake.json"
    cfg.write_text(json.dumps({"data_root": str(tmp_path / "lake")}))
    for command in (["run", "--simulate", "10"], ["demo", "--events", "10"], ["expectations"]):
        assert cli_main(["--config", str(cfg), *command]) == 2
        err = capsys.readouterr().err
        assert "no metrics declared" in err and "[telemetry]" in err and "examples/sensor.toml" in err
    assert not (tmp_path / "lake").exists()  # nothing started, nothing written


def test_expectations_command(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "iotlake.json"
    cfg.write_text(json.dumps({"data_root": str(tmp_path / "lake"), "telemetry": PUMP}))
    assert cli_main(["--config", str(cfg), "expectations"]) == 0
    suite = json.loads(capsys.readouterr().out)
    names = [e["meta"]["name"] for e in suite["expectations"]]
    assert {"pressure_in_range", "flow_in_range"} <= set(names) and "rpm_in_range" not in names
    out = tmp_path / "suite.json"
    assert cli_main(["--config", str(cfg), "expectations", "--out", str(out)]) == 0
    assert load_suite(out).name == "telemetry"
    assert cli_main(["--config", str(cfg), "expectations", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize(("telemetry", "named"), [
    ({"metrics": [{"name": "device_id"}]}, "telemetry.metrics.0"),
    ({"metrics": [{"name": "Temp C"}]}, "telemetry.metrics.0.name"),
    ({"topic_pattern": "plant/+/{device_id}"}, "telemetry.topic_pattern"),
    ({"device_id_path": "", "topic_pattern": "plant/{site}"}, "telemetry"),
    ({"event_time_format": "unix"}, "telemetry.event_time_format"),
    ({"metrics": [{"name": "a", "min": 5, "max": 1}]}, "telemetry.metrics.0"),
])
def test_a_bad_model_fails_fast_naming_the_key(tmp_path: Path, telemetry, named, capsys) -> None:
    with pytest.raises(SettingsError, match=rf"setting '{named}'"):
        load_settings(environ={}, telemetry=telemetry)
    cfg = tmp_path / "iotlake.json"
    cfg.write_text(json.dumps({"data_root": str(tmp_path / "lake"), "telemetry": telemetry}))
    assert cli_main(["--config", str(cfg), "expectations"]) == 2
    assert named in capsys.readouterr().err


def test_gold_follows_the_model_and_its_status_rules(spark, tmp_path: Path) -> None:
    """Gold health and windows score, window and judge the model's gold metrics (a pump fleet's
    pressure rule); adding a gold metric later needs no new checkpoint."""
    import gold.health
    import gold.windows

    pump = {**PUMP, "status_rules": [{"metric": "pressure", "below": 1.0, "reason": "low_pressure"}],
            "error_status": ""}
    base = dict(environ={}, data_root=str(tmp_path / "lake"),
                spark={"master": "local[2]", "shuffle_partitions": 2}, stream={"watermark_seconds": 30},
                gold={"status_hold_seconds": 0, "status_hold_readings": 1})  # one reading judges
    s = load_settings(**base, telemetry=pump)
    schema = silver_schema(s.telemetry)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def rows(first: int, n: int, pressure: float, **extra) -> pa.Table:
        recs = [{"event_id": f"e{first + i}", "device_id": "pump-7f3a", "site": "north",
                 "event_time": t0 + timedelta(seconds=10 * (first + i)),
                 "pressure": pressure, "flow": 12.0, "vibration": 0.5, "rpm": 1450,
                 "motor_temperature": 60.0, "status": None, "schema_version": 1, "extra": None,
                 "kafka_partition": 0, "kafka_offset": first + i, "ingest_time": t0, **extra}
                for i in range(n)]
        return pa.Table.from_pylist(recs, schema=schema)

    def run(settings) -> None:
        for start in (gold.health.start, gold.windows.start):
            q = start(spark, settings, trigger="available_now")
            q.awaitTermination(300)
            assert q.exception() is None

    write_deltalake(s.table_path("silver"), rows(0, 6, 4.0))
    write_deltalake(s.table_path("silver"), rows(6, 1, 0.4), mode="append")
    run(s)
    scored = DeltaTable(s.table_path("readings_scored")).to_pandas()
    assert sorted(scored.metric.unique()) == ["flow", "pressure", "rpm", "vibration"]
    assert len(scored) == 7 * 4
    hist = DeltaTable(s.table_path("device_status_history")).to_pandas().sort_values("changed_at")
    assert list(zip(hist.status, hist.reason, strict=True)) == [("online", "data"), ("degraded", "low_pressure")]
    cur = DeltaTable(s.table_path("device_current")).to_pandas()
    assert {"pressure", "flow", "vibration", "rpm"} <= set(cur.columns) and "temperature" not in cur.columns
    assert cur.pressure.tolist() == [0.4] and cur.status.tolist() == ["degraded"]
    windows = DeltaTable(s.table_path("gold_metrics_1m")).to_pandas()
    assert sorted(windows.metric.unique()) == ["flow", "pressure", "rpm", "vibration"]
    assert windows[windows.metric == "rpm"]["count"].sum() == 7

    # motor_temperature joins gold: same checkpoints, a new device_current column
    more = {**pump, "metrics": [{**m, "gold": True} for m in PUMP["metrics"]]}
    s2 = load_settings(**base, telemetry=more)
    write_deltalake(s.table_path("silver"), rows(7, 2, 4.0, motor_temperature=70.0), mode="append")
    run(s2)
    cur = DeltaTable(s.table_path("device_current")).to_pandas()
    assert cur.motor_temperature.tolist() == [70.0] and cur.status.tolist() == ["online"]
    scored = DeltaTable(s.table_path("readings_scored")).to_pandas()
    assert (scored.metric == "motor_temperature").sum() == 2


def test_pump_fleet_end_to_end(settings, spark) -> None:
    """A pump fleet configured in [telemetry] only, simulated from its model: MQTT -> bridge ->
    Kafka -> bronze -> silver -> gold -> the dashboard's API, every count to the row."""
    from fastapi.testclient import TestClient

    from dashboard.app import create_app
    from ingest.simulator import generate
    from orchestration.run import demo

    prefix = settings.mqtt.topic_filter.split("/")[0]  # this test's own topics on the shared broker
    model = {**PUMP, "topic_pattern": f"{prefix}/plant/{{site}}/{{device_id}}/telemetry",
             "status_rules": [{"metric": "pressure", "below": 0.5, "reason": "low_pressure"}]}
    s = load_settings(environ={}, **{**json.loads(settings.model_dump_json()), "telemetry": model,
                                     "mqtt": {**settings.mqtt.model_dump(), "topic_filter": ""},
                                     "simulator": {"device_prefix": "pump"}})
    s.mqtt.topic_filter = s.telemetry.topic_filter
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    result = demo(s, events=600, devices=6, duplicates=15, malformed=6, timeout=300, start=start)
    assert (result["published"], result["bronze_rows"]) == (600, 600)
    assert (result["silver_rows"], result["quarantine_rows"], result["duplicates_dropped"]) == (579, 6, 15)
    assert result["ok"] is True

    messages = generate(s, 600, devices=6, duplicates=15, malformed=6, start=start)
    valid = [m for m in messages if m.kind == "valid"]
    silver = DeltaTable(s.table_path("silver")).to_pandas()
    assert set(silver.event_id) == {m.event_id for m in valid}  # derived ids: device + payload
    assert set(silver.site) == {"site-0", "site-1", "site-2"}
    assert silver.device_id.str.fullmatch(r"pump-[0-9a-f]{4}").all() and silver.device_id.nunique() == 6
    assert silver.rpm.dtype == "int64" and silver.pressure.between(0, 40).all()
    scored = DeltaTable(s.table_path("readings_scored")).to_pandas()
    assert len(scored) == 579 * 4 and set(scored.metric) == {"pressure", "flow", "vibration", "rpm"}
    cur = DeltaTable(s.table_path("device_current")).to_pandas()
    assert len(cur) == 6 and cur.pressure.notna().all()

    api = TestClient(create_app(s), base_url="http://localhost")
    dev = cur.device_id.iloc[0]
    d = api.get(f"/api/device/{dev}", params={"hours": 1}).json()
    assert [m["name"] for m in d["metrics"]] == ["pressure", "flow", "vibration", "rpm"]
    assert d["metrics"][0]["unit"] == "bar"
    assert sum(len(d["points"][m]["v"]) for m in ("pressure", "flow", "vibration", "rpm")) == \
        4 * int((silver.device_id == dev).sum())
    assert api.get("/api/fleet").json()["total"] == 6
