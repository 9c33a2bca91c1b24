"""The telemetry model: what a fleet's payloads hold and where, from configuration.

A fleet is described in the ``[telemetry]`` section of the settings, not in code: the metrics
(name, type, unit, valid range, whether gold windows and scores them), where each field sits in
the JSON payload (dotted paths into nested objects), the event time's field and format, and
where the device id comes from (a payload field, a named part of the MQTT topic, or both, in
which case they must agree). Silver parses by it, its table has one typed column per declared
metric, and the default expectation suite is generated from it (``iotlake expectations``).

There are no default metrics: iotlake knows nothing of a fleet it was not told about, and a
pipeline started without any fails at once naming the key (``require_metrics``). The example
fleets in ``examples/`` (the simulator's sensor and an industrial pump) are complete models.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Silver's own columns (not payload metrics): a metric may not take one of these names.
RESERVED_COLUMNS = frozenset({
    "event_id", "device_id", "event_time", "status", "schema_version", "extra",
    "kafka_topic", "kafka_partition", "kafka_offset", "ingest_time", "value", "reason",
    "reasons", "parse_reasons", "dedup_time", "quarantined_at", "metric", "window_start",
    "window_end", "count", "mean", "min", "max", "stddev", "last", "score", "baseline",
    "is_anomaly", "anomaly_score", "status_since", "last_seen", "updated_at", "last_received",
    "status_reason", "kind", "previous_status", "labels", "registered", "revoked_at"})
_NAME = r"^[a-z][a-z0-9_]{0,62}$"
_SEGMENT = re.compile(r"^[^.\[\]'\"]+$")
_PART = re.compile(r"\{([^{}]*)\}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_path(path: str) -> str:
    if path and not all(_SEGMENT.match(s) for s in path.split(".")):
        raise ValueError(f"{path!r}: a path is field names joined by '.', e.g. readings.pressure_bar "
                         "(no brackets or quotes)")
    return path


class Metric(_Model):
    """One numeric reading a device sends."""

    name: str = Field(pattern=_NAME)  # silver's column name
    path: str = ""  # where it is in the payload (dotted for nested objects); "" = the name
    type: Literal["double", "long"] = "double"
    unit: str = ""
    min: float | None = None  # valid range (inclusive), checked by the generated suite
    max: float | None = None
    gold: bool = True  # gold windows and anomaly-scores it

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_path(v)

    @model_validator(mode="after")
    def _range(self) -> Metric:
        if self.name in RESERVED_COLUMNS:
            raise ValueError(f"metric name {self.name!r} is one of silver's own columns; rename it "
                             "and set path = the payload field")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"metric {self.name!r}: min {self.min} > max {self.max}")
        return self

    @property
    def source(self) -> str:
        return self.path or self.name


class StatusRule(_Model):
    """A reading whose metric is below / above a bound makes the device ``degraded`` (gold)."""

    metric: str
    below: float | None = None
    above: float | None = None
    reason: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$")  # shown in the status history

    @model_validator(mode="after")
    def _bound(self) -> StatusRule:
        if self.below is None and self.above is None:
            raise ValueError(f"status rule {self.reason!r}: set below or above (or both)")
        if self.reason in ("error", "anomaly", "data", "no_data"):
            raise ValueError(f"status rule reason {self.reason!r} is one of gold's own reasons")
        return self


class TelemetryModel(_Model):
    """Where things are in a fleet's payloads and topics (``[telemetry]``)."""

    # MQTT topic of a device's readings; ``{name}`` marks a whole topic level. ``{device_id}``
    # names the device; other named parts (``plant/{site}/{device_id}/telemetry``) become
    # string columns of silver. Read from the bridge's ``mqtt_topic`` Kafka header.
    topic_pattern: str = "devices/{device_id}/telemetry"
    device_id_path: str = "device_id"  # "" = the topic alone names the device
    # Topic and payload name different devices: quarantine the reading (reason
    # ``device_mismatch``) or take the topic's (a broker ACL then decides who writes as whom).
    on_device_mismatch: Literal["quarantine", "trust_topic"] = "quarantine"
    # A reading from a device not in the registry (the ``devices`` table, `iotlake devices add`)
    # is quarantined with reason ``unknown_device``.
    require_registered: bool = False
    # "" = the payload carries no id: silver derives one from the device and the raw payload,
    # so a redelivered message is still a duplicate.
    event_id_path: str = "event_id"
    event_time_path: str = "ts"
    # auto: ISO-8601, or epoch seconds / milliseconds / microseconds told apart by magnitude
    event_time_format: Literal["auto", "iso8601", "epoch_s", "epoch_ms", "epoch_us"] = "auto"
    status_path: str = "status"  # a status string the device reports itself; "" = none
    schema_version_path: str = "schema_version"
    device_id_max_length: int = Field(128, ge=1, le=1024)
    # The Great Expectations suite silver validates with (``iotlake expectations --out F``
    # writes a starting one for this model); "" = the suite generated from this model.
    suite: str = ""
    # The readings; none declared = nothing to run (``require_metrics``).
    metrics: list[Metric] = Field(default_factory=list)
    # Rules on gold metrics that make a device ``degraded``; a device reporting
    # ``error_status`` (in the status field) is degraded too ("" = never).
    status_rules: list[StatusRule] = Field(default_factory=list)
    error_status: str = "error"
    # Also take Sparkplug B messages (``spBv1.0/{group}/{type}/{edge_node}[/{device}]``):
    # a metric's ``path`` is then its Sparkplug metric name, the device id is
    # ``group/edge_node/device`` (``group/edge_node`` for a node's own metrics). docs/sparkplug.md
    sparkplug: bool = False
    sparkplug_groups: list[str] = Field(default_factory=lambda: ["+"])  # group ids, or + for all

    @field_validator("device_id_path", "event_id_path", "event_time_path", "status_path",
                     "schema_version_path")
    @classmethod
    def _paths(cls, v: str) -> str:
        return _check_path(v)

    @field_validator("sparkplug_groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        bad = [g for g in v if g != "+" and (not g or any(c in g for c in "/+#"))]
        if bad or not v:
            raise ValueError(f"sparkplug_groups: Sparkplug group ids, or \"+\" for every group (got {v})")
        return v

    @field_validator("topic_pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        names = topic_parts(v)
        for level in v.split("/"):
            if "{" in level and not _PART.fullmatch(level):
                raise ValueError(f"{v!r}: a named part must be a whole topic level, e.g. "
                                 "devices/{device_id}/telemetry")
            if level in ("+", "#"):
                raise ValueError(f"{v!r}: use named parts ({{device_id}}, {{site}}) instead of "
                                 "MQTT wildcards")
        bad = [n for n in names if not re.match(_NAME, n) or (n in RESERVED_COLUMNS and n != "device_id")]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"{v!r}: named parts must be distinct lower-case identifiers and not "
                             f"one of silver's columns (got {names})")
        return v

    @model_validator(mode="after")
    def _identity(self) -> TelemetryModel:
        if not self.device_id_path and "device_id" not in topic_parts(self.topic_pattern):
            raise ValueError("no device id: set device_id_path (a payload field) or put "
                             "{device_id} in topic_pattern")
        if not self.event_time_path:
            raise ValueError("event_time_path is required (the payload field with the event time)")
        names = [m.name for m in self.metrics]
        clash = sorted({n for n in names if names.count(n) > 1}
                       | (set(names) & set(topic_parts(self.topic_pattern))))
        if clash:
            raise ValueError(f"metric names must be unique and differ from topic parts: {clash}")
        for r in self.status_rules:
            if r.metric not in self.gold_metrics:
                raise ValueError(f"status rule {r.reason!r}: metric {r.metric!r} is not a declared "
                                 "metric with gold = true")
        if len({r.reason for r in self.status_rules}) != len(self.status_rules):
            raise ValueError("status rules need distinct reasons")
        return self

    def require_metrics(self) -> TelemetryModel:
        """This model, if it declares a metric: a pipeline without any fails here, before it
        starts anything, with what to do."""
        if not self.metrics:
            raise ValueError(
                "no metrics declared: describe your devices' readings in the settings file's "
                "[telemetry] section (metrics = [{name = ..., path = ...}], README \"Connect your "
                "devices\"), or run an example fleet: iotlake --config examples/sensor.toml ...")
        return self

    # ---- derived -------------------------------------------------------------------------
    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metrics)

    @property
    def gold_metrics(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metrics if m.gold)

    @property
    def topic_columns(self) -> tuple[str, ...]:
        """Named topic parts other than the device id (silver string columns)."""
        return tuple(n for n in topic_parts(self.topic_pattern) if n != "device_id")

    @property
    def topic_filter(self) -> str:
        """The MQTT subscription the pattern implies (named parts become ``+``)."""
        return "/".join("+" if _PART.fullmatch(level) else level
                        for level in self.topic_pattern.split("/"))

    @property
    def device_level(self) -> int | None:
        """Topic level (0-based) that names the device, if the pattern has one."""
        levels = self.topic_pattern.split("/")
        return levels.index("{device_id}") if "{device_id}" in levels else None

    @property
    def sparkplug_filters(self) -> tuple[str, ...]:
        """MQTT subscriptions for the Sparkplug groups (none when Sparkplug is off)."""
        if not self.sparkplug:
            return ()
        # births, data and deaths only: commands (NCMD / DCMD) and host STATE are not readings
        return tuple(f"spBv1.0/{g}/{t}" for g in self.sparkplug_groups
                     for t in ("NBIRTH/+", "NDATA/+", "NDEATH/+", "DBIRTH/+/+", "DDATA/+/+", "DDEATH/+/+"))

    def payload_fields(self) -> set[str]:
        """Top-level payload fields the model reads (the rest of a payload goes to ``extra``)."""
        paths = [self.device_id_path, self.event_id_path, self.event_time_path, self.status_path,
                 self.schema_version_path, *(m.source for m in self.metrics)]
        return {p.split(".")[0] for p in paths if p}


def topic_parts(pattern: str) -> list[str]:
    return _PART.findall(pattern)
