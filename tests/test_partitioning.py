"""Small micro-batches are read in few Spark tasks; big ones keep a task per partition / file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from pyspark.sql.types import LongType, StructField, StructType
from test_kafka_source import options_for_unit

from lakehouse.delta_source import DeltaFile, DeltaFiles, DeltaStreamReader
from lakehouse.kafka_source import KafkaRange, KafkaRanges, KafkaStreamReader
from lakehouse.partitioning import coalesce


def test_coalesce_packs_by_rows_and_keeps_order() -> None:
    items = ["a", "b", "c", "d"]
    assert coalesce(items, [10, 10, 10, 10], 50) == [items]
    assert coalesce(items, [10, 10, 10, 10], 0) == [[i] for i in items]
    assert coalesce(items, [10, 10, 10, 10], 10) == [[i] for i in items]
    assert sorted(map(len, coalesce(items, [10, 10, 10, 10], 15))) == [1, 1, 2]
    assert coalesce(["big", "x", "y"], [100, 1, 1], 60) == [["big"], ["x", "y"]]
    assert coalesce([], [], 10) == []
    for groups in (coalesce(items, [5, 40, 7, 30], 45), coalesce(items, [1, 2, 3, 4], 3)):
        assert sorted(i for g in groups for i in g) == items  # nothing lost or repeated
        assert all(g == sorted(g) for g in groups)


def test_kafka_small_batch_is_one_task_big_batch_one_per_partition() -> None:
    start = {"0": 0, "1": 0, "2": 0}
    small = KafkaStreamReader(options_for_unit(task_rows="1000")).partitions(
        start, {"0": 300, "1": 300, "2": 250})
    assert len(small) == 1 and isinstance(small[0], KafkaRanges)
    assert [(r.partition, r.start, r.end) for r in small[0].ranges] == [(0, 0, 300), (1, 0, 300),
                                                                        (2, 0, 250)]
    big = KafkaStreamReader(options_for_unit(task_rows="1000")).partitions(
        start, {"0": 900, "1": 900, "2": 900})
    assert all(isinstance(r, KafkaRange) for r in big) and len(big) == 3
    # split_records asks for more tasks: it wins over packing
    split = KafkaStreamReader(options_for_unit(task_rows="1000", split_records="200")).partitions(
        start, {"0": 300, "1": 0, "2": 0})
    assert [(r.start, r.end) for r in split] == [(0, 150), (150, 300)]


def test_delta_small_batch_reads_all_files_in_one_task(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    for v in range(3):
        write_deltalake(path, pa.table({"n": pa.array(range(v * 10, v * 10 + 10), pa.int64())}),
                        mode="append")
    schema = StructType([StructField("n", LongType())])
    packed = DeltaStreamReader({"path": path, "task_rows": "100"}, schema)
    [task] = packed.partitions({"version": -1}, {"version": 2})
    assert isinstance(task, DeltaFiles) and [f.version for f in task.files] == [0, 1, 2]
    rows = pa.Table.from_batches(list(packed.read(task))).column("n").to_pylist()
    assert rows == list(range(30))
    one_each = DeltaStreamReader({"path": path, "task_rows": "0"}, schema).partitions(
        {"version": -1}, {"version": 2})
    assert [type(f) for f in one_each] == [DeltaFile] * 3
