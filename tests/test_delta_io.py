"""Exactly-once commits through this process's cached table handles (``lakehouse.delta_io``)."""

from __future__ import annotations

import threading

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from lakehouse.delta_io import (
    MergeSpec,
    append_arrow,
    commit_files,
    latest_table,
    merge_arrow,
    write_parquet_file,
)


def _rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"k": pa.array(range(start, start + n), pa.int64()),
                     "v": pa.array([f"v{i}" for i in range(start, start + n)])})


def test_cached_handle_sees_other_writers_and_skips_replays(tmp_path):
    path = str(tmp_path / "t")
    assert append_arrow(path, _rows(3), "q", 0)
    # another writer (another process, compaction, ...) commits behind the cached handle's back
    write_deltalake(path, _rows(2, 100), mode="append")
    assert append_arrow(path, _rows(3, 3), "q", 1)
    assert not append_arrow(path, _rows(3, 3), "q", 1)  # replay of batch 1: skipped
    assert not append_arrow(path, _rows(3), "q", 0)
    dt = DeltaTable(path)
    assert dt.version() == 3
    assert dt.to_pyarrow_table().num_rows == 8
    assert dt.transaction_version("q") == 1
    # a second app id on the same table is tracked separately
    assert append_arrow(path, _rows(1, 50), "other", 0)
    with latest_table(path) as cached:
        assert cached.version() == 4
        assert cached.transaction_version("q") == 1 and cached.transaction_version("other") == 0


def test_replay_detected_when_another_process_committed_the_batch(tmp_path):
    """The crash case: a previous incarnation committed batch 1 but Spark replays it here."""
    path = str(tmp_path / "t")
    assert append_arrow(path, _rows(2), "q", 0)  # this process now caches a handle at v1
    from deltalake import CommitProperties, Transaction

    write_deltalake(path, _rows(2, 2), mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction("q", 1)]))
    assert not append_arrow(path, _rows(2, 2), "q", 1)
    f = write_parquet_file(path, _rows(2, 2))
    assert not commit_files(path, [f], "q", 1)  # the sink's path: skipped, its file removed
    assert not (tmp_path / "t" / f.path).exists()
    assert DeltaTable(path).to_pyarrow_table().num_rows == 4


def test_merge_through_the_cached_handle_is_exactly_once(tmp_path):
    path = str(tmp_path / "m")
    assert merge_arrow(path, _rows(3), MergeSpec(["k"]), "q", 0)
    changed = pa.table({"k": pa.array([1, 7], pa.int64()), "v": pa.array(["new", "v7"])})
    assert merge_arrow(path, changed, MergeSpec(["k"]), "q", 1)
    assert not merge_arrow(path, changed, MergeSpec(["k"]), "q", 1)
    t = DeltaTable(path).to_pyarrow_table().sort_by("k").to_pydict()
    assert t == {"k": [0, 1, 2, 7], "v": ["v0", "new", "v2", "v7"]}


def test_concurrent_writers_in_one_process(tmp_path):
    """Several queries' foreachBatch threads share the cache: every commit lands once."""
    path = str(tmp_path / "c")
    append_arrow(path, _rows(1), "init", 0)
    errors: list[BaseException] = []

    def writer(app: str) -> None:
        try:
            for b in range(5):
                append_arrow(path, _rows(2, 1000 * b), app, b)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(f"q{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    dt = DeltaTable(path)
    assert dt.to_pyarrow_table().num_rows == 1 + 3 * 5 * 2
    assert [dt.transaction_version(f"q{i}") for i in range(3)] == [4, 4, 4]
