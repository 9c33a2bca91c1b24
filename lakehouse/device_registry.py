"""The device registry: the ``devices`` Delta table (id, site, labels, created, revoked).

`iotlake devices` writes it with delta-rs (a command without a JVM); silver reads which ids it
holds (``telemetry.require_registered``), as may the dashboard and queries. A revoked device
keeps its row: its readings from before the revocation are still a known device's.
"""

from __future__ import annotations

import pyarrow as pa

from lakehouse import delta_read, storage
from lakehouse.settings import Settings
from lakehouse.tables import DEVICES

TABLE = "devices"
#: lakehouse.delta_tables.TABLE_PROPERTIES (that module needs pyspark): readers without a JVM
#: read the table
_PROPERTIES = {"delta.enableDeletionVectors": "false", "delta.checkpointPolicy": "classic"}


def path(settings: Settings) -> str:
    return settings.table_path(TABLE)


def read(settings: Settings) -> pa.Table:
    """Every registered device (revoked ones too); empty before the first."""
    p = path(settings)
    if not delta_read.table_exists(p):
        return DEVICES.empty_table()
    return delta_read.read_table(p).select(DEVICES.names).cast(DEVICES)


def upsert(settings: Settings, rows: pa.Table) -> None:
    """Insert or replace these devices' rows, by ``device_id``, in one commit."""
    from deltalake import write_deltalake

    p, rows = path(settings), rows.select(DEVICES.names).cast(DEVICES)
    opts = storage.options_for(p) or None
    if not delta_read.table_exists(p):
        write_deltalake(p, rows, mode="append", configuration=_PROPERTIES, storage_options=opts)
        return
    (delta_read.open_table(p).merge(rows, predicate="t.device_id = s.device_id", source_alias="s",
                                    target_alias="t")
     .when_matched_update_all().when_not_matched_insert_all().execute())


class Registered:
    """The registry's device ids, read again only when the table has a new version."""

    def __init__(self, settings: Settings) -> None:
        self.path = path(settings)
        self.version = -1
        self.ids: frozenset[str] = frozenset()

    def current(self) -> frozenset[str]:
        v = delta_read.latest_version(self.path, known=self.version if self.version >= 0 else None)
        if v != self.version:
            ids = delta_read.read_table(self.path, v, ["device_id"]).column(0).to_pylist() if v >= 0 else []
            self.ids, self.version = frozenset(i for i in ids if i), v
        return self.ids
