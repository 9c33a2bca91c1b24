"""Gold device health: per-device anomaly scores and online / degraded / offline status.

One stream whose state (each device's status, hold and detectors) survives restarts in its
checkpoint: held by the driver with ``gold.health_state = "driver"`` (the default:
``gold/device_state.py``), or with ``"state_store"`` in Spark's arbitrary-state operator
(``applyInPandasWithState``, RocksDB: ``gold/state_store.py``). Both score and judge alike,
with the same core (``gold/scoring.py``):

- each reading of each metric is scored by the streaming detector in ``gold/anomaly.py``,
  whose state (one per device and metric) lives in the device's state;
- a reading's status: ``degraded`` when a status rule of the telemetry model fires, the
  device reports its error status, or a metric's anomaly score is high; else ``online``;
- the device's status follows its readings' once held (``gold.scoring._hold``): a change
  between online and degraded takes effect at the reading where the new status has held for
  ``gold.status_hold_readings`` consecutive readings and ``gold.status_hold_seconds`` of event
  time since the first of them (one error report or one breach changes nothing); a death
  certificate takes it offline, and the first reading after offline (or ever) sets it, at once;
- an event-time timeout fires ``offline_after_seconds`` after the device's last reading once
  the watermark (driven by *other* devices' data) passes it: the device goes ``offline``. This
  rule is what replays and backfills use; the driver mode adds a wall-clock rule for live runs
  (a device the pipeline received nothing from for that long goes offline even when no data
  arrives at all, ``gold/ticks.py``). The state store keeps the event-time rule only.

Input: silver through Delta's streaming source. Outputs, written exactly once per micro-batch
(Delta app transaction: query id, batch id): ``readings_scored`` (every scored reading),
``anomalies`` (flagged ones), ``device_status_history`` (every change, at the reading or
deadline it took effect with that reading's reasons) and ``device_current`` (one row per
device: the driver mode replaces the changed devices' rows and rewrites the table, or upserts
them by device; the state store upserts them), whose rows carry the device registry's labels,
registration and site (``gold/registry.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from gold.device_state import DriverHealthBatch, driver_frame
from gold.scoring import health_input
from gold.state_store import HealthBatch, health_frame
from gold.ticks import sources_planned, tick_stream
from gold.windows import silver_stream
from lakehouse.delta.tables import add_missing_columns, ensure_named_table
from lakehouse.settings import Settings
from lakehouse.streams import foreach_batch, pin_mode, pool, query_id, trigger_kwargs
from lakehouse.tables import (
    ANOMALIES,
    DEVICE_STATUS_HISTORY,
    READINGS_SCORED,
    device_current_schema,
)

log = logging.getLogger(__name__)
QUERY = "gold_health"


def start(spark: SparkSession, settings: Settings, trigger: str = "live") -> StreamingQuery:
    settings.telemetry.require_metrics()
    ckpt = settings.checkpoint_path(QUERY)
    mode = settings.gold.health_state
    pin_mode(ckpt, "gold.health_state", mode,
             "state_store" if Path(ckpt, "offsets").exists() else None,  # from before the setting
             "rebuild gold into a new generation (iotlake reprocess)")
    current = device_current_schema(settings.telemetry)
    for name, schema in (("readings_scored", READINGS_SCORED), ("anomalies", ANOMALIES),
                         ("device_status_history", DEVICE_STATUS_HISTORY),
                         ("device_current", current)):
        ensure_named_table(spark, settings, name, schema)
    for name, schema in (("readings_scored", READINGS_SCORED), ("anomalies", ANOMALIES)):
        add_missing_columns(spark, settings.table_path(name), schema)  # tables of older versions
    current_path = settings.table_path("device_current")
    current_columns = add_missing_columns(spark, current_path, current)  # a gold metric added
    silver = silver_stream(spark, settings, columns=health_input(settings.telemetry))
    app_id = query_id(ckpt)
    if mode == "driver":
        ticks = sources_planned(ckpt) != 1  # a checkpoint from before the ticks: silver alone
        if not ticks:
            log.warning("%s was started before the health stream's ticks: when no data arrives at "
                        "all its devices stay as they are (offline only once data comes again); "
                        "rebuild gold into a new generation (iotlake reprocess) to have them go "
                        "offline by the wall clock then", ckpt)
        frame = driver_frame(silver, settings, tick_stream(spark, ckpt) if ticks else None)
        # the wall clock means nothing to a backfill or reprocess: they keep the event-time rule
        batch_fn = DriverHealthBatch(settings, ckpt, app_id, current_columns,
                                     wall_clock=trigger == "live", ticks=ticks)
    else:
        frame, batch_fn = health_frame(silver, settings), HealthBatch(settings, app_id, current_columns)
    writer = (
        foreach_batch(frame, QUERY, batch_fn)
        .outputMode("append")
        .option("checkpointLocation", ckpt)
        .trigger(**trigger_kwargs(settings, trigger, layer="gold"))
    )
    with pool(spark, "gold"):
        return writer.start()
