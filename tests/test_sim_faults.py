"""Labelled faults in the simulator: deterministic, with ground truth, healthy devices untouched."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fleets import SENSOR, example

from ingest.simulator import device_id, generate
from ingest.simulator.faults import KINDS, SPIKE_READINGS, AnomalyPlan, faulted_devices, read_truth
from lakehouse.settings import load_settings
from orchestration.cli import main

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
DEVICES, RATE, PER_DEVICE = 10, 10.0, 180  # 1 s between a device's readings
WARMUP, LENGTH = 20, 10  # a fault slot is 40 readings: 4 slots after the warm-up


def _settings(tmp_path: Path, model=SENSOR):
    return load_settings(environ={}, telemetry=model.model_dump(mode="json"), data_root=str(tmp_path / "lake"))


def _run(settings, path: Path | None, seed: int = 3, fraction: float = 0.5):
    plan = AnomalyPlan(fraction, WARMUP, LENGTH, path) if path is not None else None
    return generate(settings, DEVICES * PER_DEVICE, devices=DEVICES, seed=seed, start=START,
                    rate=RATE, anomalies=plan)


def _by_device(msgs, id_path=("device_id",)) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for m in msgs:
        rec = json.loads(m.payload)
        dev = rec
        for p in id_path:
            dev = dev[p]
        out[dev].append(rec)
    return out


def test_faults_are_deterministic_labelled_and_leave_healthy_devices_alone(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    plain = _run(s, None)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    one, two = _run(s, a), _run(s, b)
    assert one == two and a.read_text() == b.read_text()  # same seed: same bytes, same truth
    other = tmp_path / "other.jsonl"
    _run(s, other, seed=4)
    assert read_truth(other) != read_truth(a)

    truth = read_truth(a)
    faulted = {device_id(d) for d in faulted_devices(DEVICES, 0.5, 3)}
    assert len(faulted) == 5 and {t["device_id"] for t in truth} == faulted
    # every faulted device has one fault per slot begun (4 slots) and the kinds take turns
    assert Counter(t["device_id"] for t in truth) == dict.fromkeys(faulted, 4)
    assert Counter(t["kind"] for t in truth) == dict.fromkeys(KINDS, 4)
    assert {t["metric"] for t in truth} <= {m.name for m in SENSOR.metrics}

    # the healthy devices' messages are exactly those of a run without faults
    assert len(one) == len(plain)
    for m, p in zip(one, plain, strict=True):
        if json.loads(p.payload)["device_id"] not in faulted:
            assert m == p
    got, base = _by_device(one), _by_device(plain)
    for t in truth:
        first, last = t["first_reading"], t["last_reading"]
        assert first >= WARMUP
        ts = lambda k: (START + timedelta(seconds=k)).strftime("%Y-%m-%dT%H:%M:%S.000Z")  # noqa: E731
        assert (t["start"], t["end"]) == (ts(first), ts(last))
        rows, normal, metric = got[t["device_id"]], base[t["device_id"]], t["metric"]
        inside = range(first, last + 1)
        assert rows[first]["ts"] == t["start"] and rows[last]["ts"] == t["end"]
        # outside the fault and on the other metrics the device is the normal generator
        for k in (first - 1, last + 1):
            if k < len(rows) and not any(o is not t and o["device_id"] == t["device_id"]
                                         and o["first_reading"] <= k <= o["last_reading"] for o in truth):
                assert rows[k] == normal[k]
        for k in inside:
            assert {f: v for f, v in rows[k].items() if f != metric} == \
                   {f: v for f, v in normal[k].items() if f != metric}
            lo, hi = next((m.min, m.max) for m in SENSOR.metrics if m.name == metric)
            if metric in rows[k]:
                assert lo <= rows[k][metric] <= hi  # silver keeps every faulted reading
        values = [rows[k].get(metric) for k in inside]
        normals = [normal[k][metric] for k in inside]
        if t["kind"] == "spike":
            assert last - first + 1 == SPIKE_READINGS
            assert all(abs(v - n) >= 0.2 * (hi - lo) for v, n in zip(values, normals, strict=True))
        elif t["kind"] == "level_shift":
            assert last - first + 1 == LENGTH
            assert all(abs(v - n - t["params"]["offset"]) < 0.02 for v, n in zip(values, normals, strict=True))
        elif t["kind"] == "stuck":
            assert set(values) == {round(t["params"]["value"], 2)}
        elif t["kind"] == "drift":
            assert last - first + 1 == 2 * LENGTH
            gaps = [v - n for v, n in zip(values, normals, strict=True)]
            assert abs(gaps[-1] - t["params"]["offset"]) < 0.02 and abs(gaps[0]) < abs(gaps[-1]) / 5
        else:
            assert values == [None] * LENGTH  # dropout: the metric left out


def test_faults_on_any_model(tmp_path: Path) -> None:
    """A model the sensor's fast path does not write (the pump's: ids in the topic) gets the
    same faults, on its devices alone."""
    pump = example("pump")
    s = _settings(tmp_path, pump)
    plain = _run(s, None)
    path = tmp_path / "truth.jsonl"
    faulty = _run(s, path)
    truth = read_truth(path)
    faulted = {t["device_id"] for t in truth}
    assert len(faulted) == 5 and Counter(t["kind"] for t in truth) == dict.fromkeys(KINDS, 4)
    assert {t["metric"] for t in truth} <= set(pump.gold_metrics)
    changed = {i for i, (m, p) in enumerate(zip(faulty, plain, strict=True)) if m != p}
    assert changed and all(any(f"/{d}/" in faulty[i].topic for d in faulted) for i in changed)


def test_no_fraction_no_faults(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    path = tmp_path / "none.jsonl"
    assert _run(s, path, fraction=0.0) == _run(s, None)
    assert read_truth(path) == []


@pytest.mark.parametrize("command", [["simulate"], ["run", "--simulate", "10"]])
@pytest.mark.parametrize("bad", ["1.5", "-0.1", "lots"])
def test_a_fraction_outside_0_1_fails_fast(command: list[str], bad: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--data-root", str(tmp_path), *command, "--anomalies", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--anomalies" in err and "[0, 1]" in err


def test_anomalies_without_the_simulator_fail_fast(tmp_path: Path, capsys) -> None:
    assert main(["--data-root", str(tmp_path), "run", "--anomalies", "0.2"]) == 2
    assert "--simulate" in capsys.readouterr().err
    assert main(["--data-root", str(tmp_path), "simulate", "--anomalies", "0.2",
                 "--anomaly-length", "2"]) == 2
    assert "length" in capsys.readouterr().err
