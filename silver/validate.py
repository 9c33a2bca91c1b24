"""Validate a Delta table (any version) with Great Expectations itself.

The stream runs the suite compiled to Spark (``silver.expectations``); this is the audit trail:
GX's own validation result JSON and Data Docs HTML for one table version, e.g. after a backfill
or before a time-travel reprocessing; ``day`` restricts it to the rows of one UTC day (the
daily DAG checks yesterday's data, not the whole history again). It runs on pandas, so it reads only the columns the suite
needs; GX on pandas treats NaN as null (the stream treats NaN as a value).
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any

import great_expectations as gx
import pyarrow.dataset as ds
from deltalake import DeltaTable
from great_expectations.checkpoint import UpdateDataDocsAction
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)

from lakehouse.delta.read import table_exists
from lakehouse.settings import Settings
from silver.expectations import suite_for

_SITE = "iotlake"
RESULT_FILE = "validation_result.json"


class ValidationSetupError(ValueError):
    """The table, version or output location is unusable (CLI exit code 2)."""


def _context(out: Path) -> Any:
    """Ephemeral GX context: nothing to set up or clean, Data Docs go to ``out``."""
    cfg = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
        data_docs_sites={_SITE: {
            "class_name": "SiteBuilder", "show_how_to_buttons": False,
            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                              "base_directory": str(out)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        }},
    )
    return gx.get_context(mode="ephemeral", project_config=cfg)


def _open(settings: Settings, table: str, version: int | None) -> DeltaTable:
    path = settings.table_path(table)  # SettingsError for a bad name
    if not table_exists(path):
        raise ValidationSetupError(f"table {table!r} does not exist at {path} (check the name "
                                   "and --data-root; the pipeline creates tables on first write)")
    if version is not None and version < 0:
        raise ValidationSetupError(f"--version must be >= 0, got {version}")
    try:
        return DeltaTable(path) if version is None else DeltaTable(path, version=version)
    except Exception as e:  # deltalake raises several types for a missing version
        raise ValidationSetupError(f"table {table!r}: cannot load version {version}: {e}") from None


def _day_filter(day: date, present: set[str]) -> ds.Expression:
    """Rows whose event time falls in the UTC day ``day`` (a daily job checks one day's data)."""
    if "event_time" not in present:
        raise ValidationSetupError("--date needs an event_time column; this table has none")
    start = datetime.combine(day, time(), UTC)
    return (ds.field("event_time") >= start) & (ds.field("event_time") < start + timedelta(days=1))


def validate_table(settings: Settings, table: str, version: int | None = None,
                   suite_path: str | Path | None = None,
                   out_dir: str | Path | None = None, day: date | None = None) -> dict[str, Any]:
    """Run the suite on ``table`` (at ``version``; only rows with event time in the UTC ``day``
    if given) with GX; write result JSON and Data Docs.

    Returns a JSON-serialisable summary (Airflow XCom friendly): ``success``, ``rows``,
    ``unexpected_counts`` (name -> count, None for aggregate checks) and per-expectation details.
    """
    dt = _open(settings, table, version)
    suite = suite_for(settings.telemetry, suite_path)
    present = {f.name for f in dt.schema().fields}
    columns = [c for c in suite.columns if c in present]  # missing ones: GX reports them
    if day is None:
        pdf = dt.to_pandas(columns=columns or None)
    else:
        pdf = dt.to_pyarrow_dataset().to_table(columns=columns or None,
                                               filter=_day_filter(day, present)).to_pandas()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    out = Path(out_dir) if out_dir else settings.root / "quality" / table / stamp
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValidationSetupError(f"cannot create output directory {out}: {e.strerror}") from None

    ctx = _context(out)
    gx_suite = ctx.suites.add(gx.ExpectationSuite(**copy.deepcopy(dict(suite.raw))))
    names = {e.id: c.name for e, c in zip(gx_suite.expectations, suite.checks, strict=True)}
    label = f"{table}@v{dt.version()}" + (f"-{day.isoformat()}" if day else "")
    batch = (ctx.data_sources.add_pandas(table).add_dataframe_asset(name=table)
             .add_batch_definition_whole_dataframe(label))
    vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=label, data=batch,
                                                                suite=gx_suite))
    checkpoint = ctx.checkpoints.add(gx.Checkpoint(
        name=label, validation_definitions=[vd], result_format="SUMMARY",
        actions=[UpdateDataDocsAction(name="data_docs", site_names=[_SITE])]))
    run = checkpoint.run(batch_parameters={"dataframe": pdf})
    result = next(iter(run.run_results.values())).to_json_dict()
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2, default=str))

    by_name: dict[str, dict[str, Any]] = {}
    for r in result["results"]:
        cfg = r["expectation_config"]
        exc = r.get("exception_info") or {}
        by_name[names[cfg["id"]]] = {
            "type": cfg["type"], "column": cfg["kwargs"].get("column"),
            "success": bool(r["success"]),
            "unexpected_count": r["result"].get("unexpected_count"),
            "observed_value": r["result"].get("observed_value"),
            "error": exc.get("exception_message") if exc.get("raised_exception") else None,
        }
    ordered = {c.name: by_name[c.name] for c in suite.checks}
    return {
        "table": table, "version": dt.version(), "date": day.isoformat() if day else None,
        "rows": len(pdf), "suite": suite.path,
        "success": bool(result["success"]), "out_dir": str(out),
        "result_json": str(out / RESULT_FILE), "data_docs": str(out / "index.html"),
        "unexpected_counts": {n: e["unexpected_count"] for n, e in ordered.items()},
        "expectations": ordered,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """Human summary: one line per expectation with its unexpected count (or observed value)."""
    exps = summary["expectations"]
    failed = sum(not e["success"] for e in exps.values())
    of_day = f" of {summary['date']}" if summary.get("date") else ""
    lines = [f"{summary['table']}@v{summary['version']} ({summary['rows']} rows{of_day}), suite "
             f"{summary['suite']}: {'OK' if not failed else 'FAILED'} "
             f"({failed}/{len(exps)} expectations failed)"]
    for name, e in exps.items():
        if e["error"]:
            what = f"error: {e['error']}"
        elif e["unexpected_count"] is not None:
            what = f"unexpected {e['unexpected_count']}"
        else:
            what = f"observed {e['observed_value']}"
        lines.append(f"  {'ok  ' if e['success'] else 'FAIL'} {name:<28} {what}")
    lines += [f"result: {summary['result_json']}", f"docs:   {summary['data_docs']}"]
    return "\n".join(lines)
