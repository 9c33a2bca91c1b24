"""``iotlake validate TABLE``: a GX report (result JSON + Data Docs) for one table version,
optionally only one UTC day of its rows."""

from __future__ import annotations

import argparse
from datetime import date

from lakehouse.settings import Settings


def _run(args: argparse.Namespace, settings: Settings) -> int:
    # Imported here: GX takes seconds to import and other subcommands do not need it.
    from silver.validate import format_summary, validate_table

    summary = validate_table(settings, args.table, version=args.version,
                             suite_path=args.suite, out_dir=args.out, day=args.date)
    print(format_summary(summary))
    return 0 if summary["success"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate", help="validate a Delta table with the expectation suite (GX report)",
        description="Exit 0 if every expectation succeeds, 1 if any fails, 2 on bad arguments.")
    p.add_argument("table", help="logical table name, e.g. silver")
    p.add_argument("--version", type=int, help="Delta table version (default: latest)")
    p.add_argument("--date", type=date.fromisoformat, metavar="YYYY-MM-DD",
                   help="only rows whose event_time falls in this UTC day (a daily check)")
    p.add_argument("--suite", help="GX suite JSON (default: telemetry.suite, else the one generated from the model)")
    p.add_argument("--out", help="output directory (default: <data_root>/quality/<table>/<time>)")
    p.set_defaults(func=_run)
