"""Labelled faults injected into simulated readings, with their ground truth.

A fraction of the devices (chosen by the seed) get faults on one gold metric at a time, one per
slot of ``4 x length`` readings after a warm-up of ``warmup`` readings (the detectors learn
first): a **spike** (3 readings a quarter of the metric's range out), a **level shift** (an
offset of a tenth of the range for ``length`` readings), a **stuck** value (the fault's first
value repeated for ``length`` readings), a **drift** (a ramp to 15% of the range over
``2 x length`` readings) or a **dropout** (the metric missing from the payload for ``length``
readings). Values stay inside the metric's range, so silver keeps them. Kinds take turns per
device (its rank among the faulted, plus the slot), so every kind occurs once five devices are.

Each fault's truth is one JSON line (device, metric, kind, first and last event time, ISO-8601
UTC, and its parameters), appended to ``AnomalyPlan.path`` when its first reading is made. The
injector draws from random streams of its own, never the fleet's: the devices not chosen are
the normal generator, byte for byte, and a faulted device's walk goes on under its faults.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from lakehouse.telemetry import TelemetryModel

KINDS = ("spike", "level_shift", "stuck", "drift", "dropout")
SPIKE_READINGS = 3
#: magnitudes, as fractions of the metric's range (20 for a metric without both bounds)
SPIKE, SHIFT, DRIFT = 0.25, 0.10, 0.15
_UNBOUNDED_SPAN = 20.0


@dataclass(frozen=True)
class AnomalyPlan:
    """``fraction`` of the devices get faults, after ``warmup`` readings each, the sustained
    ones ``length`` readings long; truth lines go to ``path`` (None: kept in memory only)."""

    fraction: float
    warmup: int = 300
    length: int = 120
    path: Path | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"anomalies must be a fraction of the devices in [0, 1] (got {self.fraction:g})")
        if self.warmup < 0 or self.length < SPIKE_READINGS:
            raise ValueError(f"anomaly warm-up must be >= 0 and length >= {SPIKE_READINGS} readings "
                             f"(got {self.warmup}, {self.length})")


@dataclass
class Fault:
    """One fault of one device's metric, over its readings ``first`` .. ``last`` (inclusive)."""

    device: int
    metric: int
    kind: str
    first: int
    last: int
    params: dict = field(default_factory=dict)
    started: bool = False


class Injector:
    """Applies an ``AnomalyPlan`` to a fleet whose device ``d``'s ``k``-th reading has the event
    time ``start_us + k * interval_us`` (epoch microseconds)."""

    def __init__(self, plan: AnomalyPlan, model: TelemetryModel, ids: list[str], seed: int,
                 start_us: int, interval_us: int) -> None:
        self.plan, self.ids, self.seed = plan, ids, seed
        self.start_us, self.interval_us = start_us, interval_us
        self.metrics = [(i, m.name, m.min, m.max) for i, m in enumerate(model.metrics) if m.gold]
        self.by_index = {m[0]: m for m in self.metrics}
        if not self.metrics:
            raise ValueError("anomalies need a gold metric in the telemetry model")
        self.rank = {d: r for r, d in enumerate(faulted_devices(len(ids), plan.fraction, seed))}
        self.current: dict[int, Fault | None] = {}
        self.slot: dict[int, int] = {}
        self.truth: list[dict] = []
        if plan.path is not None:
            Path(plan.path).parent.mkdir(parents=True, exist_ok=True)

    def faulted(self, d: int) -> bool:
        return d in self.rank

    def value(self, d: int, k: int, i: int, v: float) -> float | None:
        """Metric ``i``'s value in device ``d``'s ``k``-th reading (``v`` without faults);
        None: missing from the payload."""
        f = self._fault(d, k)
        if f is None or f.metric != i or not f.first <= k <= f.last:
            return v
        if not f.started:
            self._begin(f, v)
        p, kind = f.params, f.kind
        if kind == "dropout":
            return None
        if kind == "stuck":
            return p["value"]
        if kind == "drift":
            v += p["offset"] * (k - f.first + 1) / (f.last - f.first + 1)
        else:
            v += p["offset"]
        _, _, lo, hi = self.by_index[i]
        return min(hi, v) if hi is not None and v > hi else max(lo, v) if lo is not None and v < lo else v

    def _fault(self, d: int, k: int) -> Fault | None:
        plan = self.plan
        if k < plan.warmup:
            return None
        j = (k - plan.warmup) // (4 * plan.length)
        if self.slot.get(d) != j:
            self.slot[d] = j
            rng = random.Random(f"{self.seed}/{self.ids[d]}/{j}")
            kind = KINDS[(self.rank[d] + j) % len(KINDS)]
            first = plan.warmup + j * 4 * plan.length + rng.randrange(plan.length)
            span = {"spike": SPIKE_READINGS, "drift": 2 * plan.length}.get(kind, plan.length)
            self.current[d] = Fault(d, rng.choice(self.metrics)[0], kind, first, first + span - 1)
        return self.current[d]

    def _begin(self, f: Fault, v: float) -> None:
        """Fix the fault's parameters from the value it starts on; record its truth."""
        f.started = True
        _, name, lo, hi = self.by_index[f.metric]
        span = hi - lo if lo is not None and hi is not None else _UNBOUNDED_SPAN
        up = (float("inf") if hi is None else hi - v) >= (float("inf") if lo is None else v - lo)
        sign = 1.0 if up else -1.0
        if f.kind == "stuck":
            f.params = {"value": v}
        elif f.kind in ("spike", "level_shift", "drift"):
            f.params = {"offset": sign * span * {"spike": SPIKE, "level_shift": SHIFT, "drift": DRIFT}[f.kind]}
        line = {"device_id": self.ids[f.device], "metric": name, "kind": f.kind,
                "start": self._iso(f.first), "end": self._iso(f.last),
                "first_reading": f.first, "last_reading": f.last, "params": f.params}
        self.truth.append(line)
        if self.plan.path is not None:
            with open(self.plan.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")

    def _iso(self, k: int) -> str:
        us = self.start_us + k * self.interval_us
        t = datetime.fromtimestamp(us // 1_000_000, UTC).replace(microsecond=us % 1_000_000)
        return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def faulted_devices(devices: int, fraction: float, seed: int) -> list[int]:
    """The indices of the devices that get faults (at least one when ``fraction`` > 0): the
    rest are healthy for the whole run, whether or not their faulted peers' faults began."""
    n = max(round(fraction * devices), 1) if fraction > 0 else 0
    return sorted(random.Random(f"{seed}/faulted").sample(range(devices), n))


def read_truth(path: Path | str) -> list[dict]:
    """The faults a run recorded (``AnomalyPlan.path``), in the order they began."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def default_path(root: Path) -> Path:
    """Where a run's truth goes unless told: ``<data_root>/simulator/faults.jsonl``."""
    return root / "simulator" / "faults.jsonl"
