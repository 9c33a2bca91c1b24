"""A micro-batch's independent writes (each to its own table), run at once.

Much of a small Delta write is spent on the driver (the table's snapshot, planning, the commit),
while the executors wait; a batch that writes several tables one after another pays those waits
in sequence. Here the writes overlap. Each runs with the calling thread's Spark local
properties (the query's job group, so stopping the query cancels it; its scheduler pool) and
active session. Every write is waited for and the first error raised: the batch then fails and
is replayed, and the writes are idempotent (Delta app transactions), so a write that did commit
is skipped on replay.

The first write runs in the calling thread, the others in threads the process shares (kept
across batches: a py4j connection each). A write handed to a thread never waits for another
one; only the first write may itself run writes at once (e.g. silver's writer beside bronze's
append), so the shared threads cannot deadlock, whatever the number of queries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pyspark.sql import SparkSession
from pyspark.util import inheritable_thread_target

#: Shared by every query of the process (``iotlake run``'s three need six at most).
THREADS = 6
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="iotlake-write")
        return _pool


def run_at_once(spark: SparkSession, writes: Sequence[Callable[[], None]]) -> None:
    """Run ``writes`` at once in ``spark`` (the batch DataFrame's session); return when all
    ended, raising the first error. Only ``writes[0]`` may run writes at once itself."""
    if not writes:
        return
    first, *rest = writes
    inherit = inheritable_thread_target(spark) if rest else None  # this thread's properties, now

    def in_session(write: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
            write()
        return inherit(run)

    futures = [_threads().submit(in_session(w)) for w in rest]
    errors: list[BaseException] = []
    try:
        first()
    except BaseException as e:  # noqa: BLE001 - raised below, once the others ended
        errors.append(e)
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if errors:
        raise errors[0]
