"""device_current's registry columns: each device's labels, registration and site, joined from
the device registry (``lakehouse.device_registry``) as gold writes the device's row.

The registry is read on the driver only when its Delta version moves (a probe of the log per
batch otherwise), never by a Spark job per batch. A device whose registry row changes after its
last reading gets its row rewritten at the health stream's next batch (as does every device at
a process's first batch, which cannot know what the table's rows were joined with): so
device_current shows the registry as of the last batch, not only as of the device's last
reading. The driver mode joins in Arrow (``arrays``), the state-store mode in Spark
(``join``, a broadcast of the registry's rows).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lakehouse.device_registry import Metadata
from lakehouse.settings import Settings
from lakehouse.spark import arrow_frame
from lakehouse.tables import SITE, registry_columns

#: the registry's columns as the Spark join names them (no clash with device_current's)
_JOINED = {"device_id": "device_id", "site": "_registry_site", "labels": "_registry_labels",
           "revoked": "_registry_revoked"}


class RegistryJoin:
    """The registry's rows for device_current, cached by registry version."""

    def __init__(self, settings: Settings) -> None:
        model = settings.telemetry
        self.metadata = Metadata(settings)
        self.names = registry_columns(model).names
        self.topic_site = SITE in model.topic_columns  # the topic's site wins, the registry's fills
        self._frame: tuple[int, DataFrame] | None = None

    def changed(self) -> pa.Array | None:
        """The ids whose registry row changed since the last call (None: every device's may
        have, at the first call)."""
        return self.metadata.refresh()

    def changed_among(self, ids: np.ndarray) -> np.ndarray:
        """Positions in ``ids`` of the devices whose registry row changed since the last call
        (all of them at the first call)."""
        changed = self.changed()
        if changed is None:
            return np.arange(len(ids))
        if not len(changed) or not len(ids):
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(pc.is_in(pa.array(ids, pa.string()), value_set=changed)
                              .to_numpy(zero_copy_only=False))

    def arrays(self, ids: np.ndarray, site: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The registry columns of devices ``ids`` (``site``: their topic's, if it names one)."""
        rows = self.metadata.rows
        at = pc.index_in(pa.array(ids, pa.string()), value_set=rows.column("device_id"))
        found = rows.take(at)
        out = {"labels": _objects(found.column("labels")),
               "registered": pc.is_valid(at).to_numpy(zero_copy_only=False),
               "revoked_at": found.column("revoked").to_numpy().astype("datetime64[ns]")}
        registry_site = _objects(found.column("site"))
        if self.topic_site and site is not None:
            out[SITE] = np.where(pd.isna(site), registry_site, site)
        elif SITE in self.names:
            out[SITE] = registry_site
        return out

    def join(self, spark: SparkSession, cur: DataFrame) -> DataFrame:
        """``cur`` (device_current rows without the registry columns) with them, in Spark."""
        joined = cur.join(F.broadcast(self._rows_frame(spark)), "device_id", "left")
        cols = {"labels": F.col(_JOINED["labels"]),
                "registered": F.coalesce(F.col("_registered"), F.lit(False)),
                "revoked_at": F.col(_JOINED["revoked"])}
        if self.topic_site:
            cols[SITE] = F.coalesce(F.col(SITE), F.col(_JOINED["site"]))
        elif SITE in self.names:
            cols[SITE] = F.col(_JOINED["site"])
        return joined.withColumns(cols).drop(*list(_JOINED.values())[1:], "_registered")

    def _rows_frame(self, spark: SparkSession) -> DataFrame:
        """The registry's rows as a DataFrame, made again only for a new registry version."""
        if self._frame is None or self._frame[0] != self.metadata.version:
            rows = self.metadata.rows.rename_columns([_JOINED[c] for c in self.metadata.rows.column_names])
            rows = rows.append_column("_registered", pa.repeat(pa.scalar(True), rows.num_rows))
            self._frame = (self.metadata.version, arrow_frame(spark, rows))
        return self._frame[1]


def _objects(col: pa.ChunkedArray) -> np.ndarray:
    """A string column as an object array, None for null."""
    return col.to_numpy(zero_copy_only=False).astype(object)
