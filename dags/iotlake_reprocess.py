"""Manual time-travel reprocessing: rebuild downstream layers from a table version or time.

Runs ``iotlake reprocess --as-of-version N`` (or ``--as-of-timestamp T``); ``dry_run`` (default
on) only reports what would be rewritten, so a stray click changes nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import Param, dag, task
from airflow.sdk.exceptions import AirflowFailException


@dag(
    dag_id="iotlake_reprocess",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={
        "as_of_version": Param(None, type=["null", "integer"], minimum=0,
                               description="source table version to reprocess from"),
        "as_of_timestamp": Param(None, type=["null", "string"],
                                 description="or: ISO 8601 time to reprocess from"),
        "dry_run": Param(True, type="boolean", description="report only, write nothing"),
    },
    tags=["iotlake"],
)
def iotlake_reprocess() -> None:
    @task(retries=1)
    def reprocess(params: dict[str, Any] | None = None) -> None:
        from orchestration.maintenance_cli import run_iotlake_task

        params = params or {}
        version, ts = params.get("as_of_version"), params.get("as_of_timestamp")
        if (version is None) == (ts is None):
            raise AirflowFailException("set exactly one of as_of_version or as_of_timestamp")
        args = ["--as-of-version", str(int(version))] if version is not None \
            else ["--as-of-timestamp", str(ts)]
        run_iotlake_task("reprocess", *args, *(["--dry-run"] if params.get("dry_run") else []))

    reprocess()


iotlake_reprocess()
