"""Hourly retention, compaction, then vacuum of every existing iotlake table (a mapped group per
table), for deployments that set ``maintenance.auto = false`` and let Airflow do the upkeep.

Retention deletes rows past ``maintenance.retention_days``; streaming sinks leave many small
files, and compacting hourly keeps scans fast; vacuum removes what they
replaced (``maintenance.vacuum_retention_hours``). Tasks import the package at run time and read
settings from ``$IOTLAKE_CONFIG``; both steps are no-ops when there is nothing to do.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, task, task_group


@dag(
    dag_id="iotlake_compaction",
    schedule="@hourly",
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    tags=["iotlake", "maintenance"],
)
def iotlake_compaction() -> None:
    @task
    def list_tables() -> list[str]:
        from orchestration.maintenance import resolve_tables
        from orchestration.maintenance_cli import task_settings

        return resolve_tables(task_settings())

    @task
    def retain(table: str) -> list[dict[str, Any]]:
        from orchestration.maintenance import retain
        from orchestration.maintenance_cli import task_settings

        return retain(task_settings(), [table])  # [] when the table keeps everything

    @task
    def compact(table: str) -> dict[str, Any]:
        from orchestration.maintenance import compact
        from orchestration.maintenance_cli import task_settings

        return compact(task_settings(), [table])[0]

    @task
    def vacuum(table: str) -> dict[str, Any]:
        from orchestration.maintenance import clean_log, vacuum
        from orchestration.maintenance_cli import task_settings

        settings = task_settings()
        result = vacuum(settings, [table])[0]
        logs = clean_log(settings, [table]).get(table, 0)  # expired Delta log files
        return {**result, "deleted": len(result["deleted"]), "log_files_deleted": logs}

    @task_group
    def maintain(table: str) -> None:
        retain(table) >> compact(table) >> vacuum(table)

    maintain.expand(table=list_tables())


iotlake_compaction()
