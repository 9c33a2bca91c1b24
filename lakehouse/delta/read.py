"""Reading Delta tables without a JVM (delta-rs): the dashboard, ``iotlake query``, and drivers
that only need a table's version, existence or rows.

Paths may be local or ``s3://`` URIs; storage options default to those configured for the path
(``lakehouse.storage.options_for``).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import DeltaTable

from lakehouse import storage
from lakehouse.tables import PARTITION_COLUMN, PARTITION_MINUTES_PROPERTY


def _opts(path: str, storage_options: dict[str, str] | None) -> dict[str, str] | None:
    return storage_options if storage_options is not None else storage.options_for(path) or None


def open_table(path: str, version: int | None = None,
               storage_options: dict[str, str] | None = None) -> DeltaTable:
    """``DeltaTable`` (delta-rs) with the storage options configured for ``path``."""
    return DeltaTable(path, version=version, storage_options=_opts(path, storage_options))


def read_table(table_path: str, version: int | None = None, columns: list[str] | None = None,
               storage_options: dict[str, str] | None = None) -> pa.Table:
    return open_table(table_path, version, storage_options).to_pyarrow_table(columns=columns)


def table_exists(table_path: str, storage_options: dict[str, str] | None = None) -> bool:
    """A committed table: delta-spark creates ``_delta_log`` before writing version 0, and a
    reader opening it in between fails. Version 0's commit stays until log cleanup, which only
    runs after a checkpoint."""
    if not storage.is_uri(table_path):
        log_dir = Path(table_path, "_delta_log")
        return log_dir.joinpath(f"{0:020d}.json").exists() or log_dir.joinpath("_last_checkpoint").exists()
    return storage.is_dir(storage.join(table_path, "_delta_log"), _opts(table_path, storage_options))


def latest_version(table_path: str, storage_options: dict[str, str] | None = None,
                   known: int | None = None) -> int:
    """The table's latest version (-1: no table). ``known``, a version known to exist, lets a
    local table be probed forward from there instead of listing a log that grows by every commit."""
    if known is not None and known >= 0 and not storage.is_uri(table_path):
        log_dir = Path(table_path, "_delta_log")
        if log_dir.joinpath(f"{known:020d}.json").exists():
            v = known
            while log_dir.joinpath(f"{v + 1:020d}.json").exists():
                v += 1
            return v
    if storage.is_uri(table_path):
        names = storage.list_names(storage.join(table_path, "_delta_log"), _opts(table_path, storage_options))
        return max((int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit()), default=-1)
    log_dir = Path(table_path, "_delta_log")
    if not log_dir.is_dir():
        return -1
    versions = [int(p.name[:20]) for p in log_dir.glob("*.json") if p.name[:20].isdigit()]
    return max(versions, default=-1)


def commit_adds(table_path: str, version: int,
                storage_options: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """(relative file path, decoded, numRecords) of the files one commit added with dataChange=true (what a
    Delta streaming source reads; compaction's dataChange=false files are not)."""
    log_file = storage.join(table_path, "_delta_log", f"{version:020d}.json")
    adds = []
    for line in storage.read_text(log_file, _opts(table_path, storage_options)).splitlines():
        if not line.strip():
            continue
        add = json.loads(line).get("add")
        if add and add.get("dataChange", True):
            stats = json.loads(add.get("stats") or "{}")
            adds.append((unquote(add["path"]), int(stats.get("numRecords", -1))))  # the log holds URIs
    return adds


def row_count(table_path: str, version: int | None = None) -> int:
    """Rows of the table (0 when it does not exist), from the file statistics where present."""
    if not table_exists(table_path):
        return 0
    dt = open_table(table_path, version)
    return dt.to_pyarrow_dataset().count_rows()


def arrow_dataset(dt: DeltaTable) -> ds.Dataset:
    """Lazy Arrow dataset of a table version; local tables are read with Arrow's native file
    system (delta-rs' default goes through a Python file-system shim)."""
    uri = dt.table_uri
    if uri.startswith("file://") or "://" not in uri:
        root = uri.removeprefix("file://")
        return dt.to_pyarrow_dataset(filesystem=pafs.SubTreeFileSystem(root, pafs.LocalFileSystem()))
    return dt.to_pyarrow_dataset()


def partition_minutes(table_path: str) -> int | None:
    """The time-bucket width a table is partitioned by (``lakehouse.tables.time_partitioning``);
    None for a table created unpartitioned (before iotlake partitioned them, or by another tool)."""
    meta = open_table(table_path).metadata()
    if PARTITION_COLUMN not in meta.partition_columns:
        return None
    return int(meta.configuration.get(PARTITION_MINUTES_PROPERTY, "1440"))
