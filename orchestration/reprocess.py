"""Time-travel reprocessing: rebuild silver and gold from bronze as of a version or timestamp.

E.g. after fixing an expectation suite or the anomaly configuration. The rebuild goes into a
new *generation* (its own tables and fresh checkpoints, named after the bronze version, so a
rerun resumes or reuses it), is validated (row accounting against bronze as of that version,
plus the expectation suite), and only then are readers switched to it by atomically replacing
``CURRENT_GENERATION``. Silver reads bronze with Delta's streaming source under
``Trigger.AvailableNow``, keeping the rows bronze held at that version (``silver.stream``'s
``bronze_ending_version``). Bronze itself is never rewritten. Known limit (docs/guarantees.md):
Delta's streaming source has no ending version, so the rebuild's checkpoint ends at bronze's
latest version; live streams that continue the new generation skip bronze rows committed after
version N and before the rebuild. Each query's progress and the rows it read are counted and
shown as a backfill's are (``orchestration.progress``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from datetime import datetime
from pathlib import Path

from lakehouse.delta.read import open_table, row_count, table_exists
from lakehouse.settings import DERIVED_QUERIES, Settings

log = logging.getLogger(__name__)


def resolve_bronze_version(settings: Settings, version: int | None, timestamp: str | None) -> int:
    if (version is None) == (timestamp is None):
        raise ValueError("give exactly one of --as-of-version or --as-of-timestamp")
    path = settings.table_path("bronze")
    if not table_exists(path):
        raise ValueError(f"no bronze table at {path}")
    dt = open_table(path)
    if version is not None:
        if not 0 <= version <= dt.version():
            raise ValueError(f"bronze has versions 0..{dt.version()}; {version} does not exist")
        return version
    try:
        when = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--as-of-timestamp {timestamp!r} is not ISO-8601 (e.g. 2026-11-21T12:00:00Z)") from None
    dt.load_as_version(when)
    return dt.version()


def _bronze_rows(settings: Settings, version: int) -> int:
    return row_count(settings.table_path("bronze"), version)


def _rows(path: str) -> int:
    return row_count(path)


def plan(settings: Settings, bronze_version: int) -> dict:
    """What a reprocess would do (the dry run)."""
    gen = f"v{bronze_version}"
    tables = ("silver", "quarantine", "gold_metrics_1m", "device_current")
    return {
        "bronze_version": bronze_version,
        "bronze_rows_as_of": _bronze_rows(settings, bronze_version),
        "bronze_rows_now": _rows(settings.table_path("bronze")),
        "current_generation": settings.generation() or "(original)",
        "new_generation": gen,
        "new_generation_exists": Path(settings.pinned(gen).table_path("silver")).exists(),
        "current_rows": {t: _rows(settings.table_path(t)) for t in tables},
        "new_rows": {t: _rows(settings.pinned(gen).table_path(t)) for t in tables},
    }


def _accounting(settings: Settings) -> dict[str, int]:
    from orchestration.run import _quality_totals

    return _quality_totals(settings)


def reprocess(settings: Settings, version: int | None = None, timestamp: str | None = None,
              dry_run: bool = False, switch: bool = True) -> dict:
    from lakehouse.streams import lock_checkpoint, release_checkpoints

    v = resolve_bronze_version(settings, version, timestamp)
    report = plan(settings, v)
    if dry_run:
        report["dry_run"] = True
        return report
    gen = report["new_generation"]
    target = settings.pinned(gen)
    # refuse while live streams of the current generation run (they would keep writing there)
    for q in (*DERIVED_QUERIES, "bronze_silver"):  # the fused topology's query writes silver
        lock_checkpoint(settings.checkpoint_path(q))
    try:
        report["rows_read"] = _build(target, v)
    finally:
        release_checkpoints()
    acct = _accounting(target)
    expected = report["bronze_rows_as_of"]
    got = sum(acct.get(k, 0) for k in ("silver", "quarantine", "duplicates", "late"))
    report["accounting"] = acct
    if got != expected or acct.get("rows_in", 0) != expected:
        raise RuntimeError(f"generation {gen} does not account for bronze as of version {v}: "
                           f"{got} rows routed, {acct.get('rows_in', 0)} read, {expected} expected; "
                           "readers not switched")
    report["validation"] = _validate(target)
    report["new_rows"] = {t: _rows(target.table_path(t)) for t in report["new_rows"]}
    if switch:
        switch_generation(settings, gen)
        report["switched_to"] = gen
    return report


def _build(target: Settings, bronze_version: int) -> dict[str, int]:
    """Run the generation's queries to their end, one at a time; returns the rows each read
    (silver: every bronze row it read, those after ``bronze_version`` dropped by its filter)."""
    import gold.health
    import gold.windows
    import silver.stream
    from lakehouse import storage
    from lakehouse.monitoring.metrics import BatchTotals
    from lakehouse.spark import spark_session
    from orchestration.backfill import caught_up, rows_to_do
    from orchestration.progress import follow

    storage.configure(target)  # as spark_session would, before reading remote checkpoints' tables
    if caught_up(target, "silver", bronze_version) and caught_up(target, "gold"):
        log.info("generation already built from bronze version %d", bronze_version)
        return {"silver": 0, "gold_metrics_1m": 0, "gold_health": 0}  # a rerun: no Spark for nothing
    spark = spark_session(target, app_name="iotlake-reprocess", batch=True)
    totals = BatchTotals()
    spark.streams.addListener(totals)
    read: dict[str, int] = {}
    try:
        for name, layer, start in (
                ("silver", "silver", lambda: silver.stream.start(
                    spark, target, trigger="available_now", bronze_ending_version=bronze_version)),
                ("gold_metrics_1m", "gold", lambda: gold.windows.start(spark, target, trigger="available_now")),
                ("gold_health", "gold", lambda: gold.health.start(spark, target, trigger="available_now"))):
            todo = rows_to_do(target, layer, name)
            q = start()
            read[name], _ = follow(totals, q, [q], f"reprocess {name}", todo)
            if q.exception():
                raise RuntimeError(f"reprocess {q.name} failed: {q.exception()}")
    finally:
        spark.streams.removeListener(totals)
    return read


def _validate(target: Settings) -> dict:
    from silver.validate import validate_table

    summary = validate_table(target, "silver")
    return {"success": summary["success"], "unexpected_counts": summary["unexpected_counts"]}


def switch_generation(settings: Settings, generation: str) -> None:
    """Point readers at ``generation`` atomically (write a temp file, then rename over)."""
    f = settings.root / "CURRENT_GENERATION"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(generation + "\n")
    os.replace(tmp, f)
    log.info("readers now use generation %s", generation or "(original)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reprocess", help="rebuild silver and gold from bronze as of a version/time")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--as-of-version", type=int, metavar="N")
    g.add_argument("--as-of-timestamp", metavar="T", help="ISO-8601, e.g. 2026-11-21T12:00:00Z")
    p.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    p.add_argument("--no-switch", action="store_true", help="build and validate, keep readers where they are")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace, settings: Settings) -> int:
    report = reprocess(settings, args.as_of_version, args.as_of_timestamp, args.dry_run,
                       switch=not args.no_switch)
    print(json.dumps(report, default=str))
    return 0
