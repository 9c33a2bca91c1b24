"""The suite compiled to Spark: exact failure names per row, quality-log counts, load errors."""

from __future__ import annotations

import copy
import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from silver.expectations import (
    SuiteError,
    evaluate_set_level,
    failed_expectations,
    load_suite,
    quality_summary,
    row_level_summary,
)

#: A hand-written suite with every kind of rule the compiler supports (regex, sets, means, ...)
#: and the simulator's id formats; the example fleets' suites are generated from their models.
SENSOR_SUITE = Path(__file__).with_name("sensor_suite.json")
TS = datetime(2026, 11, 21, 22, 30, tzinfo=UTC)
SCHEMA = ("tag string, event_id string, device_id string, event_time timestamp, "
          "temperature double, humidity double, battery double, status string")


def eid(i: int) -> str:
    return f"{i:032x}"


# tag, event_id, device_id, event_time, temperature, humidity, battery, status, expected failures
CASES = [
    ("valid", eid(1), "dev-00001", TS, 21.5, 40.2, 87.0, "ok", []),
    ("valid_bounds", eid(2), "dev-00002", TS, -40.0, 0.0, 100.0, "warn", []),
    ("valid_upper", eid(3), "dev-99999", TS, 125.0, 100.0, 0.0, "error", []),
    ("valid_null_metrics", eid(4), "dev-00004", TS, None, None, None, None, []),
    ("duplicate_of_valid", eid(1), "dev-00001", TS, 22.5, 41.0, 86.0, "ok", []),
    ("hot", eid(5), "dev-00005", TS, 125.5, 40.0, 80.0, "ok", ["temperature_in_range"]),
    ("cold", eid(6), "dev-00006", TS, -40.5, 40.0, 80.0, "ok", ["temperature_in_range"]),
    ("humid", eid(7), "dev-00007", TS, 20.0, 100.1, 80.0, "ok", ["humidity_in_range"]),
    ("battery", eid(8), "dev-00008", TS, 20.0, 40.0, -0.1, "ok", ["battery_in_range"]),
    ("status_unknown", eid(9), "dev-00009", TS, 20.0, 40.0, 80.0, "broken", ["status_known"]),
    ("status_case", eid(10), "dev-00010", TS, 20.0, 40.0, 80.0, "OK", ["status_known"]),
    ("device_format", eid(11), "dev-1", TS, 20.0, 40.0, 80.0, "ok", ["device_id_format"]),
    ("event_upper_hex", eid(12).upper().replace("0", "A"), "dev-00012", TS, 20.0, 40.0, 80.0,
     "ok", ["event_id_format"]),
    ("event_short", eid(13)[1:], "dev-00013", TS, 20.0, 40.0, 80.0, "ok", ["event_id_format"]),
    ("null_event_id", None, "dev-00014", TS, 20.0, 40.0, 80.0, "ok", ["event_id_not_null"]),
    ("null_device", eid(15), None, TS, 20.0, 40.0, 80.0, "ok", ["device_id_not_null"]),
    ("null_time", eid(16), "dev-00016", None, 20.0, 40.0, 80.0, "ok", ["event_time_not_null"]),
    ("many", eid(17), "DEV-00017", TS, -41.0, -1.0, 80.0, "bad",
     ["device_id_format", "temperature_in_range", "humidity_in_range", "status_known"]),
]


@pytest.fixture(scope="module")
def suite():
    return load_suite(SENSOR_SUITE)


@pytest.fixture(scope="module")
def df(spark):
    return spark.createDataFrame([c[:-1] for c in CASES], SCHEMA)


def failures_by_tag(df, suite) -> dict[str, list[str]]:
    rows = df.select("tag", failed_expectations(suite).alias("f")).collect()
    return {r["tag"]: r["f"] for r in rows}


def test_sensor_suite_is_gx_file_with_named_expectations(suite):
    raw = json.loads(SENSOR_SUITE.read_text())
    assert raw["name"] == suite.name == "telemetry"
    assert all(e["id"] and e["meta"]["name"] for e in raw["expectations"])
    assert [c.name for c in suite.row_level] == [
        "event_id_not_null", "device_id_not_null", "event_time_not_null", "event_id_format",
        "device_id_format", "temperature_in_range", "humidity_in_range", "battery_in_range",
        "status_known"]
    assert [c.name for c in suite.set_level] == [
        "event_id_unique", "row_count", "temperature_mean_in_range"]


def test_failed_expectations_names_every_defect(df, suite):
    assert failures_by_tag(df, suite) == {c[0]: c[-1] for c in CASES}


def test_nan_fails_range_like_gx_on_spark(spark, suite):
    nan = spark.createDataFrame([("nan", eid(1), "dev-00001", TS, math.nan, 1.0, 1.0, "ok")],
                                SCHEMA)
    assert failures_by_tag(nan, suite) == {"nan": ["temperature_in_range"]}
    mean = {r["expectation"]: r for r in evaluate_set_level(suite, nan)}
    assert mean["temperature_mean_in_range"]["success"] is False


def test_set_level_results(df, suite):
    temps = [c[4] for c in CASES if c[4] is not None]
    got = evaluate_set_level(suite, df)
    details = [json.loads(r.pop("details")) for r in got]
    n_ids = sum(c[1] is not None for c in CASES)
    assert got == [
        {"expectation": "event_id_unique", "column": "event_id", "kind": "set",
         "evaluated": n_ids, "passed": n_ids - 2, "failed": 2, "success": False},
        {"expectation": "row_count", "column": None, "kind": "set", "evaluated": len(CASES),
         "passed": None, "failed": None, "success": True},
        {"expectation": "temperature_mean_in_range", "column": "temperature", "kind": "set",
         "evaluated": len(temps), "passed": None, "failed": None, "success": True},
    ]
    assert details[0] == {"type": "expect_column_values_to_be_unique", "mostly": 1.0}
    assert details[1] == {"type": "expect_table_row_count_to_be_between",
                          "observed_value": len(CASES), "min_value": 0}
    assert details[2]["observed_value"] == pytest.approx(sum(temps) / len(temps))
    assert (details[2]["min_value"], details[2]["max_value"]) == (-40, 125)


def test_set_level_on_empty_batch_succeeds(df, suite):
    got = {r["expectation"]: (r["evaluated"], r["success"])
           for r in evaluate_set_level(suite, df.limit(0))}
    assert got == {"event_id_unique": (0, True), "row_count": (0, True),
                   "temperature_mean_in_range": (0, True)}


def test_row_level_summary_counts(df, suite):
    flagged = df.withColumn("failed_expectations", failed_expectations(suite))
    got = {r["expectation"]: (r["evaluated"], r["passed"], r["failed"], r["success"])
           for r in row_level_summary(flagged, suite)}
    n = len(CASES)
    assert got == {
        "event_id_not_null": (n, n - 1, 1, False),
        "device_id_not_null": (n, n - 1, 1, False),
        "event_time_not_null": (n, n - 1, 1, False),
        "event_id_format": (n - 1, n - 3, 2, False),
        "device_id_format": (n - 1, n - 3, 2, False),
        "temperature_in_range": (n - 1, n - 4, 3, False),
        "humidity_in_range": (n - 1, n - 3, 2, False),
        "battery_in_range": (n - 1, n - 2, 1, False),
        "status_known": (n - 1, n - 4, 3, False),
    }
    both = quality_summary(flagged, suite)
    assert both == row_level_summary(flagged, suite) + evaluate_set_level(suite, df)


def _write(tmp_path: Path, raw: dict, name: str = "suite.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(raw))
    return p


def test_editing_the_suite_changes_failures(df, suite, tmp_path):
    raw = copy.deepcopy(dict(suite.raw))
    for e in raw["expectations"]:
        if e["meta"]["name"] == "temperature_in_range":
            e["kwargs"].update(min_value=-10, max_value=30)
    tight = load_suite(_write(tmp_path, raw))
    expected = {c[0]: c[-1] for c in CASES}
    for tag in ("valid_bounds", "valid_upper"):
        expected[tag] = ["temperature_in_range"]
    assert failures_by_tag(df, tight) == expected


def test_other_row_level_types(spark, tmp_path):
    def exp(etype: str, name: str, **kwargs) -> dict:
        return {"type": etype, "kwargs": kwargs, "meta": {"name": name}}

    raw = {"name": "more", "expectations": [
        exp("expect_column_values_to_be_of_type", "temp_double", column="temperature",
            type_="DoubleType"),
        exp("expect_column_values_to_be_of_type", "status_int", column="status", type_="int"),
        exp("expect_column_values_to_not_be_in_set", "status_not_error", column="status",
            value_set=["error"]),
        exp("expect_column_values_to_not_match_regex", "device_not_test", column="device_id",
            regex="^dev-9"),
        exp("expect_column_value_lengths_to_be_between", "device_len", column="device_id",
            min_value=9, max_value=9),
        exp("expect_column_values_to_be_between", "battery_open", column="battery",
            min_value=0, max_value=100, strict_min=True, strict_max=True, mostly=0.5),
    ]}
    s = load_suite(_write(tmp_path, raw))
    data = spark.createDataFrame([
        ("a", eid(1), "dev-00001", TS, 1.0, 1.0, 50.0, None),
        ("b", eid(2), "dev-90001", TS, 1.0, 1.0, 0.0, "error"),
        ("c", eid(3), "dev-0001", TS, 1.0, 1.0, 100.0, "ok"),
        ("d", eid(4), None, TS, None, None, None, None),
    ], SCHEMA)
    assert failures_by_tag(data, s) == {
        "a": [],
        "b": ["status_int", "status_not_error", "device_not_test", "battery_open"],
        "c": ["status_int", "device_len", "battery_open"],
        "d": [],
    }
    flagged = data.withColumn("failed_expectations", failed_expectations(s))
    battery = [r for r in row_level_summary(flagged, s) if r["expectation"] == "battery_open"]
    assert (battery[0]["evaluated"], battery[0]["failed"], battery[0]["success"]) == (3, 2, False)


@pytest.mark.parametrize(("edit", "message"), [
    ({"type": "expect_column_values_to_be_betwen"}, "expect_column_values_to_be_betwen not found"),
    ({"type": "expect_column_values_to_be_increasing", "kwargs": {"column": "temperature"}},
     "not supported by the Spark compiler"),
    ({"kwargs": {"colum": "temperature", "min_value": 0}}, "field required"),
    ({"kwargs": {"column": "temperature", "min_value": "cold"}}, "not a valid float"),
    ({"meta": {"name": "device_id_format"}}, "two expectations are named 'device_id_format'"),
    ({"meta": {"name": "a,b"}}, "must be letters, digits"),
])
def test_bad_suite_fails_fast_naming_file_and_expectation(suite, tmp_path, edit, message):
    raw = copy.deepcopy(dict(suite.raw))
    target = next(e for e in raw["expectations"] if e["meta"]["name"] == "temperature_in_range")
    target.update(edit)
    path = _write(tmp_path, raw)
    with pytest.raises(SuiteError, match=message) as err:
        load_suite(path)
    assert str(path) in str(err.value)
    if "two expectations" not in message:
        assert "expectation #5" in str(err.value)


def test_unreadable_suite(tmp_path):
    with pytest.raises(SuiteError, match="cannot read"):
        load_suite(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SuiteError, match="invalid JSON"):
        load_suite(broken)


def test_failures_column_is_plain_catalyst(df, suite):
    """One projection, no Python UDF: the failures column is a plain Catalyst expression."""
    plan = df.select(failed_expectations(suite))._jdf.queryExecution().executedPlan().toString()
    assert "BatchEvalPython" not in plan and "ArrowEvalPython" not in plan
    assert df.select(F.size(failed_expectations(suite))).count() == len(CASES)


def test_gx_checks_each_suite_content_once(tmp_path):
    """GX's verdict on a suite's bytes is kept, so later processes skip importing GX (seconds of
    CPU each); a changed byte is checked by GX again, and a rejected suite is never kept."""
    import subprocess
    import sys

    good = tmp_path / "good.json"
    good.write_bytes(SENSOR_SUITE.read_bytes())
    raw = json.loads(good.read_text())
    target = next(e for e in raw["expectations"] if e["meta"]["name"] == "temperature_in_range")
    target["kwargs"]["min_value"] = "cold"  # GX rejects it (the compiler's own checks do not)
    bad = _write(tmp_path, raw)
    probe = ("import json, sys\nfrom silver.expectations import load_suite, SuiteError\n"
             "try:\n    s = load_suite(sys.argv[1]); out = [s.name, len(s.checks)]\n"
             "except SuiteError as e:\n    out = ['error', str(e)[:300]]\n"
             "print(json.dumps(out + ['great_expectations' in sys.modules]))\n")
    script = tmp_path / "probe.py"
    script.write_text(probe)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def load(path: Path) -> list:
        p = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True,
                           text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    n = len(raw["expectations"])
    assert load(good) == ["telemetry", n, True]  # first sight: GX checks it
    assert load(good) == ["telemetry", n, False]  # the same bytes: no GX
    for _ in range(2):  # rejected each time, by GX each time
        name, message, gx_loaded = load(bad)
        assert (name, gx_loaded) == ("error", True) and "not a valid GX expectation" in message
    assert len(list((tmp_path / "cache" / "iotlake" / "gx-checked").iterdir())) == 1
