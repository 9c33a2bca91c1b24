"""Gold health with each device's state held by the driver (``gold.health_state = "driver"``).

Spark's arbitrary-state operator costs every batch a shuffle by device bucket, a round trip
of each bucket through a Python worker, its state (de)serialised per bucket and the output
cached for four writes: about as much as the rest of the batch (docs/history/benchmarks.md). Here a
batch goes to the driver as Arrow, as silver's does for its dedup index, where one
column-wise ``Bucket`` holds every device and ``gold.scoring.score_readings`` scores the batch in
one call; the four tables are written from the result.

The same rules as the state-store mode: readings at or before the watermark of the previous
batch are late and dropped; statuses change once held (``gold.scoring._hold``); a device with no
reading for ``offline_after_seconds`` goes offline once the watermark passes its deadline. Spark
runs no batch without data for a query without a stateful operator, so the watermark a no-data
batch would bring (the batch's own maximum event time less the delay) applies at the end of the
batch that set it.

Live (``trigger="live"``), a device also goes offline by the wall clock: when the pipeline
received nothing from it (silver's ``ingest_time``) for ``offline_after_seconds`` as of the
batch's clock (``batchTimestampMs`` in the offsets log: a replay sees the same). A batch that
read silver rows judges as of the newest row's ``ingest_time`` instead, when earlier: a stream
catching up (after a restart, or behind) has not read what its devices sent since, and takes no
device offline for it; and silence counts from the live run's start at the earliest
(``gold.ticks.LiveStarts``): what devices sent while the pipeline was down waits upstream. The
ticks (``gold/ticks.py``) run a batch when no data comes. A backfill or reprocess
(``available_now``) keeps the event-time rule alone. A checkpoint from before the ticks (one
source: Spark cannot add one) runs without them, with a warning.

Durability is the driver-held state's changelog (``lakehouse.streams.driver_state``): before the
batch's tables commit, the devices it changed are written to ``<checkpoint>/device_state/<batch>.changes.arrow``, or the whole state to
``<batch>.snapshot.arrow`` once the changes since the last snapshot hold as many rows as the
state. A restart at batch N rebuilds the state from the last snapshot before N and the changes
after it; a replayed batch N rewrites its own file.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from gold.anomaly import MODELS, DetectorConfig, state_fields
from gold.registry import RegistryJoin
from gold.scoring import (
    TABLES,
    Bucket,
    Rows,
    Rules,
    add_current,
    bucket_of,
    devices_table,
    health_input,
    next_due,
    node_death,
    out_schema,
    score_readings,
    time_out,
    time_out_received,
)
from gold.ticks import LiveStarts, TickTimer, batch_time_ms
from lakehouse.delta.concurrent_writes import run_at_once
from lakehouse.delta.read import open_table
from lakehouse.delta.tables import (
    WHOLE_REWRITE_MAX_BYTES,
    append_table,
    can_replace_whole,
    replace_whole,
    upsert,
)
from lakehouse.monitoring import observers
from lakehouse.monitoring.metrics import note_batch
from lakehouse.settings import Settings
from lakehouse.spark import arrow_frame
from lakehouse.streams import batch_watermark_ms
from lakehouse.streams.driver_state import Changelog
from lakehouse.tables import DEVICE_STATUS_HISTORY, READINGS_SCORED, SITE, device_current_schema

log = logging.getLogger(__name__)


def state_files(directory: Path) -> list[tuple[int, str, Path]]:
    """(batch, "snapshot" or "changes", file) of a device state's files, by batch."""
    return Changelog(directory, "device state").files()


class DeviceStateStore:
    """Every device's state by batch: in memory, and as a changelog with snapshots on disk."""

    def __init__(self, checkpoint: str, metrics: tuple[str, ...], cfg: DetectorConfig,
                 topics: tuple[str, ...] = ()) -> None:
        #: detector states compress ~6x (a 10,000-device snapshot: ~8 MB instead of ~52)
        self.changelog = Changelog(Path(checkpoint, "device_state"), "device state", "lz4")
        self.dir = self.changelog.dir
        self.metrics, self.cfg, self.topics = metrics, cfg, topics
        self.state_len = len(state_fields(cfg))
        self.devices: Bucket | None = None
        self.snapshot_batch = -1  # the last snapshot's batch (-1: none)
        self.changed_since = 0  # rows in the changes files after it

    def begin(self, batch_id: int) -> Bucket:
        """The devices as batch ``batch_id`` starts; changed in place until ``save``."""
        if not self.changelog.expects(batch_id) or self.devices is None:
            self._rebuild(batch_id)
        self.changelog.next_batch = None  # a batch that fails half way leaves a state to rebuild
        return self.devices

    def save(self, batch_id: int, changed: np.ndarray) -> None:
        """Write the batch's changed devices durably (before the batch commits anything)."""
        n = len(self.devices.ids)
        snapshot = n > 0 and self.changed_since + len(changed) >= n
        if len(changed) or snapshot:
            self.changelog.write(batch_id, devices_table(self.devices, self.metrics,
                                                         None if snapshot else changed, self.topics),
                                 "snapshot" if snapshot else "changes")
        if snapshot:
            # a replay of this batch starts from the snapshot before it: older files go
            self.changelog.drop_before(self.snapshot_batch)
            self.snapshot_batch, self.changed_since = batch_id, 0
        else:
            self.changed_since += len(changed)
        self.changelog.next_batch = batch_id + 1

    def _rebuild(self, batch_id: int) -> None:
        tables = self.changelog.replay(batch_id)
        self.snapshot_batch = max((b for b, kind, _ in self.changelog.files() if kind == "snapshot"),
                                  default=-1)
        self.changed_since = sum(t.num_rows for b, t in tables if b > self.snapshot_batch)
        if tables:
            t = pa.concat_tables([t for _, t in tables], promote_options="default")
            # the latest row of each device (its last occurrence), in file order
            ids = t.column("device_id").to_numpy(zero_copy_only=False)
            _, first_of_reversed = np.unique(ids[::-1], return_index=True)
            t = t.take(np.sort(len(ids) - 1 - first_of_reversed))
            self.devices = bucket_of(t, self.state_len, self.metrics, self.cfg, self.topics)
        else:
            self.devices = Bucket.empty(self.state_len, len(self.metrics), len(self.topics))
        log.info("device state: %d devices at batch %s", len(self.devices.ids), batch_id)


class CurrentTable:
    """``device_current`` as the driver last committed it. A batch's changed devices replace
    their rows and the table is rewritten whole from here (``delta_tables.replace_whole``): no
    read of the table and no join per batch. Another version than the one written last (a
    compaction, a replayed batch, a restart): the batch's rows are upserted into the table
    instead, which is read again before the next rewrite. On object storage, or once the table
    outgrows a whole rewrite, every batch upserts."""

    def __init__(self, path: str, schema: pa.Schema, app_id: str) -> None:
        self.path, self.schema, self.app_id = path, schema, app_id
        self.rows: pa.Table | None = None
        self.version: int | None = None
        self.rewrite = can_replace_whole(path)

    def write(self, spark: SparkSession, changed: pa.Table, batch_id: int) -> None:
        if self.rewrite and self.rows is None:
            table = open_table(self.path)
            self.version = table.version()
            self.rows = table.to_pyarrow_table(columns=self.schema.names).cast(self.schema)
            self.rewrite = self.rows.nbytes <= WHOLE_REWRITE_MAX_BYTES
        version = None
        if self.rewrite:
            keep = pc.invert(pc.is_in(self.rows.column("device_id"), value_set=changed.column("device_id")))
            rows = pa.concat_tables([self.rows.filter(keep), changed])
            version = replace_whole(spark, rows, self.path, self.app_id, batch_id, self.version)
        if version is None:
            upsert(arrow_frame(spark, changed), self.path, ["device_id"], self.app_id, batch_id)
        self.rows, self.version = (rows, version) if version is not None else (None, None)


def driver_frame(silver: DataFrame, settings: Settings, ticks: DataFrame | None = None) -> DataFrame:
    """The health stream's input as the driver mode reads it, with Spark's event-time watermark
    (kept in the checkpoint's offsets log, which every run of a batch reads alike), and the
    ticks' rows (every column null) after silver's: silver stays the first source, which
    progress and the backfill's offsets read."""
    model = settings.telemetry
    df = silver.select(*health_input(model))
    if model.sparkplug:  # a node's death (NDEATH) takes its devices offline
        df = df.withColumn("node_death", node_death()).drop("extra")
    df = df.withWatermark("event_time", f"{settings.stream.watermark_seconds} seconds")
    if ticks is None:
        return df
    return df.unionByName(ticks.select(*[F.lit(None).cast(f.dataType).alias(f.name) for f in df.schema]))


class DriverHealthBatch:
    """foreachBatch: score the batch on the driver, then write the four gold tables."""

    def __init__(self, settings: Settings, checkpoint: str, app_id: str,
                 current_columns: list[str] | None = None, wall_clock: bool = False,
                 ticks: bool = False) -> None:
        gold, model = settings.gold, settings.telemetry
        self.gold, self.checkpoint, self.app_id = gold, checkpoint, app_id
        self.cfg = DetectorConfig(threshold=gold.anomaly_threshold)
        self.rules = Rules.of(model)
        self.metrics = self.rules.metrics
        self.timeout_ms = gold.offline_after_seconds * 1000
        self.delay_ms = settings.stream.watermark_seconds * 1000
        self.out_types = dict(c.split() for c in out_schema(self.metrics, self.rules.topics).split(", "))
        self.store = DeviceStateStore(checkpoint, self.metrics, self.cfg, self.rules.topics)
        self.wall_clock = wall_clock
        self.starts = LiveStarts(checkpoint) if wall_clock else None
        if self.starts is not None:
            self.starts.begin(int(time.time() * 1000))
        # a deadline already past is ticked one trigger on: a batch in between re-arms the timer
        trigger_s = settings.stream.gold_trigger_seconds
        trigger_s = settings.stream.trigger_seconds if trigger_s < 0 else trigger_s
        self.timer = TickTimer(checkpoint, max(trigger_s, 0.1)) if wall_clock and ticks else None
        if self.timer is not None and state_files(self.store.dir):
            self.timer.set(0)  # a start ticks once: that batch arms the timer from the state
        self.paths = {t: settings.table_path(t) for t in TABLES}
        # device_current's columns: the model's, and those of metrics removed from it since
        known = {f.name: f.type for f in device_current_schema(model)}
        self.current_schema = pa.schema([(c, known.get(c, pa.float64()))
                                         for c in current_columns or list(known)])
        self.current = CurrentTable(self.paths["device_current"], self.current_schema, app_id)
        self.registry = RegistryJoin(settings)

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        late_wm = batch_watermark_ms(self.checkpoint, batch_id - 1) if batch_id > 0 else 0
        wm = batch_watermark_ms(self.checkpoint, batch_id)
        rows = df.toArrow()
        devs = self.store.begin(batch_id)
        t_us = pc.cast(rows.column("event_time"), pa.int64())
        on_time = pc.fill_null(pc.greater(t_us, late_wm * 1000), False)  # a tick's: null, dropped
        batch = rows.filter(on_time)
        for c in ("event_time", "ingest_time"):
            batch = batch.set_column(batch.schema.get_field_index(c), c,
                                     pc.cast(batch.column(c), pa.timestamp("ns")))
        out = Rows(self.out_types)
        touched = np.zeros(0, dtype=np.int64)
        if batch.num_rows:
            touched = score_readings(batch.to_pandas(), devs, out, self.cfg, self.gold,
                                     self.timeout_ms, self.rules)
        latest = pc.max(t_us).as_py()
        if latest is not None:  # the watermark this batch sets (a no-data batch's, in Spark)
            wm = max(wm, latest // 1000 - self.delay_ms)
        timed_out = time_out(devs, np.ones(len(devs.ids), dtype=bool), wm, self.timeout_ms, out)
        changed = np.union1d(touched, timed_out)
        ticks = rows.column("device_id").null_count  # silver's rows all have a device
        if self.wall_clock:
            now = batch_time_ms(self.checkpoint, batch_id)
            received = pc.max(rows.column("ingest_time")).value  # newest silver row read, us
            if received is not None:
                now = min(now, received // 1000)
            since = self.starts.since(batch_id)
            changed = np.union1d(changed, time_out_received(devs, now, since, self.timeout_ms, out))
        # rows whose registry metadata changed are rewritten too (not their state: unchanged)
        add_current(devs, np.union1d(changed, self.registry.changed_among(devs.ids)), out, self.rules)
        self.store.save(batch_id, changed)  # durable before anything of the batch commits
        if out.parts:
            self.write(df.sparkSession, out, batch_id)
        if self.timer is not None:
            self.timer.set(next_due(devs, self.starts.since(batch_id), self.timeout_ms))
        note_batch(self.app_id, batch_id, state_rows=len(devs.ids),
                   rows_dropped_by_watermark=rows.num_rows - ticks - batch.num_rows)

    def write(self, spark: SparkSession, out: Rows, batch_id: int) -> None:
        """The four tables from the batch's output rows (built here in Arrow: no Spark job
        before the writes), each written exactly once for (query id, batch id), at once."""
        tables = {"readings_scored": scored(out.columns("reading"), self.metrics)}
        observers.publish("gold_scores", tables["readings_scored"])  # the alert engine's anomaly rules
        tables["anomalies"] = tables["readings_scored"].filter(
            pc.fill_null(tables["readings_scored"].column("is_anomaly"), False))
        hist = out.columns("status")
        if "event_time" in hist:  # (none when no device changed status)
            hist["changed_at"] = hist.pop("event_time")
        tables["device_status_history"] = arrow(hist, DEVICE_STATUS_HISTORY)
        cur = out.columns("current")
        now = np.datetime64(pd.Timestamp.now(tz="UTC").tz_localize(None).as_unit("ns"))
        cur["updated_at"] = np.full(len(cur["kind"]), now)
        cur.update(self.registry.arrays(cur.get("device_id", np.zeros(0, dtype=object)), cur.get(SITE)))
        writes = [partial(append_table, spark, t, self.paths[name], self.app_id, batch_id)
                  for name, t in tables.items() if t.num_rows]
        if len(cur["kind"]):
            writes.append(partial(self.current.write, spark, arrow(cur, self.current_schema), batch_id))
        run_at_once(spark, writes)


def arrow(columns: dict[str, np.ndarray], schema: pa.Schema) -> pa.Table:
    """``columns`` of ``schema`` as that schema (a column it lacks: nulls; NaN and NaT: null)."""
    n = len(columns["kind"])
    return pa.table([pa.Array.from_pandas(columns[f.name], type=f.type) if f.name in columns
                     else pa.nulls(n, f.type) for f in schema], schema=schema)


def scored(readings: dict[str, np.ndarray], metrics: tuple[str, ...]) -> pa.Table:
    """``readings_scored``: the output's reading rows unpivoted, one row per present metric
    (as ``gold.state_store.readings_scored`` does in Spark): a record batch per metric, sharing the
    id, device and time columns."""
    n = len(readings["kind"])
    if not n:
        return READINGS_SCORED.empty_table()
    ids = pa.array(readings["event_id"], pa.string())
    devices = pa.array(readings["device_id"], pa.string())
    times = pa.array(readings["event_time"], READINGS_SCORED.field("event_time").type)
    models = pa.array(MODELS, pa.string())

    def floats(x: np.ndarray) -> pa.Array:  # NaN (no value) as null, as pyspark hands it on
        x = x.astype(np.float64, copy=False)
        return pa.array(x, pa.float64(), mask=np.isnan(x))

    batches = []
    for m in metrics:
        value = readings[m].astype(np.float64, copy=False)
        code = readings[f"{m}_model"]  # index into MODELS, NaN: no model yet
        names = pa.DictionaryArray.from_arrays(
            pa.array(np.nan_to_num(code, nan=0.0).astype(np.int32), mask=np.isnan(code)), models)
        batch = pa.record_batch([
            ids, devices, times, pa.repeat(pa.scalar(m, pa.string()), n), pa.array(value, pa.float64()),
            floats(readings[f"{m}_score"]), floats(readings[f"{m}_baseline"]),
            pa.array(readings[f"{m}_anomaly"].astype(bool), pa.bool_()), names.dictionary_decode(),
            floats(readings[f"{m}_low"]), floats(readings[f"{m}_high"])], schema=READINGS_SCORED)
        present = ~np.isnan(value)
        batches.append(batch if present.all() else batch.filter(pa.array(present)))
    return pa.Table.from_batches(batches, schema=READINGS_SCORED)
