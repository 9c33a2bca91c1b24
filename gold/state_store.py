"""Gold health with each device's state in Spark's state store (``gold.health_state =
"state_store"``): the arbitrary-state operator ``applyInPandasWithState`` (RocksDB).

State is keyed by a hash bucket of ``device_id`` (``STATE_BUCKETS``), each holding the states of
its devices: Spark's fixed cost per group in the Python worker (Arrow to pandas per group, state
(de)serialisation, one output frame per group) is ~1 ms, which with a key per device capped the
stream at ~1k readings/s for 10k devices. A bucket is processed column-wise (one sort,
vectorised rules and output columns, its devices' state as arrays: ``gold/scoring.py``) and all
its (device, metric) detectors run in one compiled call (``gold.anomaly.score_lanes_at``).
Timeouts stay per device and exact: a bucket's timeout is its devices' earliest deadline, and
every call also times out its devices without data whose deadline is below the watermark
(Spark's rule). This mode keeps the event-time rule only: its buckets run where Spark puts them,
on data or a watermark's timeout.
Changing ``STATE_BUCKETS`` needs a new checkpoint; the gold metrics may change between starts.

The state function's output is split into the four gold tables in Spark (``HealthBatch``).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from functools import partial

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from gold.anomaly import MODELS, DetectorConfig, state_fields
from gold.registry import RegistryJoin
from gold.scoring import (
    _NONE,
    TABLES,
    Bucket,
    Rows,
    Rules,
    add_current,
    bucket_of,
    devices_table,
    health_input,
    node_death,
    out_schema,
    score_readings,
    time_out,
)
from lakehouse.delta.concurrent_writes import run_at_once
from lakehouse.delta.read import read_table
from lakehouse.delta.tables import append, upsert
from lakehouse.settings import GoldSettings, Settings
from lakehouse.spark import arrow_frame
from lakehouse.tables import DEVICE_STATUS_HISTORY, SITE, device_current_schema
from lakehouse.telemetry import TelemetryModel

#: Fixed per checkpoint; also the most shuffle partitions the stream can use. More buckets:
#: less state rewritten when a micro-batch has fewer readings than buckets; fewer: less fixed
#: cost per group (pyspark's conversions and ours). Measured with bench/gold_throughput.py;
#: figures in docs/history/benchmarks.md.
STATE_BUCKETS = 64

# A bucket's state: one row per device, as an LZ4-compressed Arrow IPC stream in base64 text.
# Text, not binary: pyspark hands a binary state to Python through the JVM's pickler, which
# builds it byte by byte (a sixth of the JVM's CPU at 10k devices); ASCII is copied in bulk.
# The Arrow schema inside the blob follows the model's gold metrics: a metric added to the model
# starts with no value and a fresh detector, one removed is dropped (no new checkpoint).
STATE_SCHEMA = "devices string"
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def load_devices(blob: str, state_len: int, metrics: tuple[str, ...],
                 cfg: DetectorConfig | None = None, topics: tuple[str, ...] = ()) -> Bucket:
    """A bucket's state (Arrow IPC: typed and compact, unlike a pickle of Python objects)."""
    return bucket_of(pa.ipc.open_stream(base64.b64decode(blob)).read_all(), state_len, metrics, cfg,
                     topics)



def dump_devices(b: Bucket, metrics: tuple[str, ...], topics: tuple[str, ...] = ()) -> str:
    """Inverse of :func:`load_devices`."""
    table = devices_table(b, metrics, topics=topics)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue()).decode("ascii")



def health_fn(gold: GoldSettings, model: TelemetryModel):
    """The per-bucket state function (a closure over the rules, shipped to executors)."""
    cfg = DetectorConfig(threshold=gold.anomaly_threshold)
    state_len = len(state_fields(cfg))
    timeout_ms = gold.offline_after_seconds * 1000
    rules = Rules.of(model)
    metrics, topics = rules.metrics, rules.topics
    out_types = dict(c.split() for c in out_schema(metrics, topics).split(", "))

    def fn(key: tuple, pdfs: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        devs = (load_devices(state.get[0], state_len, metrics, cfg, topics) if state.exists
                else Bucket.empty(state_len, len(metrics), len(topics)))
        out = Rows(out_types)
        touched = np.zeros(0, dtype=np.int64)
        if not state.hasTimedOut:
            frames = [p for p in pdfs if len(p)]
            if frames:
                pdf = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
                touched = score_readings(pdf, devs, out, cfg, gold, timeout_ms, rules)
        wm = state.getCurrentWatermarkMs()
        quiet = np.ones(len(devs.ids), dtype=bool)
        quiet[touched] = False
        timed_out = time_out(devs, quiet, wm, timeout_ms, out)
        add_current(devs, np.concatenate([touched, timed_out]), out, rules)
        state.update((dump_devices(devs, metrics, topics),))
        pending = devs.timeout_at[devs.timeout_at != _NONE]
        if pending.size:
            # Spark takes no timeout at or below the watermark: a device whose deadline already
            # passed (it sent only old readings) goes offline at the next call, as of its deadline
            state.setTimeoutTimestamp(int(max(pending.min(), wm + 1)))
        if out.parts:
            yield out.frame()

    return fn



def health_frame(silver: DataFrame, settings: Settings) -> DataFrame:
    model = settings.telemetry
    df = silver.select(*health_input(model))
    key = F.col("device_id")
    if model.sparkplug:
        # A Sparkplug edge node's devices share its bucket, so its death (NDEATH) reaches them
        # all; JSON devices keep their buckets (an existing checkpoint stays valid).
        node = F.get_json_object("extra", "$.sparkplug_node")
        key = F.when(node.isNotNull(), F.concat_ws("/", F.get_json_object("extra", "$.sparkplug_group"), node)
                     ).otherwise(F.col("device_id"))
        df = df.withColumn("node_death", node_death()).withColumn("bucket_key", key).drop("extra")
        key = F.col("bucket_key")
    return (
        df
        .withWatermark("event_time", f"{settings.stream.watermark_seconds} seconds")
        .withColumn("bucket", F.pmod(F.xxhash64(key), F.lit(STATE_BUCKETS)))
        .groupBy("bucket")
        .applyInPandasWithState(health_fn(settings.gold, model),
                                out_schema(model.gold_metrics, model.topic_columns),
                                STATE_SCHEMA, "append",
                                GroupStateTimeout.EventTimeTimeout)
    )


class HealthBatch:
    """foreachBatch: split the state function's output into the four gold tables, in Spark.

    The output is persisted first: it comes out of the stateful operator, which must run once
    per batch (its state store commits), while four writes read it, at once
    (``lakehouse.delta.concurrent_writes``).
    """

    def __init__(self, settings: Settings, app_id: str, current_columns: list[str] | None = None) -> None:
        self.paths = {t: settings.table_path(t) for t in TABLES}
        self.app_id = app_id
        self.metrics = settings.telemetry.gold_metrics
        # device_current's columns: the model's, and those of metrics removed from it since
        self.current_columns = current_columns or device_current_schema(settings.telemetry).names
        self.registry = RegistryJoin(settings)

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        df = df.persist()
        try:
            self.write(df, batch_id)
        finally:
            df.unpersist()

    def write(self, out: DataFrame, batch_id: int) -> None:
        kind = F.col("kind")
        flagged = F.exists(F.array(*[F.col(m).isNotNull() & F.col(f"{m}_anomaly") for m in self.metrics]),
                           lambda x: x)
        n = out.agg(*[F.count_if(kind == k).alias(k) for k in ("reading", "status", "current")],
                    F.count_if((kind == "reading") & flagged).alias("anomaly")).first()
        rs = readings_scored(out.where(kind == "reading"), self.metrics)
        hist = (out.where(kind == "status").withColumnRenamed("event_time", "changed_at")
                .select(*DEVICE_STATUS_HISTORY.names))
        cur = out.where(kind == "current")
        cur = cur.select(*[c if c in cur.columns else F.lit(None).cast("double").alias(c)
                           for c in self.base_columns()])
        refreshed = self.registry_changed(out.sparkSession)
        if refreshed is not None:  # devices whose registry row changed: their rows, joined again
            cur = cur.unionByName(refreshed.join(cur.select("device_id"), "device_id", "left_anti"))
        cur = (self.registry.join(out.sparkSession, cur).withColumn("updated_at", F.current_timestamp())
               .select(*self.current_columns))
        writes = [partial(append, data, self.paths[name], self.app_id, batch_id)
                  for name, data, rows in (("readings_scored", rs, n["reading"]),
                                           ("anomalies", rs.where("is_anomaly"), n["anomaly"]),
                                           ("device_status_history", hist, n["status"])) if rows]
        if n["current"] or refreshed is not None:
            writes.append(partial(upsert, cur, self.paths["device_current"], ["device_id"],
                                  self.app_id, batch_id))
        run_at_once(out.sparkSession, writes)

    def base_columns(self) -> list[str]:
        """device_current's columns but ``updated_at`` and those the registry join gives."""
        return [c for c in self.current_columns if c != "updated_at" and (
            c not in self.registry.names or (c == SITE and self.registry.topic_site))]

    def registry_changed(self, spark: SparkSession) -> DataFrame | None:
        """device_current's rows (``base_columns``) of the devices whose registry row changed
        since the last batch (all, at a process's first batch), read by delta-rs; None: none."""
        ids = self.registry.changed()
        if ids is not None and not len(ids):
            return None
        rows = read_table(self.paths["device_current"], columns=self.base_columns())
        if ids is not None:
            rows = rows.filter(pc.is_in(rows.column("device_id"), value_set=ids))
        return arrow_frame(spark, rows) if rows.num_rows else None


def model_name(names: Column, index: Column) -> Column:
    """The name of the detector model at ``index`` (0-based), null without one. Spark takes
    ``element_at`` over an array without nulls for never null under ANSI mode, even at a null
    index: code compiled on that promise gave the last name, or wrote the null unchecked."""
    return F.when(index.isNotNull(), F.element_at(names, index.cast("int") + 1))


def readings_scored(readings: DataFrame, metrics: tuple[str, ...]) -> DataFrame:
    """Unpivot the state function's reading rows: one row per present metric."""
    names = F.array(*[F.lit(name) for name in MODELS])
    per_metric = F.array(*[F.struct(F.lit(m).alias("metric"), F.col(m).alias("value"),
                                    F.col(f"{m}_score").alias("score"),
                                    F.col(f"{m}_baseline").alias("baseline"),
                                    F.col(f"{m}_anomaly").alias("is_anomaly"),
                                    model_name(names, F.col(f"{m}_model")).alias("anomaly_model"),
                                    F.col(f"{m}_low").alias("expected_low"),
                                    F.col(f"{m}_high").alias("expected_high")) for m in metrics])
    return (readings.select("event_id", "device_id", "event_time", F.explode(per_metric).alias("r"))
            .select("event_id", "device_id", "event_time", "r.*")
            .where(F.col("value").isNotNull()))
