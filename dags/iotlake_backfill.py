"""Manual backfill of the chosen layers, in pipeline order (bronze, then silver, then gold).

Runs ``iotlake backfill --layer L --max-rows N`` per layer; a layer not chosen is skipped and the
next one still runs. The CLI commits with Delta app transactions, so a retried layer does not
write twice.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import Param, dag, task
from airflow.sdk.exceptions import AirflowSkipException

LAYERS = ["bronze", "silver", "gold"]


@dag(
    dag_id="iotlake_backfill",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=2)},
    params={
        "layers": Param(LAYERS, type="array", items={"type": "string", "enum": LAYERS},
                        minItems=1, description="layers to backfill"),
        "max_rows_per_batch": Param(500_000, type="integer", minimum=1,
                                    description="rows per micro-batch (bounds memory)"),
    },
    tags=["iotlake"],
)
def iotlake_backfill() -> None:
    @task(trigger_rule="none_failed")
    def backfill(layer: str, params: dict[str, Any] | None = None) -> None:
        from orchestration.maintenance_cli import run_iotlake_task

        params = params or {}
        if layer not in params.get("layers", LAYERS):
            raise AirflowSkipException(f"layer {layer} not selected")
        run_iotlake_task("backfill", "--layer", layer, "--max-rows", str(int(params["max_rows_per_batch"])))

    previous = None
    for layer in LAYERS:
        current = backfill.override(task_id=f"backfill_{layer}")(layer)
        if previous is not None:
            previous >> current
        previous = current


iotlake_backfill()
