"""``iotlake compact | vacuum | restore | history``, and ``run_iotlake`` for orchestrators.

Each command prints one JSON object per table (or per commit for ``history``), so a scheduler's
log is both readable and parseable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lakehouse.settings import MIN_RETENTION_HOURS, Settings, load_settings

log = logging.getLogger(__name__)


def _print(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        print(json.dumps(row, default=str, sort_keys=True))


def _guarded(func: Callable[[argparse.Namespace, Settings], int]) -> Callable[..., int]:
    """Storage, Spark and Delta failures become one clear line and exit 1 (bad input stays
    exit 2)."""

    def run(args: argparse.Namespace, settings: Settings) -> int:
        from deltalake.exceptions import DeltaError
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException

        try:
            return func(args, settings)
        except (DeltaError, OSError, PySparkException, Py4JError) as e:
            first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
            print(f"iotlake {args.command}: {type(e).__name__}: {first}", file=sys.stderr)
            return 1

    return run


def _compact(args: argparse.Namespace, settings: Settings) -> int:
    from orchestration.maintenance import compact

    _print(compact(settings, args.table, target_size=args.target_size,
                   zorder=False if args.no_zorder else None))
    return 0


def _vacuum(args: argparse.Namespace, settings: Settings) -> int:
    from orchestration.maintenance import vacuum

    _print(vacuum(settings, args.table, retention_hours=args.retention_hours, dry_run=args.dry_run,
                  enforce_retention_duration=not args.force))
    return 0


def _retain(args: argparse.Namespace, settings: Settings) -> int:
    from orchestration.maintenance import retain

    _print(retain(settings, args.table))
    return 0


def _restore(args: argparse.Namespace, settings: Settings) -> int:
    from orchestration.maintenance import restore

    _print([restore(settings, args.table, version=args.version, timestamp=args.timestamp)])
    return 0


def _history(args: argparse.Namespace, settings: Settings) -> int:
    from orchestration.maintenance import table_history

    _print(table_history(settings, args.table, limit=args.limit))
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the table-maintenance subcommands to the ``iotlake`` parser."""
    table_help = "table name (repeatable; default: every existing table)"
    p = subparsers.add_parser("compact", help="OPTIMIZE: bin-pack small files (and ZORDER BY) in Delta tables")
    p.add_argument("--table", action="append", metavar="T", help=table_help)
    p.add_argument("--no-zorder", action="store_true", help="bin-packing only, never Z-order")
    p.add_argument("--target-size", type=_positive, metavar="BYTES",
                   help="target file size (default: maintenance.target_file_size)")
    p.set_defaults(func=_guarded(_compact))

    p = subparsers.add_parser("vacuum", help="delete files older versions no longer need")
    p.add_argument("--table", action="append", metavar="T", help=table_help)
    p.add_argument("--retention-hours", type=_positive, metavar="H",
                   help="keep files needed by versions newer than H hours "
                        "(default: maintenance.vacuum_retention_hours)")
    p.add_argument("--dry-run", action="store_true", help="list files, delete nothing")
    p.add_argument("--force", action="store_true",
                   help=f"allow a retention below {MIN_RETENTION_HOURS} h (a query or backfill "
                        "reading the table could lose files)")
    p.set_defaults(func=_guarded(_vacuum))

    p = subparsers.add_parser("retain", help="delete rows older than each table's "
                              "maintenance.retention_days (tables without one are kept whole)")
    p.add_argument("--table", action="append", metavar="T", help=table_help)
    p.set_defaults(func=_guarded(_retain))

    p = subparsers.add_parser("restore", help="restore a table to an older version or time")
    p.add_argument("table", metavar="TABLE")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--version", type=_positive, metavar="N")
    target.add_argument("--timestamp", metavar="T", help="ISO 8601, e.g. 2024-05-01T12:00:00Z")
    p.set_defaults(func=_guarded(_restore))

    p = subparsers.add_parser("history", help="commit history of a table, newest first")
    p.add_argument("table", metavar="TABLE")
    p.add_argument("--limit", type=_positive, metavar="N", help="newest N commits only")
    p.set_defaults(func=_guarded(_history))


#: IOTLAKE_* variables that are not settings (``load_settings`` reads every other IOTLAKE_<KEY>
#: as one and rejects unknown keys).
_NOT_SETTINGS = ("IOTLAKE_BIN", "IOTLAKE_TEST_")


def settings_environ() -> dict[str, str]:
    """``os.environ`` without the iotlake variables that only configure tooling."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_NOT_SETTINGS)}


def task_settings() -> Settings:
    """Settings for a scheduler task: ``$IOTLAKE_CONFIG`` + env, ignoring ``$IOTLAKE_BIN``."""
    return load_settings(environ=settings_environ())


def iotlake_bin() -> str:
    """``$IOTLAKE_BIN``, else the ``iotlake`` script of this interpreter's venv, else PATH.

    Airflow workers may run with a bare PATH; the venv's script is the one matching this code.
    """
    if os.environ.get("IOTLAKE_BIN"):
        return os.environ["IOTLAKE_BIN"]
    beside = Path(sys.executable).with_name("iotlake")
    if beside.exists():
        return str(beside)
    return shutil.which("iotlake") or "iotlake"


def run_iotlake(*args: str) -> int:
    """Run ``iotlake ARGS`` (config from ``$IOTLAKE_CONFIG``), logging its output; exit code.

    Arguments go as a list, never through a shell, so DAG params cannot inject commands.
    """
    cmd = [iotlake_bin(), *args]
    log.info("running %s (IOTLAKE_CONFIG=%s)", cmd, os.environ.get("IOTLAKE_CONFIG", "-"))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=settings_environ()) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.info("%s", line.rstrip())
    log.info("%s exited %s", cmd[0], proc.returncode)
    return proc.returncode


def run_iotlake_task(*args: str) -> None:
    """An Airflow task's run of ``iotlake ARGS``: exit 2 (bad arguments or configuration) fails
    the task without retrying, any other failure raises (Airflow retries)."""
    from airflow.sdk.exceptions import AirflowFailException

    rc = run_iotlake(*args)
    if rc == 2:
        raise AirflowFailException(f"iotlake {args[0]}: invalid arguments or configuration")
    if rc:
        raise RuntimeError(f"iotlake {args[0]} failed with exit code {rc}")
