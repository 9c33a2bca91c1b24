"""Kafka streaming source as a Spark 4 Python Data Source (format ``iotlake_kafka``).

Spark's own Kafka connector is a Maven artifact we cannot fetch, so this one is written here.
Offsets are ``{"<partition>": next_offset}`` and live in Spark's checkpoint; one Spark input
partition per Kafka partition (optionally split into several for large ranges); rows come out
as Arrow record batches built column-wise from whole ``consume()`` results, since per-record
Python work is what bounds ingest throughput.

Offsets also name the Kafka cluster they belong to (``"cluster"``: the cluster id from metadata),
so a checkpoint is never applied to another cluster's offsets: the embedded Tansu keeps records
in memory and starts as a new cluster each time (``lakehouse.services``), and a bootstrap pointed
at another cluster is caught the same way. See ``_cluster_moved``.

Tansu reports a partition's high watermark as the first offset of its last record batch + 1,
so the true end is found by reading from ``high - 1`` to partition EOF (cached while the
reported high watermark does not move). Against a real Kafka this probe is a no-op.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from lakehouse.partitioning import coalesce

log = logging.getLogger(__name__)

KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField(
            "headers",
            ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())])),
        ),
    ]
)

_HEADER_TYPE = pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))
ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("headers", _HEADER_TYPE),
    ]
)


#: Offsets key naming the Kafka cluster (its cluster id) the partition offsets belong to.
CLUSTER = "cluster"


def partition_offsets(offsets: dict) -> dict[str, int]:
    """The ``{"<partition>": offset}`` part of a source offset (without ``"cluster"``)."""
    return {p: int(v) for p, v in offsets.items() if p.isdigit()}


def _client_conf(options: dict[str, str]) -> dict[str, Any]:
    conf: dict[str, Any] = {"bootstrap.servers": options["bootstrap"], "log.connection.close": False}
    extra = options.get("client_config")
    if extra:
        conf.update(json.loads(extra))
    return conf


@dataclass
class KafkaRange(InputPartition):
    topic: str
    partition: int
    start: int  # first offset to read
    end: int  # exclusive

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


class KafkaRanges(InputPartition):
    """Several ranges read by one task (a small batch: see ``lakehouse.partitioning``)."""

    def __init__(self, ranges: list[KafkaRange]) -> None:
        self.ranges = ranges


class KafkaDataSource(DataSource):
    """Options: bootstrap, topic, max_offsets_per_trigger, starting_offsets (earliest|latest),
    fail_on_data_loss, ephemeral_broker ("true": the broker keeps nothing across restarts, so a
    new cluster id is its normal restart, not an error),
    split_records (split a partition's range into chunks of this many records), task_rows (pack
    a batch's ranges into tasks of about this many records; 0: a task per range), client_config
    (JSON of extra librdkafka properties)."""

    @classmethod
    def name(cls) -> str:
        return "iotlake_kafka"

    def schema(self) -> StructType:
        return KAFKA_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        for key in ("bootstrap", "topic"):
            if not self.options.get(key):
                raise ValueError(f"iotlake_kafka: option '{key}' is required")
        return KafkaStreamReader(dict(self.options))


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.topic = options["topic"]
        self.max_per_trigger = int(options.get("max_offsets_per_trigger", 0)) or None
        self.split = int(options.get("split_records", 0)) or None
        self.task_rows = int(options.get("task_rows", 0))
        self._consumer = None
        self._end_cache: dict[int, tuple[int, int]] = {}  # partition -> (reported high, true end)
        self._target: dict[str, int] | None = None
        self._lows: dict[str, int] = {}  # partition -> log start offset at the last probe
        self.fail_on_data_loss = options.get("fail_on_data_loss", "true").lower() != "false"
        self.ephemeral = options.get("ephemeral_broker", "false").lower() == "true"
        self._cluster: str | None = None  # cluster id at the last metadata request
        # an in-memory broker loses its records on every restart: expected, logged, not fatal
        self._strict = self.fail_on_data_loss and not self.ephemeral

    # -- driver side ----------------------------------------------------------------------
    def _probe_consumer(self):
        if self._consumer is None:
            from confluent_kafka import Consumer

            conf = _client_conf(self.options)
            conf.update({"group.id": "iotlake-probe", "enable.auto.commit": False,
                         "enable.partition.eof": True, "fetch.wait.max.ms": 10})
            self._consumer = Consumer(conf)
        return self._consumer

    def _partitions(self) -> list[int]:
        md = self._probe_consumer().list_topics(self.topic, timeout=10)
        self._cluster = md.cluster_id or None
        t = md.topics.get(self.topic)
        if t is None or t.error is not None:
            raise RuntimeError(f"iotlake_kafka: topic {self.topic!r} not available: {t and t.error}")
        return sorted(t.partitions)

    def _true_ends(self) -> dict[str, int]:
        from confluent_kafka import KafkaError, TopicPartition

        c = self._probe_consumer()
        probes, ends = [], {}
        for p in self._partitions():
            lo, hi = c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)
            self._lows[str(p)] = lo
            cached = self._end_cache.get(p)
            if hi <= lo:
                ends[p] = hi
            elif cached and cached[0] == hi:
                ends[p] = cached[1]
            else:
                ends[p] = hi
                probes.append((p, lo, hi))
        if probes:
            c.assign([TopicPartition(self.topic, p, max(lo, hi - 1)) for p, lo, hi in probes])
            pending = {p for p, _, _ in probes}
            deadline = time.monotonic() + 10
            while pending and time.monotonic() < deadline:
                # short waits: consume(n, t) returns early only with n records, and the probe
                # needs just one record and an EOF per partition (0.1 s here was 0.1 s a batch)
                for m in c.consume(10_000, 0.005):
                    err = m.error()
                    if err is None:
                        ends[m.partition()] = max(ends[m.partition()], m.offset() + 1)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(m.partition())
            c.unassign()
            for p, _, hi in probes:
                if p not in pending:
                    self._end_cache[p] = (hi, ends[p])
        return {str(p): e for p, e in ends.items()}

    def initialOffset(self) -> dict:
        from confluent_kafka import TopicPartition

        if self.options.get("starting_offsets", "earliest") == "latest":
            return self._with_cluster(self._true_ends())
        c = self._probe_consumer()
        return self._with_cluster({
            str(p): c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[0]
            for p in self._partitions()
        })

    def _with_cluster(self, offsets: dict[str, int]) -> dict:
        return {**offsets, CLUSTER: self._cluster} if self._cluster else offsets

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger) if self.max_per_trigger else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._true_ends()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        latest = self._target if self._target is not None else self._true_ends()
        old = self._cluster_moved(start)
        if old:  # an empty batch that moves the checkpoint to the new cluster's first offsets
            self._accept_cluster_change(old, partition_offsets(start))
            return self._with_cluster({p: self._lows.get(p, 0) for p in latest})
        return self._with_cluster(self._next_end(partition_offsets(start), latest, limit))

    def _cluster_moved(self, offsets: dict) -> str | None:
        """The cluster id ``offsets`` belong to, if Kafka is now another cluster (else None).
        Offsets without one (older checkpoints, brokers without cluster ids) are not checked."""
        old = offsets.get(CLUSTER)
        if old is None:
            return None
        if self._cluster is None:
            self._partitions()
        return old if self._cluster is not None and old != self._cluster else None

    def _accept_cluster_change(self, old: str, read: dict[str, int]) -> None:
        """A broker that lost its storage, or a bootstrap pointed at another cluster: what the
        old cluster held beyond ``read`` cannot be read any more. Fails unless that is expected
        (an in-memory broker, or ``fail_on_data_loss = false``)."""
        msg = (f"iotlake_kafka: Kafka is now cluster {self._cluster!r} but the checkpoint's "
               f"offsets {read} are from cluster {old!r}; records the old cluster held beyond "
               "them cannot be read here.")
        if self.ephemeral:
            log.warning("%s The embedded Kafka keeps records in memory and was restarted; "
                        "reading topic %r from its first offsets.", msg, self.topic)
        elif not self.fail_on_data_loss:
            log.warning("%s Reading topic %r of the new cluster from its first offsets "
                        "(kafka_fail_on_data_loss = false).", msg, self.topic)
        else:
            raise RuntimeError(
                f"{msg} If kafka.bootstrap points at the wrong cluster, point it back. If the "
                "cluster was replaced and the loss is accepted, set "
                "stream.kafka_fail_on_data_loss = false (IOTLAKE_STREAM__KAFKA_FAIL_ON_DATA_LOSS"
                "=false) and restart: bronze then reads the new cluster from its first offsets.")

    def _next_end(self, start: dict[str, int], latest: dict[str, int], limit: ReadLimit) -> dict:
        self._check_data_loss(start, latest)
        end = {p: max(latest.get(p, 0), start.get(p, 0)) for p in set(latest) | set(start)}
        if not self._strict:  # the topic was recreated: resume at its new end
            end.update({p: latest[p] for p in start if p in latest and latest[p] < start[p]})
        if isinstance(limit, ReadMaxRows):
            end = cap_offsets(start, end, limit.max_rows)
        return end

    def _check_data_loss(self, start: dict, latest: dict) -> None:
        """Fail (like Spark's own Kafka source, ``failOnDataLoss``) when records the checkpoint
        has not read yet can no longer be read: offsets went backwards (topic deleted and
        recreated, broker storage lost), a partition vanished, or retention deleted them."""
        problems = []
        for p, s in sorted(start.items(), key=lambda kv: int(kv[0])):
            if p not in latest:
                problems.append(f"partition {p} is gone (checkpoint at offset {s})")
            elif latest[p] < s:
                problems.append(f"partition {p} ends at {latest[p]}, before the checkpoint's {s}")
            elif self._lows.get(p, 0) > s:
                problems.append(f"partition {p} starts at {self._lows[p]}: offsets {s}.."
                                f"{self._lows[p] - 1} were deleted unread (retention)")
        if not problems:
            return
        msg = (f"iotlake_kafka: data loss on topic {self.topic!r}: " + "; ".join(problems)
               + ". Records bronze never read cannot be recovered from Kafka. To accept the loss "
               "and go on from what the topic holds now, set stream.kafka_fail_on_data_loss = "
               "false (IOTLAKE_STREAM__KAFKA_FAIL_ON_DATA_LOSS=false) and restart.")
        if self._strict:
            raise RuntimeError(msg)
        log.warning("%s Going on (%s).", msg, "in-memory embedded Kafka" if self.ephemeral
                    else "kafka_fail_on_data_loss = false")

    def reportLatestOffset(self) -> dict | None:
        return self._true_ends()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        """One range per Kafka partition, or ~equal chunks of at most split_records so that a few
        busy partitions still keep every core reading; a small batch's ranges are packed into
        fewer tasks of about task_rows records (not with split_records, which asks for more)."""
        old = self._cluster_moved(end)
        if old:  # a batch planned before the broker restarted, replayed: its records are gone
            self._accept_cluster_change(old, partition_offsets(start))
            return []
        if start.get(CLUSTER) and end.get(CLUSTER) and start[CLUSTER] != end[CLUSTER]:
            return []  # the batch that moved the checkpoint to a new cluster: nothing to read
        start, end = partition_offsets(start), partition_offsets(end)
        out: list[InputPartition] = []
        for p in sorted(end, key=int):
            s, e = start.get(p, 0), end[p]
            if not self._strict:
                s = max(s, self._lows.get(p, 0))  # skip what retention deleted
            n = -(-(e - s) // self.split) if self.split else 1
            out += [KafkaRange(self.topic, int(p), s + (e - s) * i // n, s + (e - s) * (i + 1) // n)
                    for i in range(n) if e > s]
        if self.split:
            return out
        return [g[0] if len(g) == 1 else KafkaRanges(g)
                for g in coalesce(out, [r.end - r.start for r in out], self.task_rows)]

    def commit(self, end: dict) -> None:  # Kafka offsets live in Spark's checkpoint only
        pass

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    # -- executor side --------------------------------------------------------------------
    def read(self, partition: KafkaRange | KafkaRanges) -> Iterator[pa.RecordBatch]:
        for r in getattr(partition, "ranges", None) or [partition]:
            yield from read_range(self.options, r)


def kafka_end_offsets(settings) -> dict[str, int]:
    """True end offset per partition of the telemetry topic (Tansu's high watermark lies)."""
    reader = KafkaStreamReader({"bootstrap": settings.kafka_bootstrap, "topic": settings.kafka.topic,
                                "client_config": json.dumps(settings.kafka.client_config)})
    try:
        return reader._true_ends()
    finally:
        reader.stop()


def cap_offsets(start: dict, end: dict, max_rows: int) -> dict:
    """Cap the range to about ``max_rows`` records, shared fairly among partitions."""
    avail = {p: end[p] - start.get(p, 0) for p in end}
    total = sum(avail.values())
    if total <= max_rows:
        return end
    out, budget = {}, max_rows
    for i, p in enumerate(sorted(avail, key=lambda q: avail[q])):
        share = budget // (len(avail) - i)
        take = min(avail[p], share)
        out[p] = start.get(p, 0) + take
        budget -= take
    return out


# Small fetches and prefetch queue: a range's consumer must not read far past its end (the next
# task decodes those records again). librdkafka pauses fetching for fetch.queue.backoff.ms (1 s by
# default) once the queue is full, which stalls consume(); keep that pause short.
_READER_CONF = {"group.id": "iotlake-reader", "enable.auto.commit": False, "enable.partition.eof": True,
                "fetch.min.bytes": 1, "fetch.wait.max.ms": 100, "fetch.message.max.bytes": 1048576,
                "queued.min.messages": 20_000, "fetch.queue.backoff.ms": 5}
_MS = pa.timestamp("ms", tz="UTC")  # Kafka timestamps


def read_range(options: dict[str, str], r: KafkaRange, batch_rows: int = 50_000,
               chunk: int = 10_000, idle_timeout: float = 60.0) -> Iterator[pa.RecordBatch]:
    """Read offsets [start, end) of one partition and yield Arrow batches of about batch_rows."""
    if r.end <= r.start:
        return
    from confluent_kafka import Consumer, TopicPartition

    # A consumer per task, closed after it: one kept idle per Python worker was tried and
    # dropped (it keeps reconnecting, and logging, while the broker is down; gain unmeasurable)
    c = Consumer(_client_conf(options) | _READER_CONF)
    try:
        c.assign([TopicPartition(r.topic, r.partition, r.start)])
        cols = _Columns()
        nxt, idle_since = r.start, time.monotonic()
        while nxt < r.end:
            # Ask for no more than the range holds: consume() waits for the full count otherwise.
            msgs = c.consume(min(chunk, r.end - nxt), 0.5)
            if not msgs:
                if time.monotonic() - idle_since > idle_timeout:
                    raise TimeoutError(
                        f"iotlake_kafka: no data from {r.topic}[{r.partition}] at offset {nxt} "
                        f"(expected up to {r.end}) for {idle_timeout:.0f}s")
                continue
            idle_since = time.monotonic()
            nxt = cols.add(msgs, nxt, r.end)
            if cols.rows >= batch_rows:
                yield cols.batch(r)
                cols = _Columns()
        if cols.rows:
            yield cols.batch(r)
    finally:
        c.close()


class _Columns:
    """Column lists for one Arrow batch, filled a consume() result at a time (no per-row dicts)."""

    def __init__(self) -> None:
        self.keys: list = []
        self.values: list = []
        self.offsets: list[int] = []
        self.ts: list[int] = []
        self.headers: list = []
        self.rows = 0
        self.any_headers = False

    def add(self, msgs: list, nxt: int, end: int) -> int:
        """Append records with offsets in [nxt, end); return the next offset to read."""
        if not (msgs[0].offset() >= nxt and msgs[-1].offset() < end
                and all(m.error() is None for m in msgs)):
            msgs, nxt = _keep(msgs, nxt, end)
            if not msgs:
                return nxt
        hs = [m.headers() for m in msgs]
        self.keys += [m.key() for m in msgs]
        self.values += [m.value() for m in msgs]
        self.offsets += [m.offset() for m in msgs]
        self.ts += [m.timestamp()[1] for m in msgs]
        self.headers += hs
        self.any_headers = self.any_headers or any(hs)
        self.rows += len(msgs)
        return max(nxt, self.offsets[-1] + 1)

    def batch(self, r: KafkaRange) -> pa.RecordBatch:
        n = self.rows
        headers = _headers_array(self.headers if self.any_headers else None, n)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(self.keys, pa.binary()),
                pa.array(self.values, pa.binary()),
                pa.repeat(pa.scalar(r.topic, pa.string()), n),
                pa.repeat(pa.scalar(r.partition, pa.int32()), n),
                pa.array(self.offsets, pa.int64()),
                pa.array(self.ts, _MS).cast(ARROW_SCHEMA.field("timestamp").type),
                headers,
            ],
            schema=ARROW_SCHEMA,
        )


def _keep(msgs: list, nxt: int, end: int) -> tuple[list, int]:
    """Slow path: drop EOF events and records outside [nxt, end); fail on real errors."""
    from confluent_kafka import KafkaError

    kept = []
    for m in msgs:
        err = m.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                raise RuntimeError(f"iotlake_kafka: {err}")
            if m.offset() >= end:  # compacted/transactional gaps at the tail
                nxt = end
        elif nxt <= m.offset() < end:
            kept.append(m)
        elif m.offset() >= end:
            nxt = end
    return kept, nxt


def _headers_array(headers: list | None, n: int) -> pa.Array:
    """list<struct<key, value>>, [] (not null) for a record without headers.

    A Kafka v2 record always carries a header array, possibly empty. A null list would also cost
    Spark's Arrow writer quadratic time per batch (Arrow Java's ListVector.setValueCount refills
    offsets from the last non-null entry on every size check).
    """
    if headers is None:
        offsets = pa.repeat(pa.scalar(0, pa.int32()), n + 1)
        return pa.ListArray.from_arrays(offsets, pa.array([], _HEADER_TYPE.value_type), _HEADER_TYPE)
    flat = list(chain.from_iterable(h for h in headers if h))  # (key, value) tuples
    offsets = pa.array(list(accumulate((len(h) if h else 0 for h in headers), initial=0)), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(flat, _HEADER_TYPE.value_type), _HEADER_TYPE)
