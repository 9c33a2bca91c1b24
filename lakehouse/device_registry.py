"""The device registry: the ``devices`` Delta table (id, site, labels, created, revoked).

`iotlake devices` writes it with delta-rs (a command without a JVM); silver reads which ids it
holds (``telemetry.require_registered``), as may the dashboard and queries. A revoked device
keeps its row: its readings from before the revocation are still a known device's.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lakehouse import storage
from lakehouse.delta import read as delta_read
from lakehouse.settings import Settings
from lakehouse.tables import DEVICES

TABLE = "devices"
#: lakehouse.delta.tables.TABLE_PROPERTIES (that module needs pyspark): readers without a JVM
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
    """The registry's device ids (``Metadata``'s rows), made again only when the table has a
    new version: the same set object until then."""

    def __init__(self, settings: Settings) -> None:
        self.metadata = Metadata(settings)
        self.version = -2  # not made yet
        self.ids: frozenset[str] = frozenset()

    def current(self) -> frozenset[str]:
        self.metadata.refresh()
        if self.metadata.version != self.version:
            ids = self.metadata.rows.column("device_id").to_pylist()
            self.ids, self.version = frozenset(i for i in ids if i), self.metadata.version
        return self.ids


#: What readers of the registry join to a device (``created`` is the registry's own)
METADATA = ("device_id", "site", "labels", "revoked")


class Metadata:
    """The registry's rows (``METADATA``), read again only when the table has a new version,
    and which devices that version changed: a reader joins them per batch without a read."""

    def __init__(self, settings: Settings) -> None:
        self.path = path(settings)
        self.version = -1
        self.read = False
        self.rows = DEVICES.empty_table().select(list(METADATA))

    def refresh(self) -> pa.Array | None:
        """The ids whose row a new version added, changed or dropped (empty: no new version;
        None at the first read, when what a reader joined before is not known)."""
        v = delta_read.latest_version(self.path, known=self.version if self.version >= 0 else None)
        first, self.read = not self.read, True
        if v == self.version and not first:
            return pa.array([], pa.string())
        rows = (delta_read.read_table(self.path, v, list(METADATA)).select(list(METADATA))
                .cast(self.rows.schema) if v >= 0 else self.rows)
        changed = changed_ids(self.rows, rows)
        self.rows, self.version = rows, v
        return None if first else changed


def changed_ids(old: pa.Table, new: pa.Table) -> pa.Array:
    """The ids of rows in only one of ``old`` and ``new``, or in both with another value."""
    both = old.join(new, "device_id", join_type="full outer", left_suffix="_old", right_suffix="")
    differs = pa.array(np.zeros(both.num_rows, dtype=bool))
    for c in METADATA[1:]:
        a, b = both.column(f"{c}_old"), both.column(c)
        same = pc.or_(pc.and_(pc.is_null(a), pc.is_null(b)), pc.fill_null(pc.equal(a, b), False))
        differs = pc.or_(differs, pc.invert(same))
    return pc.filter(both.column("device_id"), differs).combine_chunks()
