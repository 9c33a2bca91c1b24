"""Ad-hoc SQL over the lakehouse: DuckDB on top of delta-rs, no Spark.

Each table the SQL names is registered as a DuckDB view over ``DeltaTable.to_pyarrow_dataset()``:
the dataset is lazy, so DuckDB pushes projections and filters into the Parquet scan and only
reads what the query needs. DuckDB's own ``delta`` extension is not used: it is downloaded at
run time, which fails offline.
"""

from __future__ import annotations

import re

import duckdb
import pyarrow as pa
from deltalake import DeltaTable

from lakehouse.delta import read as delta_read
from lakehouse.delta.read import arrow_dataset
from lakehouse.settings import Settings
from lakehouse.tables import TABLES


class QueryError(ValueError):
    """The query cannot run (unknown table, bad SQL, missing version); the message says why."""


# String literals and comments: table names inside them are not references.
_NOISE = re.compile(r"'(?:[^']|'')*'|--[^\n]*|/\*.*?\*/", re.S)
_MISSING_TABLE = re.compile(r"Table with name (\S+) does not exist")


def existing_tables(settings: Settings) -> list[str]:
    """Logical tables that have a Delta log under the data root."""
    return [n for n in TABLES if delta_read.table_exists(settings.table_path(n))]


def referenced_tables(sql: str) -> list[str]:
    """Known table names the SQL mentions (as words outside literals and comments)."""
    text = _NOISE.sub(" ", sql).replace('"', " ")
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return [n for n in TABLES if n in words]


def open_table(settings: Settings, name: str, as_of_version: int | None = None,
               as_of_timestamp: str | None = None) -> DeltaTable:
    """Open a logical table, optionally as of a version or timestamp (Delta time travel)."""
    path = settings.table_path(name)
    if not delta_read.table_exists(path):
        raise QueryError(f"table '{name}' has no data yet (no Delta table at {path})")
    try:
        dt = delta_read.open_table(path, as_of_version)  # with the storage options of s3:// paths
        if as_of_timestamp is not None:
            dt.load_as_version(as_of_timestamp)
    except Exception as e:  # delta-rs raises several types for a missing version/bad timestamp
        when = f"version {as_of_version}" if as_of_timestamp is None else f"timestamp {as_of_timestamp!r}"
        raise QueryError(f"table '{name}' has no {when}: {e}") from None
    return dt


def run_query(settings: Settings, sql: str, as_of_version: int | None = None,
              as_of_timestamp: str | None = None) -> pa.Table:
    """Run DuckDB SQL over the lakehouse tables; time travel applies to every table referenced."""
    if as_of_version is not None and as_of_timestamp is not None:
        raise QueryError("give either as_of_version or as_of_timestamp, not both")
    # No file system access from SQL (read_text('/etc/...'), COPY ... TO, ATTACH, INSTALL): the
    # registered Delta tables are Arrow datasets, read by Arrow, so they are all SQL can see.
    con = duckdb.connect(config={"threads": 2, "enable_external_access": False})
    try:
        con.execute("SET TimeZone = 'UTC'")
        for name in referenced_tables(sql):
            if delta_read.table_exists(settings.table_path(name)):
                dt = open_table(settings, name, as_of_version, as_of_timestamp)
                con.register(name, arrow_dataset(dt))
        try:
            rel = con.sql(sql)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.CatalogException as e:
            m = _MISSING_TABLE.search(str(e))
            if m and m.group(1) in TABLES:
                path = settings.table_path(m.group(1))
                raise QueryError(f"table '{m.group(1)}' has no data yet (no Delta table at {path})") from None
            if m:
                known = ", ".join(existing_tables(settings)) or "(none yet)"
                raise QueryError(f"unknown table '{m.group(1)}'; known tables: {known}") from None
            raise QueryError(str(e)) from None
        except duckdb.Error as e:
            raise QueryError(str(e)) from None
    finally:
        con.close()
