"""Delta sources as Spark 4 Python Data Sources (no delta-spark jars needed).

``iotlake_delta_stream`` is the streaming reader the layers chain on; ``iotlake_delta_batch``
reads one table version (``iotlake sql``'s views), one partition per data file. (The sink is
``iotlake_delta``, in ``lakehouse.delta_sink``.)

Stream offsets are ``{"version": v}``: the last table version fully read (-1 before the first). Each
micro-batch reads the files that commits ``start+1 .. end`` added with ``dataChange=true``;
compaction commits (OPTIMIZE, dataChange=false) are skipped, so compaction never re-delivers
rows. Options: ``path``, ``max_rows_per_trigger``, ``task_rows`` (pack a batch's files into tasks
of about this many rows; 0: a task per file), ``starting_version``. ``path`` may be an
``s3://`` URI: the log and data files are read through ``lakehouse.storage`` (pyarrow.fs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from lakehouse import storage
from lakehouse.partitioning import coalesce


class DeltaFile(InputPartition):
    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version


class DeltaFiles(InputPartition):
    """Several files read by one task (a small batch: see ``lakehouse.partitioning``)."""

    def __init__(self, files: list[DeltaFile]) -> None:
        self.files = files


def commit_adds(table_path: str, version: int,
                storage_options: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """(relative path, numRecords) of files added with dataChange=true by one commit."""
    log_file = storage.join(table_path, "_delta_log", f"{version:020d}.json")
    adds = []
    for line in storage.read_text(log_file, storage_options).splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        add = action.get("add")
        if add and add.get("dataChange", True):
            stats = json.loads(add.get("stats") or "{}")
            adds.append((add["path"], int(stats.get("numRecords", -1))))
    return adds


def latest_version(table_path: str, storage_options: dict[str, str] | None = None,
                   known: int | None = None) -> int:
    """The table's latest version. ``known``, a version known to exist, lets a local table be
    probed forward from there instead of listing a log that grows by every commit."""
    if known is not None and known >= 0 and not storage.is_uri(table_path):
        log_dir = Path(table_path, "_delta_log")
        if log_dir.joinpath(f"{known:020d}.json").exists():
            v = known
            while log_dir.joinpath(f"{v + 1:020d}.json").exists():
                v += 1
            return v
    if storage.is_uri(table_path):
        names = storage.list_names(storage.join(table_path, "_delta_log"), storage_options)
        return max((int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit()), default=-1)
    log_dir = Path(table_path, "_delta_log")
    if not log_dir.is_dir():
        return -1
    versions = [int(p.name[:20]) for p in log_dir.glob("*.json") if p.name[:20].isdigit()]
    return max(versions, default=-1)


class DeltaSourceDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "iotlake_delta_stream"

    def schema(self) -> StructType:
        if not self.options.get("path"):
            raise ValueError("iotlake_delta_stream: option 'path' is required")
        return spark_schema(self.options["path"])

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return DeltaStreamReader(dict(self.options), schema)


class DeltaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.path = options["path"]
        self.max_rows = int(options.get("max_rows_per_trigger", 0)) or None
        self.task_rows = int(options.get("task_rows", 0))
        self.starting = int(options.get("starting_version", -1))
        self.ending = int(options["ending_version"]) if options.get("ending_version") else None
        self.column_names = schema.fieldNames()
        # resolved on the driver; pickled with the reader, so executors need no credentials setup
        self.storage_options = storage.options_for(self.path)
        self._rows: dict[int, int] = {}
        self._target: int | None = None

    def initialOffset(self) -> dict:
        return {"version": self.starting}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_rows) if self.max_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def _latest(self) -> int:
        v = latest_version(self.path, self.storage_options, getattr(self, "_known", None))
        self._known = v
        return v if self.ending is None else min(v, self.ending)

    def _rows_in(self, version: int) -> int:
        if version not in self._rows:
            self._rows[version] = sum(max(n, 0) for _, n in commit_adds(self.path, version, self.storage_options))
        return self._rows[version]

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        latest = self._target if self._target is not None else self._latest()
        begin = start["version"]
        if latest <= begin or not isinstance(limit, ReadMaxRows):
            return {"version": max(latest, begin)}
        rows, v = 0, begin
        while v < latest:
            n = self._rows_in(v + 1)
            if rows and rows + n > limit.max_rows:
                break
            rows += n
            v += 1
        return {"version": v}

    def reportLatestOffset(self) -> dict | None:
        return {"version": self._latest()}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        files: list[DeltaFile] = []
        rows: list[int] = []
        for v in range(start["version"] + 1, end["version"] + 1):
            for p, n in commit_adds(self.path, v, self.storage_options):
                files.append(DeltaFile(self._file(p), v))
                rows.append(n if n >= 0 else self.task_rows)  # unknown count: a task of its own
            self._rows.pop(v, None)
        return [g[0] if len(g) == 1 else DeltaFiles(g) for g in coalesce(files, rows, self.task_rows)]

    def _file(self, relative: str) -> str:
        return storage.join(self.path, relative) if storage.is_uri(self.path) else str(Path(self.path, relative))

    def commit(self, end: dict) -> None:
        pass

    def __repr__(self) -> str:  # never show credentials
        return f"DeltaStreamReader({self.path!r})"

    def read(self, partition: DeltaFile | DeltaFiles) -> Iterator[pa.RecordBatch]:
        for f in getattr(partition, "files", None) or [partition]:
            yield from read_file(f.path, self.column_names, self.storage_options)


def read_file(path: str, column_names: list[str],
              storage_options: dict[str, str] | None) -> Iterator[pa.RecordBatch]:
    """A data file's batches in ``column_names`` order; columns it predates come back null."""
    if storage.is_uri(path):
        fs, key = storage.filesystem(path, storage_options)
        pf = pq.ParquetFile(fs.open_input_file(key))
    else:
        pf = pq.ParquetFile(path)
    names = [n for n in column_names if n in pf.schema_arrow.names]
    for batch in pf.iter_batches(batch_size=65_536, columns=names):
        if len(names) < len(column_names):  # column added later: fill with nulls
            table = pa.Table.from_batches([batch])
            for n in column_names:
                if n not in names:
                    table = table.append_column(n, pa.nulls(batch.num_rows))
            batch = table.select(column_names).combine_chunks().to_batches()[0]
        yield batch


def spark_schema(path: str, version: int | None = None) -> StructType:
    """The table's schema (at ``version``) as Spark sees it; passing it to ``.schema()`` spares
    Spark a Python worker round trip to ask the source."""
    from deltalake import DeltaTable
    from pyspark.sql.pandas.types import from_arrow_schema

    dt = DeltaTable(path, version=version, storage_options=storage.options_for(path) or None)
    return from_arrow_schema(pa.schema(dt.schema().to_arrow()))


class DeltaBatchDataSource(DataSource):
    """Batch read of one table version: options ``path`` and ``version`` (default: latest)."""

    @classmethod
    def name(cls) -> str:
        return "iotlake_delta_batch"

    def schema(self) -> StructType:
        if not self.options.get("path"):
            raise ValueError("iotlake_delta_batch: option 'path' is required")
        version = self.options.get("version")
        return spark_schema(self.options["path"], int(version) if version else None)

    def reader(self, schema: StructType) -> DataSourceReader:
        return DeltaBatchReader(dict(self.options), schema)


class DeltaBatchReader(DataSourceReader):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        from deltalake import DeltaTable

        self.path = options["path"]
        self.storage_options = storage.options_for(self.path)
        version = int(options["version"]) if options.get("version") else None
        dt = DeltaTable(self.path, version=version, storage_options=self.storage_options or None)
        if dt.metadata().partition_columns:  # their values live in the log, not in the files
            raise ValueError(f"iotlake_delta_batch: partitioned tables are not supported ({self.path})")
        self.version = dt.version()  # pinned when the read is planned
        self.files = dt.file_uris()
        self.column_names = schema.fieldNames()

    def partitions(self) -> list[InputPartition]:
        # Spark needs at least one partition; an empty table reads one that yields nothing
        return [DeltaFile(f, self.version) for f in self.files] or [DeltaFile("", self.version)]

    def read(self, partition: DeltaFile) -> Iterator[pa.RecordBatch]:
        return read_file(partition.path, self.column_names, self.storage_options) if partition.path \
            else iter(())

    def __repr__(self) -> str:  # never show credentials
        return f"DeltaBatchReader({self.path!r}@v{self.version})"
