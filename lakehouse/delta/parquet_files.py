"""Parquet data files of a Delta table written from an Arrow table the driver holds, with the
statistics Delta records for them.

Silver's and gold's driver-held batches are Arrow tables on the driver already; handing them
to the JVM to become rows and then Parquet costs many times the CPU of pyarrow's writer
(measured on silver's batches). Delta still commits the files (``delta_txn.append_table``).
Statistics follow Delta's rules where this module can match them exactly (strings up to
Delta's prefix length, timestamps, integers, doubles without NaN); any other column gets its
null count only, which costs data skipping on it and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

#: Delta's ``delta.dataSkippingStringPrefixLength`` default: longer strings get truncated
#: bounds in Delta's statistics; here such a column gets none
STRING_PREFIX = 32

#: Spark's ``spark.sql.parquet.compression.codec`` values pyarrow writes the same way, and the
#: file name suffix Spark gives them
CODECS = {"snappy": ("snappy", ".snappy"), "zstd": ("zstd", ".zstd"), "gzip": ("gzip", ".gz"),
          "none": ("none", ""), "uncompressed": ("none", "")}

#: A generated time-bucket partition column (``lakehouse.tables.bucket_sql``)
_BUCKET = re.compile(r"from_unixtime\(unix_timestamp\(`([^`]+)`\) DIV (\d+) \* \2, "
                     r"'(yyyy-MM-dd|yyyy-MM-dd-HHmm)'\)")
_STRFTIME = {"yyyy-MM-dd": "%Y-%m-%d", "yyyy-MM-dd-HHmm": "%Y-%m-%d-%H%M"}
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.-]+$")  # partition values no directory name escapes


class Unsupported(Exception):
    """The table or data needs Delta's own writer (e.g. a partition value it would escape)."""


@dataclass(frozen=True)
class DataFile:
    path: str  # relative to the table's root, as an AddFile names it
    partition_values: dict[str, str]
    size: int
    modification_time: int  # epoch ms
    stats: str
    rows: int

    def add_json(self) -> str:
        """The file as a Delta log ``add`` action."""
        return json.dumps({"add": {"path": self.path, "partitionValues": self.partition_values,
                                   "size": self.size, "modificationTime": self.modification_time,
                                   "dataChange": True, "stats": self.stats}})


def bucket_values(table: pa.Table, expression: str) -> pa.Array:
    """The values Delta computes for a generated time-bucket column (``expression``, as
    ``lakehouse.tables.bucket_sql`` writes it) in a UTC session: the timestamp's seconds divided
    by the bucket width, both divisions truncating toward zero as Spark's do (a time before 1970
    falls in the bucket after), formatted."""
    m = _BUCKET.fullmatch(expression.strip())
    if not m or m.group(1) not in table.column_names:
        raise Unsupported(f"generated column {expression!r}")
    ts = table.column(m.group(1))
    if ts.null_count:
        raise Unsupported("a null partition source")
    width = int(m.group(2))
    seconds = _div(pc.cast(ts, pa.int64()).to_numpy(), 1_000_000)
    start = _div(seconds, width) * width
    uniq, inverse = np.unique(start, return_inverse=True)
    try:
        starts = [datetime.fromtimestamp(int(s), UTC) for s in uniq]
    except (OverflowError, OSError, ValueError) as e:
        raise Unsupported(f"a timestamp outside Python's range: {e}") from e
    if any(not 1000 <= d.year <= 9999 for d in starts):  # Spark pads years, strftime does not
        raise Unsupported("a year outside 1000-9999")
    text = [d.strftime(_STRFTIME[m.group(3)]) for d in starts]
    return pa.array(np.array(text, dtype=object)[inverse], pa.string())


def _div(a: np.ndarray, b: int) -> np.ndarray:
    """Integer division truncating toward zero (Java's ``/``)."""
    return np.sign(a) * (np.abs(a) // b)


def stats_json(table: pa.Table, columns: Sequence[str]) -> str:
    """Delta's statistics of ``table`` as a file: ``numRecords``, and per column of ``columns``
    its null count and, where exact, its minimum and maximum (a column the file lacks: all
    null)."""
    n = table.num_rows
    mins: dict[str, object] = {}
    maxs: dict[str, object] = {}
    nulls: dict[str, int] = {}
    for c in columns:
        if c not in table.column_names:
            nulls[c] = n
            continue
        col = table.column(c)
        nulls[c] = col.null_count
        bounds = _bounds(col) if col.null_count < n else None
        if bounds is not None:
            mins[c], maxs[c] = bounds
    return json.dumps({"numRecords": n, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
                      separators=(",", ":"))


def _bounds(col: pa.ChunkedArray) -> tuple[object, object] | None:
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if pc.max(pc.utf8_length(col)).as_py() > STRING_PREFIX:
            return None  # Delta truncates these; left out rather than guessed
        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()
    if pa.types.is_timestamp(t) and t.tz is not None:
        mm = pc.min_max(pc.cast(pc.cast(col, pa.timestamp("us", tz="UTC")), pa.int64()))
        return _iso_ms(mm["min"].as_py()), _iso_ms(mm["max"].as_py())  # Delta keeps milliseconds
    if pa.types.is_integer(t):
        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()
    if pa.types.is_float64(t):  # a float32's bounds would print longer than Delta's
        if pc.any(pc.is_nan(col)).as_py():
            return None
        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()
    return None


def _iso_ms(us: int) -> str:
    ms = us // 1000  # floor, as Delta truncates
    return datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


def write_files(table: pa.Table, root: str, partition_column: str | None,
                partition_values: pa.Array | None, stats_columns: Sequence[str],
                codec: str = "snappy", plain: Sequence[str] = ()) -> list[DataFile]:
    """Write ``table`` under the table directory ``root``: one Parquet file per partition value
    (in its ``column=value`` directory, without the partition column), each with its statistics.
    ``plain``: columns written without dictionary encoding (the table's
    ``parquet.enable.dictionary#<column>`` properties)."""
    if codec not in CODECS:
        raise Unsupported(f"Parquet codec {codec!r}")
    compression, suffix = CODECS[codec]
    groups: list[tuple[dict[str, str], pa.Table]] = [({}, table)]
    if partition_column is not None:
        keys = pc.unique(partition_values).to_pylist()
        if any(not _SAFE_VALUE.match(k) for k in keys):
            raise Unsupported("a partition value Delta would escape")
        groups = [({partition_column: k}, table if len(keys) == 1 else
                   table.filter(pc.equal(partition_values, k))) for k in keys]
    dictionary = [c for c in table.column_names if c not in set(plain)]
    out = []
    for values, part in groups:
        rel = "/".join([*(f"{k}={v}" for k, v in values.items()),
                        f"part-00000-{uuid.uuid4()}.c000{suffix}.parquet"])
        full = Path(root, rel)
        full.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, full, compression=compression, use_dictionary=dictionary,
                       coerce_timestamps="us", write_statistics=True)
        st = os.stat(full)
        out.append(DataFile(rel, values, st.st_size, st.st_mtime_ns // 1_000_000,
                            stats_json(part, stats_columns), part.num_rows))
    return out
