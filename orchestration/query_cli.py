"""``iotlake query "SQL"``: ad-hoc DuckDB SQL over the Delta tables, with time travel."""

from __future__ import annotations

import argparse
import json
import sys

import pyarrow as pa
import pyarrow.csv as pacsv

from lakehouse.settings import Settings
from orchestration.query import QueryError, run_query


def format_table(table: pa.Table, fmt: str) -> str:
    """Render a result as an aligned text table, CSV, or JSON records (one array)."""
    if fmt == "csv":
        sink = pa.BufferOutputStream()
        pacsv.write_csv(table, sink)
        return sink.getvalue().to_pybytes().decode()
    if fmt == "json":
        return json.dumps(table.to_pylist(), default=str, indent=1) + "\n"
    if table.num_rows == 0:
        return " | ".join(table.column_names) + "\n(0 rows)\n"
    df = table.to_pandas(maps_as_pydicts="strict")
    return df.to_string(index=False, max_colwidth=60) + f"\n({table.num_rows} rows)\n"


def _run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        result = run_query(settings, args.sql, as_of_version=args.as_of_version,
                           as_of_timestamp=args.as_of_timestamp)
    except QueryError as e:
        print(f"iotlake query: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_table(result, args.format))
    return 0


def add_read_options(p: argparse.ArgumentParser) -> None:
    """``--as-of-version`` / ``--as-of-timestamp`` and ``--format``, shared with ``iotlake sql``."""
    when = p.add_mutually_exclusive_group()
    when.add_argument("--as-of-version", type=int, metavar="N",
                      help="read every table as of Delta version N")
    when.add_argument("--as-of-timestamp", metavar="T",
                      help="read every table as of timestamp T (ISO 8601, e.g. 2024-05-01T12:00:00Z)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "query", help="run DuckDB SQL over the lakehouse tables",
        description="Run SQL (DuckDB dialect) over the Delta tables; tables are addressed by "
                    "their logical names, e.g. SELECT status, count(*) FROM device_current "
                    "GROUP BY status.")
    p.add_argument("sql", help="the SQL query")
    add_read_options(p)
    p.set_defaults(func=_run)
