"""The ``iotlake`` command line. Each subcommand lives in the module that does the work and
registers itself through a ``register(subparsers)`` function listed in ``COMMAND_MODULES``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from lakehouse import storage
from lakehouse.settings import SettingsError, load_settings
from lakehouse.streams import CheckpointBusy

#: Modules that contribute subcommands (each has ``register(subparsers) -> None``; the
#: parser it adds sets ``func(args, settings) -> int``).
COMMAND_MODULES = [
    "orchestration.run",
    "orchestration.backfill",
    "orchestration.reprocess",
    "orchestration.maintenance_cli",
    "silver.cli",
    "silver.default_suite",
    "orchestration.query_cli",
    "orchestration.sql_cli",
    "orchestration.status_cli",
    "dashboard.cli",
    "ingest.cli",
    "orchestration.cluster",
    "orchestration.alerts_cli",
    "orchestration.devices_cli",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iotlake", description="IoT device-monitoring lakehouse")
    p.add_argument("--config", help="settings file (default: ./iotlake.toml or $IOTLAKE_CONFIG)")
    p.add_argument("--data-root", help="override data_root from the settings")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("py4j", "urllib3", "great_expectations"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        overrides = {"data_root": args.data_root} if args.data_root else {}
        settings = load_settings(args.config, **overrides)
    except SettingsError as e:
        print(f"iotlake: {e}", file=sys.stderr)
        return 2
    # Every command (query, compact, dashboard...) reads s3:// tables with the configured
    # credentials, not only those that start Spark.
    storage.configure(settings)
    try:
        return int(args.func(args, settings) or 0)
    except KeyboardInterrupt:
        return 130
    except (SettingsError, ValueError) as e:
        print(f"iotlake: {e}", file=sys.stderr)
        return 2
    except CheckpointBusy as e:
        print(f"iotlake: refused: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
