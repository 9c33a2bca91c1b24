"""One typed settings object for the whole platform.

Read from a TOML file (``iotlake.toml`` in the working directory, or ``IOTLAKE_CONFIG``), then
overridden by environment variables ``IOTLAKE_<SECTION>__<KEY>`` (or ``IOTLAKE_<KEY>`` for
top-level keys), then by keyword arguments: pydantic-settings sources (``load_settings``).
Unknown keys and bad values fail fast with a message naming the key, so a typo never silently
falls back to a default. Where the lake's files live is ``lakehouse.layout``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from lakehouse.layout import DERIVED_QUERIES as DERIVED_QUERIES
from lakehouse.layout import DERIVED_TABLES as DERIVED_TABLES
from lakehouse.layout import Layout
from lakehouse.storage import is_uri
from lakehouse.telemetry import TelemetryModel

#: Below this, vacuum or log clean-up can remove what a query, a dashboard refresh or a backfill
#: is reading (a lagging stream is protected whatever the retention: maintenance.clean_log).
MIN_RETENTION_HOURS = 1

ENV_PREFIX = "IOTLAKE_"
#: IOTLAKE_* variables that are not settings (the test suite's ports use IOTLAKE_TEST_*).
_NOT_SETTINGS = {"IOTLAKE_CONFIG", "IOTLAKE_DASHBOARD_TOKEN", "IOTLAKE_BIN", "IOTLAKE_EXTENDED_TESTS",
                 "IOTLAKE_JARS_DIR"}
DEFAULT_FILE = "iotlake.toml"


class SettingsError(ValueError):
    """Configuration is invalid; the message says which key and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class KafkaSettings(_Section):
    """Kafka cluster. An empty ``bootstrap`` means: start the embedded Apache Kafka (one KRaft
    node, log under ``<data_root>/run/kafka-<embedded_port>``; orchestration.services)."""

    bootstrap: str = ""
    embedded_port: int = Field(19092, ge=1, le=65535)
    # The embedded node's KRaft controller listener; 0 = embedded_port + 1.
    embedded_controller_port: int = Field(0, ge=0, le=65535)
    # Retention of the embedded broker, per partition: records older than this many hours, or
    # beyond this many bytes (-1: no size limit), are deleted a closed segment at a time.
    # Bronze must read them before: data it had not read fails it (stream.kafka_fail_on_data_loss).
    embedded_retention_hours: int = Field(168, ge=1)
    embedded_retention_bytes: int = Field(1 << 30, ge=-1)
    # Segment size: retention deletes whole closed segments, so this is its granularity.
    embedded_segment_bytes: int = Field(64 << 20, ge=1 << 20)
    # JVM heap of the embedded broker (its RSS is roughly heap in use + ~100 MB).
    embedded_heap_mb: int = Field(256, ge=64)
    topic: str = "telemetry"
    dead_letter_topic: str = "telemetry-dlq"
    partitions: int = Field(4, ge=1, le=1024)
    # Extra librdkafka properties (e.g. security.protocol, sasl.*), passed through verbatim.
    # Not in repr: it may hold sasl.password / ssl.key.password.
    client_config: dict[str, str] = Field(default_factory=dict, repr=False)
    # Who may use the embedded broker: "plaintext" (anyone on this machine) or "sasl_scram"
    # (SCRAM-SHA-512 with the data root's generated credential, which every iotlake client
    # uses; lakehouse.kafka.auth). Set it before the broker's first start. After client_config:
    # its check reads that, and an error on this key shows only this key's value.
    embedded_security: Literal["plaintext", "sasl_scram"] = "plaintext"

    @field_validator("embedded_retention_bytes")
    @classmethod
    def _retention_bytes(cls, v: int) -> int:
        if v != -1 and v < 1 << 20:
            raise ValueError("must be -1 (no size limit) or at least 1048576 (1 MiB)")
        return v

    @field_validator("embedded_security")
    @classmethod
    def _scram_is_embedded(cls, v: str, info: ValidationInfo) -> str:
        if v == "plaintext":
            return v
        bootstrap, port = info.data.get("bootstrap", ""), info.data.get("embedded_port")
        if bootstrap and bootstrap not in {f"{h}:{port}" for h in ("127.0.0.1", "localhost")}:
            raise ValueError(
                "kafka.embedded_security secures the embedded broker only; with kafka.bootstrap "
                "set to another cluster, set its security.protocol / sasl.* / ssl.* in "
                "kafka.client_config and leave embedded_security = \"plaintext\"")
        clash = sorted(k for k in info.data.get("client_config", {})
                       if k == "security.protocol" or k.startswith("sasl."))
        if clash:
            raise ValueError(
                f"kafka.embedded_security = \"sasl_scram\" logs iotlake's clients in with the data "
                f"root's generated credential: remove {', '.join(clash)} from kafka.client_config")
        return v


class MqttSettings(_Section):
    """MQTT broker. An empty ``host`` means: start the embedded Mosquitto."""

    host: str = ""
    port: int = Field(0, ge=0, le=65535)
    embedded_port: int = Field(11883, ge=1, le=65535)
    # The embedded broker's listen address: loopback by default; "0.0.0.0" (or an interface's
    # address) lets real devices reach it, which needs authentication on (allow_anonymous false).
    embedded_bind: str = "127.0.0.1"
    # >0: the embedded broker's listener for devices, at embedded_bind, each device's client id
    # forced to its user name (so no device can take over the bridge's session); embedded_port
    # then serves iotlake's own clients on 127.0.0.1 only. 0: devices use embedded_port too.
    # Required when embedded_bind is beyond loopback.
    embedded_device_port: int = Field(0, ge=0, le=65535)
    # The embedded broker lets clients in without a user name (warned at start): only with this
    # true. Off, each device has its own credential (`iotlake devices add`) and may publish only
    # as itself (lakehouse.mqtt.auth).
    allow_anonymous: bool = False
    topic_filter: str = "devices/+/telemetry"
    qos: int = Field(1, ge=0, le=2)
    client_id: str = "iotlake-bridge"
    # What iotlake's own clients (bridge, simulator, alerts) log in with. Unset, on the embedded
    # broker each logs in with a credential iotlake generated for its role (least privilege:
    # lakehouse.mqtt.auth); set, the embedded broker lets this user read and write everything.
    username: str = ""
    password: str = Field("", repr=False)
    # The CA iotlake's clients trust and, for the broker's own certificate files below, the CA
    # that signed the devices' client certificates. Unset with the embedded broker's TLS on:
    # iotlake's own CA (lakehouse.mqtt.tls).
    tls_ca: str = ""
    # A client certificate and key for iotlake's own clients (a broker that asks for one).
    tls_cert: str = ""
    tls_key: str = ""
    # The embedded broker speaks TLS only: every listener, plaintext off (iotlake's clients
    # speak TLS to it, and to an external broker: system CAs unless tls_ca). Its certificate is
    # iotlake's (signed by a CA it makes under <data_root>/mqtt/tls) unless tls_server_cert and
    # tls_server_key name your own (then tls_ca is required).
    tls: bool = False
    tls_server_cert: str = ""
    tls_server_key: str = ""
    # Names and addresses devices reach the embedded broker by, beyond 127.0.0.1, localhost,
    # this host's name and embedded_bind: in iotlake's server certificate.
    tls_server_names: list[str] = Field(default_factory=list)
    # >0 (needs tls): a listener at embedded_bind for devices that log in with a client
    # certificate (`iotlake devices add --cert`): its common name is the user name, checked
    # against iotlake's revocation list.
    embedded_cert_port: int = Field(0, ge=0, le=65535)
    # Bridge protocol: "5" (broker-side flow control via Receive Maximum, shared subscriptions)
    # or "3.1.1" (persistent session via clean_session=False; less per-message parsing).
    protocol: str = Field("5", pattern=r"^(5|3\.1\.1)$")

    @field_validator("embedded_bind")
    @classmethod
    def _bind_address(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError("must be an IP address: 127.0.0.1 (this machine only), 0.0.0.0 (every "
                             "interface) or one interface's address") from None
        return v

    @property
    def embedded_open(self) -> bool:
        """The embedded broker listens to devices beyond loopback."""
        return not ipaddress.ip_address(self.embedded_bind).is_loopback


class BridgeSettings(_Section):
    max_inflight: int = Field(10_000, ge=1)
    max_payload_bytes: int = Field(256 * 1024, ge=1)
    # MQTT topic pattern -> Kafka topic; empty means everything goes to kafka.topic.
    topic_map: dict[str, str] = Field(default_factory=dict)
    metrics_port: int = Field(0, ge=0, le=65535)
    # >1: MQTT v5 shared subscription ``$share/<share_group>/<filter>``, one client id each.
    instances: int = Field(1, ge=1, le=64)
    share_group: str = Field("iotlake", pattern=r"^[^/+#]+$")
    # How long the broker keeps the session (and queues QoS-1 messages) while the bridge is down.
    session_expiry_seconds: int = Field(86_400, ge=0)
    keepalive_seconds: int = Field(30, ge=5, le=3600)
    log_interval_seconds: float = Field(30.0, ge=0)
    shutdown_timeout_seconds: float = Field(10.0, ge=0)
    # At start, wait this long for Kafka to accept records before taking MQTT messages (a
    # restarted bridge is handed the broker's whole queue at once); then subscribe anyway.
    kafka_ready_timeout_seconds: float = Field(5.0, ge=0)
    # Kafka confirms records per read round and partition (one delivery report for a round's
    # records of a partition, under librdkafka's gapless guarantee); true: a report per record,
    # which the bridge also switches to by itself after an unexpected Kafka error.
    per_message_delivery_reports: bool = False
    # With telemetry.sparkplug: ask an edge node to publish its births again (NCMD
    # "Node Control/Rebirth", as a Sparkplug host application does) when it sends data before
    # any birth this bridge has seen, at most once per node per interval. Needs the broker to let
    # the bridge publish to spBv1.0/<group>/NCMD/<node>.
    sparkplug_rebirth: bool = True
    sparkplug_rebirth_interval_seconds: float = Field(30.0, gt=0)
    # Kafka reachable but confirming nothing for this long (e.g. a broker that came back empty
    # and no longer knows the producer's id): start over with a new producer and re-read
    # everything unacknowledged from MQTT.
    delivery_stall_seconds: float = Field(30.0, gt=0)
    # librdkafka's linger.ms: how long the producer waits to fill a batch.
    linger_ms: int = Field(5, ge=0)
    compression: str = Field("lz4", pattern=r"^(none|lz4|zstd|snappy|gzip)$")


#: Spark's memory sizes (``2g``, ``768m``, ``1gb``)
_MEMORY_SIZE = re.compile(r"^([0-9]+)([kmgtKMGT])[bB]?$")


class SparkSettings(_Section):
    master: str = "local[*]"
    # state partitions of the stateful queries, fixed in a checkpoint at its first start;
    # 0 = auto: the cores of a local master (at least 2; each partition costs every stateful
    # batch a task and a RocksDB commit), 4 on a cluster
    shuffle_partitions: int = Field(0, ge=0)
    driver_memory: str = "2g"
    # the driver JVM's heap fixed at ``driver_memory`` and touched when it starts (-Xms = -Xmx,
    # -XX:+AlwaysPreTouch): the process holds its full size from the start (0.7 s to touch 2 GB)
    # instead of G1 committing more at load peaks. Off: in hour-long soaks the JVM grew as much
    # with it as without.
    fixed_heap: bool = False
    ui_enabled: bool = False
    # local mode: Hadoop's local file system without its chmod/readlink forks (lakehouse/runtime/jvm)
    local_fs_shim: bool = True
    # Spark's FAIR scheduler with a pool per layer: bronze and silver tasks take the next free
    # task slot before gold's (lakehouse/runtime/fairscheduler.xml); false: one FIFO queue.
    fair_pools: bool = True
    # start the driver JVM from the class archive `make` builds (.jars/cds, lakehouse.runtime.jars):
    # Spark's classes mapped instead of parsed and verified in every new process
    class_data_sharing: bool = True
    # Spark compiles the expressions of every task (projections, orderings: Java source built,
    # cleaned with regexes, looked up or compiled by Janino) even when the compiled class is
    # cached: a live pipeline's small micro-batches do not earn that back, while the large
    # batches of a catch-up run per-row code that compiled code runs faster. "batch": compiled
    # in the processes that run batch work (backfill, reprocess, SQL, maintenance), interpreted
    # in the streams; "on" / "off" (true / false): everywhere. Interpreted means Spark's
    # NO_CODEGEN, which turns whole-stage code generation off too (docs/history/benchmarks.md).
    expression_codegen: Literal["batch", "on", "off"] = "batch"
    # glibc malloc arenas of the driver JVM (MALLOC_ARENA_MAX; 0: glibc's default, up to 8 per
    # core): with Spark's many threads, arenas of freed memory held the JVM's native memory
    # growing over hours (docs/history/benchmarks.md). An inherited MALLOC_ARENA_MAX wins.
    malloc_arenas: int = Field(2, ge=0)
    # MB the driver JVM reserves for JIT-compiled code (-XX:ReservedCodeCacheSize; 0: the JVM's
    # 240). A long run's JIT keeps compiling Spark's planner and Delta's code for hours and keeps
    # the memory that code took; once this much is used the JVM flushes cold code instead of
    # growing (an hour at 1,000 events/s used 125 MB).
    code_cache_mb: int = Field(144, ge=0)
    conf: dict[str, str] = Field(default_factory=dict)

    @field_validator("expression_codegen", mode="before")
    @classmethod
    def _codegen_switch(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("true", "false")):
            return "on" if str(v).lower() == "true" else "off"  # the setting was a boolean once
        return v

    @field_validator("driver_memory")
    @classmethod
    def _memory_size(cls, v: str) -> str:
        if not _MEMORY_SIZE.match(v):
            raise ValueError("must be a whole number with a unit k, m, g or t, e.g. 2g or 768m")
        return v

    @property
    def driver_memory_mb(self) -> int:
        """``driver_memory`` in MiB."""
        n, unit = _MEMORY_SIZE.match(self.driver_memory).groups()  # type: ignore[union-attr]
        return max(1, int(n) * {"k": 1, "m": 1 << 10, "g": 1 << 20, "t": 1 << 30}[unit.lower()] >> 10)


class StreamSettings(_Section):
    # bronze and silver: the latency path (threshold alerts read silver's batches)
    trigger_seconds: float = Field(0.5, ge=0)
    # Gold's two stateful queries cost the most per batch; a longer interval spreads that cost
    # over more rows and leaves the cores to bronze and silver, at the price of device status a
    # few seconds later (bench/alert_latency.py, docs/performance.md). <0: trigger_seconds.
    gold_trigger_seconds: float = Field(3.0)
    # Gold's window aggregates (1-minute windows) need no refresh as often as device health:
    # a longer interval leaves the cores to the latency path. <0: gold_trigger_seconds.
    windows_trigger_seconds: float = Field(10.0)
    max_offsets_per_trigger: int = Field(200_000, ge=1)
    # A live bronze batch waits for this many new Kafka records, or at most
    # ``max_batch_delay_seconds`` after the previous batch (Kafka source's minOffsetsPerTrigger /
    # maxTriggerDelay): a slow fleet's events are batched instead of paying a micro-batch of every
    # layer each trigger. 0: a batch at every trigger with new records.
    min_offsets_per_trigger: int = Field(0, ge=0)
    max_batch_delay_seconds: float = Field(2.0, gt=0)
    # On a graceful stop (SIGTERM / Ctrl-C) each query gets up to this long to finish the
    # micro-batch it is running; stopping mid-batch cancels its jobs (replayed at restart).
    graceful_stop_seconds: float = Field(30.0, ge=0)
    # Spark Kafka source's minPartitions: >0 splits large partition ranges into at least this
    # many tasks per bronze batch (catch-up on more cores than partitions); 0: one task per
    # Kafka partition.
    kafka_min_partitions: int = Field(0, ge=0)
    # Unread records gone from Kafka (topic recreated, retention, lost broker storage): fail the
    # bronze stream (default) or log it and go on from what the topic holds.
    kafka_fail_on_data_loss: bool = True
    # Bronze read per silver micro-batch (Delta source's maxFilesPerTrigger / maxBytesPerTrigger,
    # the first reached wins, at least one file): bounds a catch-up batch, which the dedup index
    # collects to the driver. 0 bytes: files only.
    silver_max_files_per_trigger: int = Field(1000, ge=1)
    silver_max_bytes_per_trigger: int = Field(64 << 20, ge=0)
    watermark_seconds: int = Field(600, ge=0)
    # micro-batches whose offsets, commits and state versions each query's checkpoint keeps
    # (Spark's minBatchesToRetain, 100 by default): a restart needs only the last one, and 100
    # versions of gold health's state took 90 MB at 1,000 events/s.
    checkpoint_batches: int = Field(20, ge=2)
    # Silver's dedup within the watermark: "index" (driver-side, cost per batch grows with the
    # batch only: silver/dedup.py; faster and less CPU in bench/silver_dedup.py) or
    # "state_store" (Spark's dropDuplicatesWithinWatermark on RocksDB, for the bench: late rows
    # vanish inside its operator, so a batch holding any fails the stream).
    dedup: Literal["index", "state_store"] = "index"
    # "fused": one query writes bronze and silver from each Kafka micro-batch (less work per
    # event, one batch to wait for; silver.from_kafka). "layered": bronze from Kafka, then silver
    # from bronze's Delta table, two queries (the bronze and silver roles of a scale-out, a
    # bronze written by something else). "auto": fused, but layered for Sparkplug B models and
    # the state-store dedup, which fused does not do. A lake keeps the topology it started with.
    topology: Literal["auto", "fused", "layered"] = "auto"
    window_seconds: int = Field(60, ge=1)

    @field_validator("window_seconds")
    @classmethod
    def _divides_minute(cls, v: int) -> int:
        if v < 60 and 60 % v:
            raise ValueError("must divide 60 when shorter than a minute")
        return v


class MaintenanceSettings(_Section):
    """Table maintenance. The log and vacuum retentions are the time-travel horizon (restore,
    reprocessing as of a version); a stream of the lake that lags past them keeps what it still
    has to read (``orchestration.maintenance.clean_log`` and ``vacuum``)."""

    #: vacuum keeps files any version of this age still needs (the time-travel horizon); a
    #: table a lagging stream has yet to read is not vacuumed until it caught up
    vacuum_retention_hours: float = Field(1, gt=0)
    #: the Delta log of tables iotlake creates (Delta: at least vacuum_retention_hours). Short
    #: because on a local disk every commit pays for every file the log holds
    #: (bench/delta_log_length.py); a lagging stream's commits are kept whatever this says
    log_retention_hours: float = Field(1, gt=0)
    #: commits between Delta log checkpoints on the tables iotlake creates
    #: (``delta.checkpointInterval``; Delta's default is 10). A checkpoint rebuilds the table's
    #: state and writes it as Parquet in the committing stream's batch, about ten plain commits'
    #: cost on a small table; the log clean-up needs one before it can drop older commits
    log_checkpoint_commits: int = Field(100, ge=1)
    #: allow either retention below MIN_RETENTION_HOURS: only where nothing reads older
    #: versions (soak runs, tests)
    allow_short_retention: bool = False
    target_file_size: int = Field(134_217_728, ge=1 << 20)
    zorder: bool = True
    #: ``iotlake run`` keeps its tables healthy by itself (orchestration.upkeep); false when
    #: Airflow's maintenance DAGs do it
    auto: bool = True
    #: how often the built-in upkeep looks at the tables
    check_seconds: float = Field(60.0, gt=0)
    #: the built-in upkeep bin-packs a table once it has this many files under
    #: ``small_file_bytes``, into files of up to 4x that; bigger files are left alone
    compact_min_files: int = Field(50, ge=2)
    small_file_bytes: int = Field(8 << 20, ge=1 << 16)
    vacuum_interval_hours: float = Field(24.0, gt=0)
    #: the built-in upkeep warns at every pass while the disk under the local data root
    #: (checkpoints, the embedded brokers' logs, local tables) has less free than this (0: never):
    #: on a full disk the embedded Kafka stops and every commit fails
    min_free_disk_gb: float = Field(2.0, ge=0)
    #: days of rows each table keeps (by its time column, lakehouse.tables.RETENTION_COLUMNS);
    #: a table not named keeps everything. Deleted by the built-in upkeep and `iotlake retain`.
    retention_days: dict[str, float] = Field(default_factory=lambda: {
        "bronze": 7, "quarantine": 30, "readings_scored": 30, "anomalies": 90,
        "device_status_history": 90, "quality_log": 30, "pipeline_metrics": 7})

    #: tables retention can expire are partitioned by buckets of this many minutes of their time
    #: column (a day, or a divisor of one), so retention drops whole partitions without
    #: conflicting with the streams' appends; rows live up to one bucket past their retention.
    #: Fixed when a table is created.
    partition_minutes: int = Field(1440, ge=1)

    @field_validator("partition_minutes")
    @classmethod
    def _whole_buckets(cls, v: int) -> int:
        if 1440 % v and v % 1440:
            raise ValueError(f"maintenance.partition_minutes must divide a day (1440) or be whole "
                             f"days, got {v}: e.g. 1440 (a day), 60 (an hour), 5")
        return v

    @field_validator("retention_days")
    @classmethod
    def _known_tables(cls, v: dict[str, float]) -> dict[str, float]:
        from lakehouse.tables import RETENTION_COLUMNS

        unknown = sorted(set(v) - set(RETENTION_COLUMNS))
        if unknown:
            raise ValueError(f"maintenance.retention_days names tables without a time column to "
                             f"expire by: {unknown}; choose from {sorted(RETENTION_COLUMNS)}")
        bad = sorted(t for t, d in v.items() if d <= 0)
        if bad:
            raise ValueError(f"maintenance.retention_days must be > 0 days (remove a table to keep "
                             f"all of it): {bad}")
        return v

    @model_validator(mode="after")
    def _long_enough(self) -> MaintenanceSettings:
        brief = sorted(t for t, d in self.retention_days.items() if d * 1440 < self.partition_minutes)
        if brief:
            raise ValueError(f"maintenance.retention_days of {brief} is shorter than one partition "
                             f"(maintenance.partition_minutes = {self.partition_minutes}): retention "
                             f"drops whole partitions, so lower partition_minutes or keep rows longer")
        short = [k for k in ("vacuum_retention_hours", "log_retention_hours")
                 if getattr(self, k) < MIN_RETENTION_HOURS]
        if short and not self.allow_short_retention:
            raise ValueError(f"maintenance.{short[0]} below {MIN_RETENTION_HOURS} h can remove "
                             f"files a query or a backfill is reading: raise it, or set "
                             f"maintenance.allow_short_retention = true where nothing reads "
                             f"older versions")
        if self.log_retention_hours < self.vacuum_retention_hours:
            raise ValueError(f"maintenance.log_retention_hours ({self.log_retention_hours:g}) must "
                             f"be at least vacuum_retention_hours ({self.vacuum_retention_hours:g}): "
                             f"Delta refuses a log shorter than its removed files' retention")
        return self


class ObservabilitySettings(_Section):
    """Prometheus endpoint of ``iotlake run`` (bridge and stream metrics); 0 disables it."""

    metrics_port: int = Field(9464, ge=0, le=65535)
    metrics_bind: str = "127.0.0.1"
    #: how often buffered progress rows are MERGEd into ``pipeline_metrics`` (each write is a
    #: Delta commit, ~1-2 s of a core on a small machine; Prometheus is updated at once)
    metrics_flush_seconds: float = Field(30.0, gt=0)


class GoldSettings(_Section):
    """Device status rules and anomaly scoring (one configuration for every device)."""

    offline_after_seconds: int = Field(120, ge=1)
    anomaly_score_high: float = Field(0.9, gt=0, le=1)
    anomaly_threshold: float = Field(0.5, gt=0, lt=1)
    # the sliding windows (gold_metrics_5m and its final table; e.g. 300). 0, the default, leaves
    # them out: no reader iotlake ships needs them, and they cost about half of the window
    # stream (docs/history/benchmarks.md)
    slide_window_seconds: int = Field(0, ge=0)
    slide_every_seconds: int = Field(60, ge=60)
    # Silver read per gold micro-batch (Delta's maxFilesPerTrigger / maxBytesPerTrigger, the
    # first reached wins; at least one file): bounds a catch-up batch, whose rows the health
    # stream holds in memory (the driver's; a state bucket's in the state store). 0 bytes: files only.
    max_files_per_trigger: int = Field(100, ge=1)
    max_bytes_per_trigger: int = Field(64 << 20, ge=0)
    # Where the health stream keeps each device's state: "driver" (the driver's memory, a
    # changelog in the checkpoint: gold/device_state.py; each batch goes to the driver, as
    # silver's dedup index does; ~1.8 KB per device and gold metric, 53 MB for 10,000 devices
    # of 3) or "state_store" (Spark's RocksDB state store, by device bucket: for fleets whose
    # state or batches a driver should not hold). A checkpoint keeps the mode it started with.
    health_state: Literal["driver", "state_store"] = "driver"
    # Debounced status (Prometheus' ``for:``, Nagios' soft and hard states): a device's status
    # changes between online and degraded only once the new status has held for this many
    # consecutive readings and this long (event time) since the first of them, so a status
    # changes at most once per hold period. Offline (no data, a death certificate) and coming
    # back from it take effect at once.
    status_hold_seconds: float = Field(60.0, ge=0)
    status_hold_readings: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _sliding(self) -> GoldSettings:
        if 0 < self.slide_window_seconds < max(60, self.slide_every_seconds):
            raise ValueError(f"gold.slide_window_seconds ({self.slide_window_seconds}) must be 0 (no "
                             f"sliding windows) or at least 60 and slide_every_seconds "
                             f"({self.slide_every_seconds})")
        return self


ALERT_KINDS = ("device_offline", "device_degraded", "anomaly", "threshold", "site_silent",
               "pipeline_stale", "pipeline_lag", "pipeline_disk", "bridge_stalled")


class AlertRuleSettings(_Section):
    """One ``[[alerts.rules]]`` entry: what fires, for how long it must hold, and its labels.

    - ``device_offline``: a device's status is offline (no reading for
      ``gold.offline_after_seconds`` by wall clock, or a death certificate);
    - ``device_degraded``: its status is degraded, for ``reason`` (empty: any reason);
    - ``anomaly``: ``metric``'s anomaly score (empty: any gold metric's) at or above ``above``;
    - ``threshold``: ``metric`` above ``above`` and/or below ``below``;
    - ``site_silent``: no device of a site (the topic column ``alerts.site_column``) heard for
      ``silent_seconds`` (0: ``gold.offline_after_seconds``);
    - ``pipeline_stale``: a streaming query inactive or without progress for ``stale_seconds``;
    - ``pipeline_lag``: the Kafka consumer lag of a query above ``max_lag`` records;
    - ``pipeline_disk``: free disk under the data root below ``maintenance.min_free_disk_gb``;
    - ``bridge_stalled``: the MQTT -> Kafka bridge delivered nothing for ``stale_seconds`` while
      messages waited.

    Each fires once the condition has held ``for_seconds`` (0: at once) and resolves when it
    no longer holds.
    """

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_:.-]{0,127}$")
    kind: Literal[ALERT_KINDS]  # type: ignore[valid-type]
    severity: Literal["critical", "warning", "info"] = "warning"
    labels: dict[str, str] = Field(default_factory=dict)
    summary: str = ""  # annotation; empty: a sentence made from the rule
    metric: str = ""
    above: float | None = None
    below: float | None = None
    reason: str = ""
    for_seconds: float = Field(0.0, ge=0)
    silent_seconds: float = Field(0.0, ge=0)
    stale_seconds: float = Field(60.0, gt=0)
    max_lag: int = Field(100_000, ge=0)

    @model_validator(mode="after")
    def _complete(self) -> AlertRuleSettings:
        if self.kind == "threshold":
            if not self.metric:
                raise ValueError(f"alert rule {self.name!r} (threshold) needs a metric")
            if self.above is None and self.below is None:
                raise ValueError(f"alert rule {self.name!r} (threshold) needs above and/or below")
        if self.kind == "anomaly" and self.above is None:
            raise ValueError(f"alert rule {self.name!r} (anomaly) needs above (a score, e.g. 0.9)")
        return self


def _default_rules() -> list[AlertRuleSettings]:
    return [
        AlertRuleSettings(name="DeviceOffline", kind="device_offline", severity="warning"),
        AlertRuleSettings(name="SiteSilent", kind="site_silent", severity="critical"),
        AlertRuleSettings(name="PipelineStale", kind="pipeline_stale", severity="critical"),
    ]


class AlertsSettings(_Section):
    """Alert rules, their lifecycle and where notifications go (gold/alerts/).

    Delivery is at least once with an idempotency key, from an outbox in the checkpoint root
    that survives restarts; a receiver that fails ``max_attempts`` times in a row keeps the
    notification as failed (counted), never drops it silently.
    """

    enabled: bool = True
    rules: list[AlertRuleSettings] = Field(default_factory=_default_rules)
    alertmanager_url: str = ""  # e.g. http://127.0.0.1:9093 (iotlake posts /api/v2/alerts)
    webhook_url: str = ""  # one POST per alert state change, Alertmanager's webhook format
    webhook_secret: str = Field("", repr=False)  # HMAC-SHA256 of the body (header X-Iotlake-Signature)
    mqtt_topic: str = ""  # the same JSON, QoS 1, on the pipeline's MQTT broker
    site_column: str = "site"  # the topic column naming a device's site (site_silent rules)
    evaluate_seconds: float = Field(1.0, gt=0)
    renotify_seconds: float = Field(3600.0, ge=0)  # a firing alert again (0: never)
    # Alertmanager resolves an alert it has not heard of for its resolve_timeout (5 m by
    # default): firing alerts are posted to it again this often
    alertmanager_resend_seconds: float = Field(60.0, gt=0)
    max_attempts: int = Field(20, ge=1)
    retry_seconds: float = Field(1.0, gt=0)  # first retry; doubles up to retry_max_seconds
    retry_max_seconds: float = Field(60.0, gt=0)
    timeout_seconds: float = Field(5.0, gt=0)
    # readings older than this (event time, against the wall clock) never fire an alert: a
    # catch-up after an outage, a backfill or a replay is the past
    max_age_seconds: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _unique_names(self) -> AlertsSettings:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"alerts.rules: names must be unique (repeated: {', '.join(dup)})")
        return self


class StorageSettings(_Section):
    """Object storage, used when ``data_root`` is a URI (``s3://bucket/prefix``; MinIO, Ceph...).

    Credentials: these keys, their ``*_file`` variants (mounted secrets) or the standard
    ``AWS_*`` environment. Spark writes through S3A (``lakehouse.storage.spark_conf``) and
    Delta's S3 log store: one writing driver per table. delta-rs readers use the same keys
    (``allow_unsafe_rename`` / ``options`` only concern delta-rs). Spark checkpoints stay on a
    filesystem under ``checkpoint_root`` (their lock is a local file lock; shared, e.g.
    NFS/HDFS, when executors run on other machines).
    """

    checkpoint_root: str = ""  # empty: <data_root> (required when data_root is a URI)
    endpoint_url: str = ""  # empty: AWS; e.g. http://minio:9000
    region: str = "us-east-1"
    allow_http: bool = False
    allow_unsafe_rename: bool = False
    # S3A path-style URLs (http://host/bucket/key); unset: on when endpoint_url is set
    path_style_access: bool | None = None
    access_key_id: str = Field("", repr=False)
    secret_access_key: str = Field("", repr=False)
    session_token: str = Field("", repr=False)
    # Extra delta-rs / object_store options, verbatim.
    options: dict[str, str] = Field(default_factory=lambda: {"conditional_put": "etag"})


_STORAGE_SECRETS = ("access_key_id", "secret_access_key", "session_token")


class SimulatorSettings(_Section):
    """The stand-in devices of `iotlake simulate` / `run --simulate` (never read by the pipeline)."""
    # ids of simulated devices under a model other than the bundled one: "<prefix>-<4 hex>"
    device_prefix: str = Field("dev", pattern=r"^[A-Za-z0-9_.-]{1,32}$")


class DashboardSettings(_Section):
    """``iotlake dashboard``. Without a token it answers only requests whose ``Host`` is one of
    these names, the bind address, ``localhost``, ``127.0.0.1`` or ``::1`` (a page of another
    name, DNS rebinding, gets 421)."""
    allowed_hosts: list[str] = Field(default_factory=list)

    @field_validator("allowed_hosts")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [h for h in v if not re.fullmatch(r"[A-Za-z0-9.:\[\]_-]{1,253}", h)]
        if bad:
            raise ValueError(f"dashboard.allowed_hosts takes host names or addresses without a port "
                             f"or scheme (e.g. 'ops.example.com'): {bad}")
        return [h.lower().strip("[]") for h in v]


class Settings(BaseSettings):
    """Every setting. ``load_settings`` builds it from the file, the environment and keyword
    overrides; ``Settings(...)`` and ``Settings.model_validate(...)`` take their argument only."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True,
                                      validate_default=False, arbitrary_types_allowed=False,
                                      env_prefix=ENV_PREFIX, env_nested_delimiter="__")

    data_root: str = "./data"
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    bridge: BridgeSettings = Field(default_factory=BridgeSettings)
    spark: SparkSettings = Field(default_factory=SparkSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    gold: GoldSettings = Field(default_factory=GoldSettings)
    maintenance: MaintenanceSettings = Field(default_factory=MaintenanceSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    telemetry: TelemetryModel = Field(default_factory=TelemetryModel)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    simulator: SimulatorSettings = Field(default_factory=SimulatorSettings)
    alerts: AlertsSettings = Field(default_factory=AlertsSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    _pinned: str | None = PrivateAttr(default=None)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """In ``load_settings``: keyword overrides, then the environment, then the file (highest
        priority first). Otherwise the arguments only: pydantic validates through ``__init__``,
        and a copy made with ``model_validate`` must not pick up this process's environment."""
        loading = _loading.get()
        if loading is None:
            return (init_settings,)
        file, environ = loading
        return (init_settings, _Environment(settings_cls, environ),
                (_JsonFile if file.suffix == ".json" else _TomlFile)(settings_cls, file))

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """``<key>_file`` names a file holding the secret (e.g. a mounted secret):
        ``mqtt.password_file``, ``storage.access_key_id_file``, ``storage.secret_access_key_file``,
        ``storage.session_token_file``, ``alerts.webhook_secret_file``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, keys in _SECRET_FILES:
            node = data.get(section)
            if not isinstance(node, dict) or not any(f"{k}_file" in node for k in keys):
                continue
            node = data[section] = dict(node)
            for key in keys:
                pf = node.pop(f"{key}_file", None)
                if pf:
                    try:
                        node[key] = Path(pf).read_text().strip()
                    except OSError as e:
                        raise SettingsError(f"{section}.{key}_file: cannot read {pf!r}: {e.strerror}") from e
        return data

    @field_validator("data_root")
    @classmethod
    def _supported_root(cls, v: str) -> str:
        if is_uri(v):
            scheme = v.split("://", 1)[0]
            if scheme not in ("s3", "s3a"):
                raise ValueError(f"object storage {scheme}:// is not supported: use s3:// "
                                 "(any S3-compatible store) or a local path")
            return v.rstrip("/")
        return v

    @model_validator(mode="after")
    def _subscribe_to_the_model(self) -> Settings:
        """The bridge subscribes to what the telemetry model's topic pattern names, unless
        ``mqtt.topic_filter`` is set explicitly."""
        if "topic_filter" not in self.mqtt.model_fields_set:
            self.mqtt.topic_filter = self.telemetry.topic_filter
        return self

    @model_validator(mode="after")
    def _open_broker_needs_auth(self) -> Settings:
        m = self.mqtt
        if m.allow_anonymous and m.embedded_open:
            raise ValueError(f"mqtt.embedded_bind = {m.embedded_bind!r} opens the embedded broker "
                             "beyond this machine: that needs authentication. Set "
                             "mqtt.allow_anonymous = false and give each device a credential "
                             "(iotlake devices add DEVICE_ID), or bind 127.0.0.1")
        if m.embedded_open and not (m.embedded_device_port or m.embedded_cert_port):
            raise ValueError(f"mqtt.embedded_bind = {m.embedded_bind!r} opens the embedded broker "
                             "to devices on the network: give them a listener of their own, "
                             "mqtt.embedded_device_port (e.g. 1883), where each is held to its own "
                             "client id; iotlake's clients keep mqtt.embedded_port on 127.0.0.1")
        ports = [p for p in (m.embedded_port, m.embedded_device_port, m.embedded_cert_port) if p]
        if len(set(ports)) < len(ports):
            raise ValueError("mqtt.embedded_port, embedded_device_port and embedded_cert_port "
                             "must differ")
        if m.embedded_cert_port and not m.tls:
            raise ValueError("mqtt.embedded_cert_port is a TLS listener: set mqtt.tls = true")
        if bool(m.tls_server_cert) != bool(m.tls_server_key) or (m.tls_server_cert and not m.tls_ca):
            raise ValueError("mqtt.tls_server_cert needs mqtt.tls_server_key and mqtt.tls_ca (the CA "
                             "your devices' certificates are signed by); leave all three unset "
                             "for iotlake's own CA")
        return self

    @property
    def subscribes_to_model(self) -> bool:
        """The bridge's MQTT filter is the one the telemetry model's topic pattern names (so the
        pattern's levels locate the device in a topic)."""
        return self.mqtt.topic_filter == self.telemetry.topic_filter

    @model_validator(mode="after")
    def _sparkplug_dedup(self) -> Settings:
        if self.telemetry.sparkplug and self.stream.dedup != "index":
            raise ValueError('telemetry.sparkplug needs stream.dedup = "index" (Sparkplug with '
                             'Spark\'s state-store dedup is not supported yet)')
        return self

    @model_validator(mode="after")
    def _alert_rules_know_the_model(self) -> Settings:
        """A rule naming a metric the telemetry model does not declare fails at start."""
        model = self.telemetry
        for i, r in enumerate(self.alerts.rules):
            key = f"alerts.rules[{i}]"
            known = model.metric_names if r.kind == "threshold" else model.gold_metrics
            if r.metric and r.kind in ("threshold", "anomaly") and model.metrics and r.metric not in known:
                raise ValueError(f"{key}.metric: unknown metric {r.metric!r} in rule {r.name!r} "
                                 f"(the telemetry model declares: {', '.join(known) or 'none'})")
        return self

    @model_validator(mode="after")
    def _fused_topology(self) -> Settings:
        if self.stream.topology == "fused" and not self._fusable:
            raise ValueError('stream.topology = "fused" needs JSON payloads deduplicated by the '
                             'index (stream.dedup = "index", no telemetry.sparkplug): set '
                             'stream.topology = "auto" or "layered"')
        return self

    @property
    def fused(self) -> bool:
        """Bronze and silver are one query (``stream.topology``)."""
        return self.stream.topology == "fused" or (self.stream.topology == "auto" and self._fusable)

    @property
    def _fusable(self) -> bool:
        """What the fused query does: JSON payloads deduplicated by the index."""
        return not self.telemetry.sparkplug and self.stream.dedup == "index"

    @model_validator(mode="after")
    def _checkpoints_on_a_filesystem(self) -> Settings:
        if is_uri(self.data_root) and not self.storage.checkpoint_root:
            raise ValueError("storage.checkpoint_root is required when data_root is a URI: Spark "
                             "checkpoints must stay on a (shared) filesystem, e.g. /var/lib/iotlake")
        return self

    # ---- where the files live: delegated to lakehouse.layout, documented there -----------
    @property
    def layout(self) -> Layout:
        return Layout(self.data_root, self.storage.checkpoint_root, self._pinned)

    @property
    def remote(self) -> bool:
        return self.layout.remote

    @property
    def root(self) -> Path:
        return self.layout.root

    @property
    def checkpoint_root(self) -> Path:
        return self.layout.checkpoint_root

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    def generation(self) -> str:
        return self.layout.generation()

    def pinned(self, generation: str) -> Settings:
        """A copy whose derived tables and checkpoints are those of ``generation``."""
        copy = self.model_copy(deep=True)
        copy._pinned = generation
        return copy

    def table_path(self, name: str, generation: str | None = None) -> str:
        try:
            return self.layout.table_path(name, generation)
        except ValueError as e:  # a name that is not a table's: the settings' error, as before
            raise SettingsError(str(e)) from None

    def checkpoint_path(self, query: str, generation: str | None = None) -> str:
        return self.layout.checkpoint_path(query, generation)

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka.bootstrap or f"127.0.0.1:{self.kafka.embedded_port}"

    @property
    def mqtt_endpoint(self) -> tuple[str, int]:
        if self.mqtt.host:
            return self.mqtt.host, self.mqtt.port or 1883
        return "127.0.0.1", self.mqtt.embedded_port

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write these settings as JSON (readable by ``load_settings``) for child processes."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # relative paths are this working directory's; in a file they would be the file's folder's
        data = self.model_dump(mode="json")
        _absolute_paths(data, Path.cwd())
        p.write_text(json.dumps(data, indent=1, ensure_ascii=False))
        p.chmod(0o600)  # may hold credentials
        return p

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict safe to log: secrets replaced."""
        d = self.model_dump()
        if d["mqtt"]["password"]:
            d["mqtt"]["password"] = "***"
        d["kafka"]["client_config"] = {
            k: ("***" if "password" in k or "secret" in k else v)
            for k, v in d["kafka"]["client_config"].items()
        }
        for k in _STORAGE_SECRETS:
            if d["storage"][k]:
                d["storage"][k] = "***"
        d["storage"]["options"] = {k: ("***" if _secret_key(k) else v)
                                   for k, v in d["storage"]["options"].items()}
        return d


def _secret_key(name: str) -> bool:
    n = name.lower()
    return any(w in n for w in ("password", "secret", "token", "access_key", "credential"))


#: secrets that may be read from a file instead, ``<key>_file``
_SECRET_FILES = (("mqtt", ("password",)), ("storage", _STORAGE_SECRETS), ("alerts", ("webhook_secret",)))

#: Settings that name a file or folder.
_PATH_SETTINGS = (("data_root",), ("storage", "checkpoint_root"), ("telemetry", "suite"),
                  ("mqtt", "tls_ca"), ("mqtt", "tls_cert"), ("mqtt", "tls_key"),
                  ("mqtt", "tls_server_cert"), ("mqtt", "tls_server_key"),
                  *((section, f"{key}_file") for section, keys in _SECRET_FILES for key in keys))


def _absolute_paths(data: dict[str, Any], folder: Path) -> None:
    """Relative paths among ``data``'s path settings made absolute against ``folder``: a settings
    file's against its own directory, so it means the same from any working directory (the
    example fleets name their suite beside them). Absolute paths, ``~`` and URIs stay."""
    for *sections, key in _PATH_SETTINGS:
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        v = node.get(key) if isinstance(node, dict) else None
        if isinstance(v, str) and v and not is_uri(v) and not Path(v).expanduser().is_absolute():
            node[key] = os.path.normpath(folder / v)


class _Environment(EnvSettingsSource):
    """``IOTLAKE_*`` variables of ``environ``, nested with ``__``. Kept by hand: which variables
    are not settings (``_NOT_SETTINGS``, ``IOTLAKE_TEST_*``: skipped), that a value starting with
    ``{`` or ``[`` is JSON whatever the setting's type (a list given for a string fails instead
    of becoming its text), and that a variable naming no setting fails as unknown
    (pydantic-settings would skip it, so a typo would fall back to the default)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)  # prefix and delimiter: Settings.model_config

    def _load_env_vars(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, raw in self._environ.items():
            if not key.startswith(ENV_PREFIX) or key in _NOT_SETTINGS or key.startswith("IOTLAKE_TEST_"):
                continue
            value: Any = raw
            if raw[:1] in "{[":
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise SettingsError(f"{key}: not valid JSON ({e})") from e
            out[key.lower()] = value
        return out

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        return value  # JSON already decoded above

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for name, value in self.env_vars.items():
            key = name[len(ENV_PREFIX):].split(self.env_nested_delimiter)[0]
            if key not in self.settings_cls.model_fields:
                data[key] = value  # fails as an unknown setting
        return data


class _RelativeToFile:
    """A settings file's relative paths made absolute against its folder (``_absolute_paths``);
    its syntax errors as SettingsError."""

    def _read_file(self, path: Path) -> dict[str, Any]:
        try:
            data = super()._read_file(path)  # type: ignore[misc]
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise SettingsError(f"{path}: invalid {path.suffix.lstrip('.').upper() or 'TOML'}: {e}") from e
        _absolute_paths(data, path.parent.absolute())
        return data


class _TomlFile(_RelativeToFile, TomlConfigSettingsSource):
    pass


class _JsonFile(_RelativeToFile, JsonConfigSettingsSource):
    """What ``Settings.save`` writes."""


#: The settings file and environment ``load_settings`` is reading, while it builds a Settings.
_loading: ContextVar[tuple[Path, Mapping[str, str]] | None] = ContextVar("_loading", default=None)


def load_settings(
    path: str | os.PathLike[str] | None = None,
    environ: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build settings from file, then env (``environ``, by default ``os.environ``), then keyword
    overrides (nested dicts allowed), each source overriding the one before key by key.

    Relative paths in the file (``data_root``, ``telemetry.suite``, ...) are the file's
    directory's; in env or keyword overrides, the working directory's."""
    environ = dict(os.environ if environ is None else environ)
    file = Path(path or environ.get("IOTLAKE_CONFIG") or DEFAULT_FILE)
    if not file.exists() and (path is not None or "IOTLAKE_CONFIG" in environ):
        raise SettingsError(f"settings file {file} does not exist (set IOTLAKE_CONFIG or create it)")
    token = _loading.set((file, environ))  # for Settings.settings_customise_sources
    try:
        return Settings(**overrides)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown setting '{key}' (check the spelling; see iotlake.toml.example)")
            elif not key:  # a rule across settings: its input is everything, secrets included
                problems.append(str(err["msg"]).removeprefix("Value error, "))
            else:
                shown = "***" if _secret_key(key) else repr(err.get("input"))
                problems.append(f"setting '{key}': {err['msg']} (got {shown})")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(problems)) from None
    finally:
        _loading.reset(token)
