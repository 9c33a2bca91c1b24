"""Delta streaming sink as a Spark 4 Python Data Source (format ``iotlake_delta``).

Executors write Parquet files straight into the table directory; the driver commits them in one
delta-rs transaction tagged (app id, batch id), so a replayed batch is detected and dropped.
Options: ``path`` (table), ``app_id`` (the streaming query id; see ``lakehouse.streams``),
``ingest_time_column`` (optional: a UTC timestamp column added with the time each task writes).
For an ``s3://`` path the storage options are resolved on the driver (``lakehouse.storage``) and
travel to the executors inside the pickled writer, never as (loggable) Spark options.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from lakehouse import storage
from lakehouse.delta_io import (
    WrittenFile,
    commit_files,
    delete_files,
    ensure_table,
    utc_arrow_schema,
    write_parquet_file,
)


@dataclass
class FilesWritten(WriterCommitMessage):
    files: list[WrittenFile]


class DeltaSinkDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "iotlake_delta"

    def streamWriter(self, schema: StructType, overwrite: bool) -> DeltaStreamWriter:
        from pyspark.sql.pandas.types import to_arrow_schema

        for key in ("path", "app_id"):
            if not self.options.get(key):
                raise ValueError(f"iotlake_delta sink: option '{key}' is required")
        arrow_schema = utc_arrow_schema(to_arrow_schema(schema, timezone="UTC"))
        stamp = self.options.get("ingest_time_column")
        if stamp:
            arrow_schema = arrow_schema.append(pa.field(stamp, pa.timestamp("us", tz="UTC")))
        path = self.options["path"]
        opts = storage.options_for(path)
        ensure_table(path, arrow_schema, storage_options=opts)
        return DeltaStreamWriter(path, self.options["app_id"], arrow_schema, opts, stamp)


class DeltaStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, path: str, app_id: str, schema: pa.Schema,
                 storage_options: dict[str, str] | None = None, stamp: str | None = None) -> None:
        self.path, self.app_id, self.schema = path, app_id, schema
        self.storage_options = storage_options or {}
        self.stamp = stamp

    def __repr__(self) -> str:  # never show credentials
        return f"DeltaStreamWriter({self.path!r}, {self.app_id!r})"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> FilesWritten:
        batches = [b for b in iterator if b.num_rows]
        if not batches:
            return FilesWritten([])
        table = pa.Table.from_batches(batches)
        if self.stamp:
            now = pa.scalar(datetime.now(UTC), pa.timestamp("us", tz="UTC"))
            table = table.append_column(self.stamp, pa.repeat(now, table.num_rows))
        table = table.cast(self.schema)
        return FilesWritten([write_parquet_file(self.path, table, self.storage_options)])

    def commit(self, messages: list[FilesWritten | None], batchId: int) -> None:
        files = [f for m in messages if m for f in m.files]
        commit_files(self.path, files, self.app_id, batchId, storage_options=self.storage_options)

    def abort(self, messages: list[FilesWritten | None], batchId: int) -> None:
        delete_files(self.path, [f for m in messages if m for f in m.files], self.storage_options)
