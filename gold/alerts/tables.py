"""The ``alerts`` and ``alerts_current`` Delta tables, written from the engine's log.

Each committed tick with transitions is an entry of ``alerts_log`` (SQLite) numbered ``seq``;
this writer appends its rows to ``alerts`` and replaces ``alerts_current`` with the open alerts
as of that entry, both with the Delta app transaction (engine id, seq), then drops the entry.
A crash between the two leaves the entry for the next start, and Delta skips a seq it holds
already: every transition is in ``alerts`` exactly once. It runs in a thread of its own, so a
slow commit never delays a notification.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession

from gold.alerts import store
from lakehouse.delta.tables import append_table, ensure_named_table, retry_conflicts
from lakehouse.settings import Settings
from lakehouse.spark import arrow_frame
from lakehouse.tables import ALERTS, ALERTS_CURRENT

log = logging.getLogger(__name__)
_TIMES = ("changed_at", "starts_at", "ends_at", "updated_at")


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    def value(name: str, v):
        if name in _TIMES and v is not None:
            return datetime.fromtimestamp(float(v), UTC)
        return v

    return pa.Table.from_pylist([{f.name: value(f.name, r.get(f.name)) for f in schema} for r in rows],
                                schema=schema)


class AlertTables:
    """Writes the engine's log entries to the Delta tables (``flush``; ``run`` in a thread)."""

    def __init__(self, spark: SparkSession, settings: Settings, engine) -> None:
        self.spark, self.engine = spark, engine
        self.paths = {t: settings.table_path(t) for t in ("alerts", "alerts_current")}
        ensure_named_table(spark, settings, "alerts", ALERTS)
        ensure_named_table(spark, settings, "alerts_current", ALERTS_CURRENT)
        self.app_id = f"iotlake-alerts-{engine.engine_id}"
        # its own connection: the engine's thread holds the engine's
        self.conn = store.connect(Path(engine.conn.execute("PRAGMA database_list").fetchone()[2]))

    def flush(self) -> int:
        """Write every entry of the log; returns how many."""
        entries = list(self.conn.execute("SELECT seq, rows, current FROM alerts_log ORDER BY seq"))
        for seq, rows, current in entries:
            rows = json.loads(rows)
            if rows:
                append_table(self.spark, _table(rows, ALERTS), self.paths["alerts"], self.app_id, seq)
            self._replace_current(_table(json.loads(current), ALERTS_CURRENT), seq)
            self.conn.execute("DELETE FROM alerts_log WHERE seq = ?", (seq,))
        return len(entries)

    def _replace_current(self, t: pa.Table, seq: int) -> None:
        w = (arrow_frame(self.spark, t).write.format("delta").mode("overwrite")
             .option("txnAppId", self.app_id).option("txnVersion", str(seq)))
        retry_conflicts(lambda: w.save(self.paths["alerts_current"]), "replace alerts_current")

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.engine.wake.wait(1.0)
            self.engine.wake.clear()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the entry stays in the log for the next try
                log.exception("alerts: writing the alerts tables failed (retried)")
                stop.wait(5.0)
        try:
            self.flush()
        except Exception:  # noqa: BLE001
            log.exception("alerts: final write of the alerts tables failed (written at the next start)")

