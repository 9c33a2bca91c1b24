"""A batch's writes to different tables run at once, as the batch's own thread would run them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lakehouse.delta.concurrent_writes import run_at_once


def test_writes_run_at_once_with_the_callers_pool_and_errors_wait_for_the_rest(spark, tmp_path: Path) -> None:
    sc = spark.sparkContext
    together = threading.Barrier(3, timeout=60)  # the caller and two threads, or it times out
    pools: dict[str, str] = {}

    def write(name: str, wait: bool = True):
        def run() -> None:
            if wait:
                together.wait()
            pools[name] = sc.getLocalProperty("spark.scheduler.pool")
            spark.range(5).write.format("delta").save(str(tmp_path / name))
        return run

    sc.setLocalProperty("spark.scheduler.pool", "gold")
    try:
        run_at_once(spark, [write("a"), write("b"), write("c")])
    finally:
        sc.setLocalProperty("spark.scheduler.pool", None)
    assert pools == dict.fromkeys("abc", "gold")  # the query's pool (and job group) in every thread
    assert [len(DeltaTable(tmp_path / n).to_pyarrow_table()) for n in "abc"] == [5, 5, 5]

    def fail() -> None:
        raise ValueError("the first write failed")

    with pytest.raises(ValueError, match="the first write failed"):
        run_at_once(spark, [fail, write("d", wait=False)])
    assert len(DeltaTable(tmp_path / "d").to_pyarrow_table()) == 5  # the other write still ended
