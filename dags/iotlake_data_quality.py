"""Daily data-quality validation of yesterday's silver rows, as they stood at midnight.

Runs ``iotlake validate silver --version V --date DAY --out <data_root>/quality/silver/daily-DAY``:
DAY is the UTC day before the run's data interval ends, V the version current at the midnight
ending DAY (both from the data interval, not the wall clock), and only rows with event_time in
DAY are checked. A retry or a late re-run checks the same rows into the same report directory
(GX result JSON and Data Docs).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task


@dag(
    dag_id="iotlake_data_quality",
    schedule="@daily",
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=5)},
    tags=["iotlake", "quality"],
)
def iotlake_data_quality() -> None:
    @task
    def validate_silver(data_interval_end: datetime | None = None) -> None:
        from orchestration.maintenance import version_at
        from orchestration.maintenance_cli import run_iotlake_task, task_settings

        settings = task_settings()
        end = (data_interval_end or datetime.now(UTC)).astimezone(UTC)
        end = end.replace(hour=0, minute=0, second=0, microsecond=0)
        day = (end - timedelta(days=1)).date().isoformat()
        version = version_at(settings, "silver", end)
        out = settings.root / "quality" / "silver" / f"daily-{day}"
        run_iotlake_task("validate", "silver", "--version", str(version), "--date", day, "--out", str(out))

    validate_silver()


iotlake_data_quality()
