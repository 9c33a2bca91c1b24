"""Exactly-once Delta commits with delta-rs.

Every streaming micro-batch commits with a Delta *app transaction* (app id = streaming query id,
version = batch id). ``DeltaTable.transaction_version(app_id)`` tells what was already committed,
so a batch Spark replays after a crash is skipped instead of written twice.

Table paths may be local or ``s3://`` URIs: ``storage_options`` default to those configured for
the path (``lakehouse.storage.options_for``), and data files go through ``pyarrow.fs``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction

from lakehouse import storage

log = logging.getLogger(__name__)

_STATS_TYPES = (pa.types.is_integer, pa.types.is_floating, pa.types.is_timestamp, pa.types.is_string,
                pa.types.is_date, pa.types.is_boolean)


def utc_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """Delta timestamps are UTC microseconds; normalise Spark's session-zone timestamps."""

    def fix(t: pa.DataType) -> pa.DataType:
        if pa.types.is_timestamp(t):
            return pa.timestamp("us", tz="UTC")
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, fix(f.type), f.nullable) for f in t])
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return pa.list_(fix(t.value_type))
        if pa.types.is_map(t):
            return pa.map_(fix(t.key_type), fix(t.item_type))
        return t

    return pa.schema([pa.field(f.name, fix(f.type), True) for f in schema])


def _opts(path: str, storage_options: dict[str, str] | None) -> dict[str, str] | None:
    return storage_options if storage_options is not None else storage.options_for(path) or None


def open_table(path: str, version: int | None = None,
               storage_options: dict[str, str] | None = None) -> DeltaTable:
    """``DeltaTable`` with the storage options configured for ``path``."""
    return DeltaTable(path, version=version, storage_options=_opts(path, storage_options))


# ---- one cached handle per table for the writers of this process -----------------------------
# Opening a table replays its log since the last checkpoint (up to 100 JSON commits: 30-60 ms),
# and a micro-batch used to open each table it commits to twice. A kept handle is brought up to
# date with ``update_incremental()`` (reads only the commits made since; 0.5 ms when there are
# none) and delta-rs moves it forward itself on every commit made through it.
_handles: dict[tuple, DeltaTable] = {}
_handle_locks: dict[tuple, threading.RLock] = {}
_registry = threading.Lock()


def _handle_key(path: str, opts: dict[str, str] | None) -> tuple:
    return path, tuple(sorted((opts or {}).items()))


@contextmanager
def latest_table(path: str, storage_options: dict[str, str] | None = None) -> Iterator[DeltaTable]:
    """This process's handle on ``path`` at the table's latest version, held exclusively (a
    delta-rs handle must not be used by two threads at once) for one read-check-commit.

    An exception inside drops the handle, so a failed or conflicting commit starts over from a
    freshly opened table.
    """
    opts = _opts(path, storage_options)
    key = _handle_key(path, opts)
    with _registry:
        lock = _handle_locks.setdefault(key, threading.RLock())
    with lock:
        dt = _handles.pop(key, None)
        if dt is not None:
            try:
                dt.update_incremental()
            except Exception:  # noqa: BLE001 - e.g. the table went away: open it afresh
                dt = None
        if dt is None:
            dt = DeltaTable(path, storage_options=opts)
        yield dt
        _handles[key] = dt  # only after the block succeeded


def forget_table(path: str) -> None:
    """Drop this process's cached handles on ``path`` (the table was deleted or recreated)."""
    with _registry:
        for key in [k for k in _handles if k[0] == path]:
            _handles.pop(key, None)


def ensure_table(path: str, schema: pa.Schema, partition_by: list[str] | None = None,
                 storage_options: dict[str, str] | None = None) -> DeltaTable:
    """Open the table, creating it empty with ``schema`` if it does not exist yet."""
    opts = _opts(path, storage_options)
    try:
        return DeltaTable(path, storage_options=opts)
    except TableNotFoundError:
        forget_table(path)
        if not storage.is_uri(path):
            Path(path).mkdir(parents=True, exist_ok=True)
        try:
            return DeltaTable.create(path, utc_arrow_schema(schema), partition_by=partition_by,
                                     configuration={"delta.appendOnly": "false"}, storage_options=opts)
        except Exception:  # another writer created it first
            return DeltaTable(path, storage_options=opts)


def _ensure_cached(path: str, schema: pa.Schema, opts: dict[str, str] | None) -> None:
    """``ensure_table`` unless this process already holds a handle on the table."""
    if _handle_key(path, opts) not in _handles:
        ensure_table(path, schema, storage_options=opts)


def committed_version(dt: DeltaTable, app_id: str) -> int:
    v = dt.transaction_version(app_id)
    return -1 if v is None else v


def _stats(table: pa.Table) -> str:
    mins, maxs, nulls = {}, {}, {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        nulls[name] = col.null_count
        if not any(check(col.type) for check in _STATS_TYPES) or col.null_count == len(col):
            continue
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if pa.types.is_timestamp(col.type):
            lo, hi = lo.isoformat().replace("+00:00", "Z"), hi.isoformat().replace("+00:00", "Z")
        elif pa.types.is_date(col.type):
            lo, hi = lo.isoformat(), hi.isoformat()
        elif pa.types.is_floating(col.type) and (lo != lo or hi != hi):  # NaN present
            continue
        elif pa.types.is_string(col.type):
            lo, hi = lo[:32], None if len(hi) > 32 else hi
            if hi is None:
                continue
        mins[name], maxs[name] = lo, hi
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs,
                       "nullCount": nulls}, default=str)


@dataclass
class WrittenFile:
    path: str  # relative to the table root
    size: int
    rows: int
    stats: str

    def action(self) -> AddAction:
        return AddAction(self.path, self.size, {}, int(time.time() * 1000), True, self.stats)


def write_parquet_file(table_path: str, data: pa.Table,
                       storage_options: dict[str, str] | None = None) -> WrittenFile:
    """Write one data file into the table directory (not yet committed: invisible to readers).

    zstd level 1 writes about as fast as snappy and makes bronze's JSON payload files ~3x smaller.
    """
    name = f"part-{uuid.uuid4().hex}.zstd.parquet"
    full = storage.join(table_path, name)
    if not storage.is_uri(full):
        pq.write_table(data, full, compression="zstd", compression_level=1, write_statistics=True)
        return WrittenFile(name, os.path.getsize(full), data.num_rows, _stats(data))
    fs, key = storage.filesystem(full, _opts(full, storage_options))
    pq.write_table(data, key, compression="zstd", compression_level=1, write_statistics=True,
                   filesystem=fs)
    return WrittenFile(name, fs.get_file_info(key).size, data.num_rows, _stats(data))


def delete_files(table_path: str, files: list[WrittenFile],
                 storage_options: dict[str, str] | None = None) -> None:
    """Remove uncommitted data files (a replayed or aborted batch)."""
    for f in files:
        full = storage.join(table_path, f.path)
        if storage.is_uri(full):
            storage.delete(full, _opts(full, storage_options))
        else:
            Path(full).unlink(missing_ok=True)


def commit_files(table_path: str, files: list[WrittenFile], app_id: str, batch_id: int,
                 retries: int = 20, storage_options: dict[str, str] | None = None) -> bool:
    """Commit files written by ``write_parquet_file`` once for (app_id, batch_id).

    Returns False (and removes the files) when that batch is already committed.
    """
    opts = _opts(table_path, storage_options)
    for attempt in range(retries):
        try:
            with latest_table(table_path, opts) as dt:
                if committed_version(dt, app_id) >= batch_id:
                    delete_files(table_path, files, opts)
                    log.info("batch %s of %s already committed to %s; skipped", batch_id, app_id,
                             table_path)
                    return False
                dt.create_write_transaction(
                    [f.action() for f in files], mode="append", schema=dt.schema(),
                    commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]),
                )
                return True
        except CommitFailedError:
            if attempt == retries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return False


def _retry_conflicts(fn, retries: int = 20):
    """Run a commit, retrying when a concurrent writer (e.g. compaction) won the race."""
    for attempt in range(retries):
        try:
            return fn()
        except CommitFailedError:
            if attempt == retries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def append_arrow(table_path: str, data: pa.Table | Iterable[pa.RecordBatch], app_id: str,
                 batch_id: int, schema: pa.Schema | None = None,
                 storage_options: dict[str, str] | None = None) -> bool:
    """Driver-side exactly-once append (used by foreachBatch stages)."""
    if not isinstance(data, pa.Table):
        data = pa.Table.from_batches(list(data), schema=schema)
    target = utc_arrow_schema(data.schema)
    data = data.cast(target)
    opts = _opts(table_path, storage_options)
    _ensure_cached(table_path, target, opts)

    def commit() -> bool:
        with latest_table(table_path, opts) as dt:
            if committed_version(dt, app_id) >= batch_id:
                return False
            write_deltalake(
                dt, data, mode="append", schema_mode="merge",
                commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]),
            )
            return True

    return _retry_conflicts(commit)


@dataclass
class MergeSpec:
    """Upsert keyed by ``keys``: matched rows are updated, others inserted."""

    keys: list[str]
    update_columns: list[str] = field(default_factory=list)


def merge_arrow(table_path: str, data: pa.Table, spec: MergeSpec, app_id: str, batch_id: int,
                storage_options: dict[str, str] | None = None) -> bool:
    """Exactly-once MERGE (upsert) of a micro-batch; a replayed batch is skipped."""
    target = utc_arrow_schema(data.schema)
    data = data.cast(target)
    opts = _opts(table_path, storage_options)
    _ensure_cached(table_path, target, opts)
    predicate = " AND ".join(f"t.{k} = s.{k}" for k in spec.keys)
    cols = spec.update_columns or [c for c in data.column_names if c not in spec.keys]

    def commit() -> bool:
        with latest_table(table_path, opts) as dt:
            if committed_version(dt, app_id) >= batch_id:
                return False
            (
                dt.merge(data, predicate, source_alias="s", target_alias="t",
                         commit_properties=CommitProperties(app_transactions=[Transaction(app_id, batch_id)]))
                .when_matched_update({c: f"s.{c}" for c in cols})
                .when_not_matched_insert_all()
                .execute()
            )
            return True

    return _retry_conflicts(commit)


def read_table(table_path: str, version: int | None = None, columns: list[str] | None = None,
               storage_options: dict[str, str] | None = None) -> pa.Table:
    return open_table(table_path, version, storage_options).to_pyarrow_table(columns=columns)


def table_exists(table_path: str, storage_options: dict[str, str] | None = None) -> bool:
    if not storage.is_uri(table_path):
        return Path(table_path, "_delta_log").is_dir()
    return storage.is_dir(storage.join(table_path, "_delta_log"), _opts(table_path, storage_options))
