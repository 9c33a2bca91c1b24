"""Daily data-quality validation of yesterday's silver data (``iotlake validate silver``).

"Yesterday" is the UTC day before the run's data-interval end (the midnight trigger time), so a
retried or re-run task checks the same day, not the day it happens to run on.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import dag, task
from airflow.sdk.exceptions import AirflowFailException


def _iotlake(*args: str) -> None:
    """Run the iotlake CLI; exit 2 (bad arguments or config) fails without retrying."""
    from lakehouse.maintenance_cli import run_iotlake

    rc = run_iotlake(*args)
    if rc == 2:
        raise AirflowFailException(f"iotlake {args[0]}: invalid arguments or configuration")
    if rc:
        raise RuntimeError(f"iotlake {args[0]} failed with exit code {rc}")


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
        day = (data_interval_end or datetime.now(UTC)).astimezone(UTC) - timedelta(days=1)
        _iotlake("validate", "silver", "--date", day.date().isoformat())

    validate_silver()


iotlake_data_quality()
