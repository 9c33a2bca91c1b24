"""What each kind of ``[[alerts.rules]]`` entry fires on: the conditions true at a tick.

A condition names its rule and subject (a device, a site, a query); the engine
(``gold.alerts.engine``) turns conditions into alerts. Device and site kinds read
``device_current`` (gold judges status and liveness); pipeline kinds read the run's status
snapshot (``orchestration.status``); threshold and anomaly kinds follow readings as they
arrive (``Breaches``), in event time, so a breach held ``for_seconds`` fires however the
readings were split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakehouse.settings import AlertRuleSettings

DEVICE_KINDS = frozenset({"device_offline", "device_degraded"})
READING_KINDS = frozenset({"threshold", "anomaly"})
PIPELINE_KINDS = frozenset({"pipeline_stale", "pipeline_lag", "pipeline_disk", "bridge_stalled"})


@dataclass(frozen=True)
class Condition:
    rule: AlertRuleSettings
    subject: str
    labels: dict[str, str]  # the subject's labels: device_id, site, query, metric
    summary: str
    value: float | None = None
    device_id: str | None = None
    site: str | None = None
    since: float | None = None  # when it started holding, if known (event or wall time, s)

    @property
    def key(self) -> str:
        return f"{self.rule.name}|{self.subject}"


def _summary(rule: AlertRuleSettings, default: str) -> str:
    return rule.summary or default


def device_conditions(rules: list[AlertRuleSettings], devices: list[dict]) -> list[Condition]:
    """Offline and degraded devices, from ``device_current`` rows (``status_reason``: the
    comma-joined reasons of the status)."""
    out = []
    for r in rules:
        for d in devices:
            status, dev = d.get("status"), d["device_id"]
            reasons = [x for x in (d.get("status_reason") or "").split(",") if x]
            hit = (r.kind == "device_offline" and status == "offline") or (
                r.kind == "device_degraded" and status == "degraded" and (not r.reason or r.reason in reasons))
            if hit:
                site = d.get("site")
                why = ", ".join(reasons) or status
                out.append(Condition(r, dev, {"device_id": dev, **({"site": site} if site else {})},
                                     _summary(r, f"device {dev} is {status} ({why})"),
                                     device_id=dev, site=site))
    return out


def site_conditions(rules: list[AlertRuleSettings], heard: dict[str, float], now: float,
                    offline_after: float, frontier: float | None = None,
                    arrived: float | None = None, busy: bool = False) -> list[Condition]:
    """Sites none of whose devices was heard from for the rule's ``silent_seconds``;
    ``heard``: each site's latest reception (the pipeline's clock, epoch s).

    While batches keep arriving (the last at wall time ``arrived``, within the bound) or more
    are owed (``busy``: the Kafka-sourced query is in a batch or behind Kafka), a site is judged against
    ``frontier``, the latest reception any batch carried, not the wall clock: a pipeline whose
    batches take longer than the bound is late, not silent (that is ``pipeline_stale``'s to
    say). Once nothing has arrived for the bound and nothing is under way, the wall clock."""
    out = []
    for r in rules:
        if r.kind != "site_silent":
            continue
        bound = r.silent_seconds or offline_after
        flowing = frontier is not None and arrived is not None and (now - arrived < bound or busy)
        clock = frontier if flowing else now
        for site, last in heard.items():
            if clock - last > bound:
                out.append(Condition(r, site, {"site": site},
                                     _summary(r, f"no device of site {site} heard for {clock - last:.0f} s"),
                                     value=round(clock - last, 1), site=site))
    return out


def pipeline_conditions(rules: list[AlertRuleSettings], snap: dict) -> list[Condition]:
    """The pipeline's own health, from the run's status snapshot."""
    out = []
    queries = snap.get("queries") or {}
    for r in rules:
        if r.kind == "pipeline_stale":
            for name, q in queries.items():
                age = q.get("last_progress_age_s")
                waiting = (q.get("lag") or 0) > 0
                batch_age = q.get("last_batch_age_s")
                stale = (not q.get("active", False) or (age is not None and age > r.stale_seconds)
                         or (waiting and batch_age is not None and batch_age > r.stale_seconds))
                if stale:
                    why = q.get("error") or ("not running" if not q.get("active") else
                                             f"no progress for {max(age or 0, batch_age or 0):.0f} s")
                    out.append(Condition(r, name, {"query": name}, _summary(r, f"query {name}: {why}"),
                                         value=age))
        elif r.kind == "pipeline_lag":
            for name, q in queries.items():
                lag = q.get("lag")  # records behind Kafka (a Delta source's lag is in versions)
                if q.get("source", "kafka") == "kafka" and lag is not None and lag > r.max_lag:
                    out.append(Condition(r, name, {"query": name},
                                         _summary(r, f"query {name}: {lag} records behind Kafka"),
                                         value=float(lag)))
        elif r.kind == "pipeline_disk":
            disk = snap.get("disk") or {}
            if disk and not disk.get("ok", True):
                out.append(Condition(r, "disk", {"resource": "disk"},
                                     _summary(r, f"{disk.get('free_gb')} GB free under the data root "
                                                 f"(below {disk.get('min_free_gb')} GB)"),
                                     value=disk.get("free_gb")))
        elif r.kind == "bridge_stalled":
            bridge = snap.get("bridge") or {}
            if bridge and not (bridge.get("running", True) and bridge.get("delivering", True)):
                out.append(Condition(r, "bridge", {"component": "bridge"},
                                     _summary(r, "the MQTT -> Kafka bridge is not delivering"),
                                     value=bridge.get("last_delivery_age_s")))
    return out


@dataclass
class Breach:
    since: float  # event time (epoch s) of the first reading of the breach
    last: float  # of its latest reading
    value: float
    device_id: str
    metric: str
    site: str | None = None


class Breaches:
    """Threshold and anomaly rules over readings in event-time order, per (rule, device[,
    metric]): a breach starts with the first reading past the bound and ends with the first
    reading within it. A breach that held ``for_seconds`` and ended inside one batch is an
    ``episode``: it fires and resolves at the same tick."""

    def __init__(self, rules: list[AlertRuleSettings], site_column: str) -> None:
        self.threshold = [r for r in rules if r.kind == "threshold"]
        self.anomaly = [r for r in rules if r.kind == "anomaly"]
        self.site_column = site_column
        self.state: dict[str, Breach] = {}
        self.changed: set[str] = set()
        self.episodes: list[Condition] = []

    def readings(self, t: pa.Table, oldest: float) -> None:
        """Silver rows (``device_id``, ``event_time``, the metric columns, topic columns)."""
        for r in self.threshold:
            if r.metric not in t.column_names:
                continue
            values = t.column(r.metric).cast(pa.float64()).to_numpy(zero_copy_only=False)
            with np.errstate(invalid="ignore"):
                hit = np.zeros(len(values), dtype=bool)
                if r.above is not None:
                    hit |= values > r.above
                if r.below is not None:
                    hit |= values < r.below
            present = ~np.isnan(values)
            self._follow(r, t, values, hit, present, oldest, per_metric=None)

    def scores(self, t: pa.Table, oldest: float) -> None:
        """``readings_scored`` rows (``device_id``, ``event_time``, ``metric``, ``score``)."""
        for r in self.anomaly:
            rows = t.filter(pc.equal(t.column("metric"), r.metric)) if r.metric else t
            scores = rows.column("score").to_numpy(zero_copy_only=False).astype(float)
            present = ~np.isnan(scores)
            with np.errstate(invalid="ignore"):
                hit = scores >= r.above
            self._follow(r, rows, scores, hit, present, oldest, per_metric="metric")

    def _follow(self, r: AlertRuleSettings, t: pa.Table, values: np.ndarray, hit: np.ndarray,
                present: np.ndarray, oldest: float, per_metric: str | None) -> None:
        if not t.num_rows:
            return
        times = pc.cast(t.column("event_time"), pa.int64()).to_numpy(zero_copy_only=False) / 1e6
        keep = present & (times >= oldest)
        if not keep.any():
            return
        dev = t.column("device_id").to_numpy(zero_copy_only=False)
        metric = (t.column(per_metric).to_numpy(zero_copy_only=False) if per_metric
                  else np.full(len(dev), r.metric, dtype=object))
        site = (t.column(self.site_column).to_numpy(zero_copy_only=False)
                if self.site_column in t.column_names else np.full(len(dev), None, dtype=object))
        idx = np.flatnonzero(keep)
        subject = np.array([f"{d}|{m}" if per_metric else d for d, m in zip(dev[idx], metric[idx], strict=True)],
                           dtype=object)
        order = np.lexsort((times[idx], subject))
        idx, subject = idx[order], subject[order]
        starts = np.flatnonzero(np.r_[True, subject[1:] != subject[:-1]])
        ends = np.r_[starts[1:], len(idx)]
        for s, e in zip(starts, ends, strict=True):
            key = f"{r.name}|{subject[s]}"
            b = self.state.get(key)
            rows = idx[s:e]
            for i in rows:  # runs of a few readings per device and batch
                if hit[i]:
                    if b is None:
                        b = Breach(times[i], times[i], float(values[i]), dev[i], metric[i], site[i])
                    else:
                        b.last, b.value = times[i], float(values[i])
                elif b is not None:
                    if b.last - b.since >= r.for_seconds:
                        self.episodes.append(self._condition(r, subject[s], b))
                    b = None
            if b is None:
                if self.state.pop(key, None) is not None:
                    self.changed.add(key)
            else:
                self.state[key] = b
                self.changed.add(key)

    def _condition(self, r: AlertRuleSettings, subject: str, b: Breach) -> Condition:
        bound = (f"above {r.above:g}" if r.above is not None else "") + (
            " or " if r.above is not None and r.below is not None else "") + (
            f"below {r.below:g}" if r.below is not None else "")
        what = "anomaly score" if r.kind == "anomaly" else b.metric
        held = f" for {b.last - b.since:.0f} s" if r.for_seconds else ""
        labels = {"device_id": b.device_id, "metric": b.metric,
                  **({"site": b.site} if b.site else {})}
        return Condition(r, subject, labels,
                         r.summary or f"device {b.device_id}: {what} {b.value:g} ({'at or above' if r.kind == 'anomaly' else bound}"
                         f"{f' {r.above:g}' if r.kind == 'anomaly' else ''}){held}",
                         value=b.value, device_id=b.device_id, site=b.site, since=b.since)

    def active(self) -> list[Condition]:
        """The breaches that have held their rule's ``for_seconds``."""
        rules = {r.name: r for r in (*self.threshold, *self.anomaly)}
        out = []
        for key, b in self.state.items():
            name, subject = key.split("|", 1)
            r = rules.get(name)
            if r is not None and b.last - b.since >= r.for_seconds:
                out.append(self._condition(r, subject, b))
        return out

    def take_episodes(self) -> list[Condition]:
        out, self.episodes = self.episodes, []
        return out
