"""A graceful stop ends each streaming query between micro-batches: the batch running finishes,
no other starts, and Spark takes the end for a stop, not a failure (``lakehouse.streams``)."""

from __future__ import annotations

import threading
import time

import pytest

from lakehouse.streams import foreach_batch
from orchestration.pipeline import Running


class Batches:
    """A ``foreachBatch`` function that takes ``seconds`` and records what started and ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started, self.ended = seconds, [], []
        self.running = threading.Event()

    def __call__(self, df, batch_id: int) -> None:
        self.started.append(batch_id)
        self.running.set()
        # a Spark job that takes ``seconds``: what a stop mid-batch cancels
        ms = int(self.seconds * 1000)
        df.sparkSession.range(1).selectExpr(f"reflect('java.lang.Thread', 'sleep', {ms}L)").collect()
        self.ended.append(batch_id)


def _start(spark, tmp_path, name: str, batches: Batches):
    # back to back batches (no trigger interval): the moment between two is shortest there
    stream = spark.readStream.format("rate").option("rowsPerSecond", 50).load()
    return (foreach_batch(stream, name, batches)
            .option("checkpointLocation", str(tmp_path / name)).trigger(processingTime="0 seconds")
            .start())


def test_a_stop_lets_each_running_batch_finish_and_starts_no_other(spark, tmp_path) -> None:
    slow, quick = Batches(3.0), Batches(0.0)
    queries = {"slow": _start(spark, tmp_path, "slow", slow),
               "quick": _start(spark, tmp_path, "quick", quick)}
    assert slow.running.wait(60) and quick.running.wait(60)
    time.sleep(1.0)  # the slow query is inside a batch now
    Running(spark, None, queries).stop(wait_batch=60)
    for name, q in queries.items():
        assert not q.isActive and q.exception() is None, name  # stopped, not failed
    assert slow.started == slow.ended and quick.started == quick.ended
    n = len(slow.ended)
    time.sleep(1.0)
    assert len(slow.started) == n  # nothing after the stop


def test_past_the_wait_a_stop_ends_a_batch_midway_and_spark_takes_it_for_a_stop(spark, tmp_path) -> None:
    slow = Batches(30.0)
    q = _start(spark, tmp_path, "slow", slow)
    assert slow.running.wait(60)
    hurry = threading.Event()
    threading.Timer(1.0, hurry.set).start()  # a second Ctrl-C
    t0 = time.monotonic()
    Running(spark, None, {"slow": q}).stop(wait_batch=60, hurry=hurry)
    assert time.monotonic() - t0 < 20
    assert not q.isActive and q.exception() is None
    assert len(slow.ended) == len(slow.started) - 1  # the batch it ran did not finish


def test_a_stop_that_interrupts_a_batch_reads_as_a_stop_to_spark(spark) -> None:
    """Spark tells a stop from a failure by matching the foreachBatch error's text
    (``StreamExecution.isInterruptionException``): ``lakehouse.streams.stoppable`` hands it a
    short text naming the interruption, which it matches; other errors pass unchanged."""
    from py4j.protocol import Py4JJavaError

    from lakehouse.streams import stoppable

    jvm = spark._jvm
    jvm.java.lang.Thread.currentThread().interrupt()
    with pytest.raises(Py4JJavaError) as interrupted:
        jvm.java.lang.Thread.sleep(1000)  # the interrupt flag set: InterruptedException

    def write(df, batch_id):
        raise interrupted.value

    with pytest.raises(RuntimeError) as seen:
        stoppable(write, "q")(None, 0)
    proxy = jvm.py4j.Py4JException(f"An exception was raised by the Python Proxy. Return "
                                   f"Message: Traceback (most recent call last):\n{seen.value}")
    stream_execution = jvm.org.apache.spark.sql.execution.streaming.runtime.StreamExecution
    assert stream_execution.isInterruptionException(proxy, spark.sparkContext._jsc.sc())

    def fail(df, batch_id):
        jvm.java.lang.Thread.sleep(-1)  # IllegalArgumentException: not a stop

    with pytest.raises(Exception, match="timeout value is negative"):  # pyspark's own type
        stoppable(fail, "q")(None, 0)
