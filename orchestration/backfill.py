"""Batch catch-up: run a layer's own streaming queries with ``availableNow`` and stop.

Same code and same checkpoint as the live stream, so a backfill and the live stream never
disagree and either can pick up where the other stopped. The checkpoint lock makes a backfill
refuse to run while the live stream of that layer is running (checked before Spark starts); a
layer with nothing new upstream is skipped without starting Spark at all. Progress (rows done of
rows to do, rate, time left) is a bar on a terminal, else a log line every ``progress_every``
seconds; rows and batches are counted by a listener (``orchestration.progress``).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from lakehouse import storage
from lakehouse.delta.read import commit_adds, latest_version, row_count
from lakehouse.settings import Settings

log = logging.getLogger(__name__)

#: step (a layer, or bronze and silver as one query) -> (query name, upstream table or "kafka")
_UPSTREAM = {"bronze": ("bronze", "kafka"), "silver": ("silver", "bronze"),
             "gold": ("gold_metrics_1m", "silver"), "bronze_silver": ("bronze_silver", "kafka")}
#: step -> the checkpoints its queries use
_CHECKPOINTS = {"bronze": ("bronze",), "silver": ("silver",), "gold": ("gold_metrics_1m", "gold_health"),
                "bronze_silver": ("bronze_silver",)}


def _steps(settings: Settings, layers: list[str], all_layers: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(step, layers its queries write), upstream first. With ``stream.topology = "fused"`` one
    query writes bronze and silver: asked for either (an Airflow task per layer), it runs once
    and the other layer's task then finds nothing to do."""
    ordered = [x for x in all_layers if x in layers]
    if not settings.fused or not {"bronze", "silver"} & set(ordered):
        return [(x, (x,)) for x in ordered]
    fused = tuple(x for x in ("bronze", "silver") if x in ordered)
    return [("bronze_silver", fused), *[(x, (x,)) for x in ordered if x not in fused]]


def _committed_offset(checkpoint: str) -> dict | None:
    """The first source's end offset of the last committed batch (None if nothing yet): Spark's
    kafka source writes ``{topic: {partition: offset}}``, Delta's ``{"reservoirVersion": N,
    "index": I, "isStartingVersion": ...}``."""
    batch = _last_batch(Path(checkpoint, "commits"))
    return None if batch is None else _source_offset(checkpoint, batch)


def _last_batch(log_dir: Path) -> int | None:
    """The highest batch id in a checkpoint's ``commits`` or ``offsets`` folder."""
    batches = [int(p.name) for p in log_dir.glob("[0-9]*")] if log_dir.exists() else []
    return max(batches, default=None)


def _source_offset(checkpoint: str, batch: int) -> dict | None:
    """The first source's end offset that batch ``batch`` planned (None: no offset written)."""
    lines = Path(checkpoint, "offsets", str(batch)).read_text().splitlines()
    return json.loads(lines[2]) if len(lines) > 2 and lines[2].startswith("{") else None


def kafka_offsets(settings: Settings) -> dict[int, tuple[int, int]]:
    """partition -> (low, high) watermark of the topic (high: the next offset to be written)."""
    from confluent_kafka import Consumer, TopicPartition

    from lakehouse.kafka.config import client_config

    c = Consumer(client_config(settings, **{"group.id": "iotlake-backfill-probe",
                                            "enable.auto.commit": False}))
    try:
        topic = c.list_topics(settings.kafka.topic, timeout=10).topics[settings.kafka.topic]
        if topic.error is not None:
            return {}
        return {p: c.get_watermark_offsets(TopicPartition(settings.kafka.topic, p), timeout=10)
                for p in topic.partitions}
    finally:
        c.close()


def delta_readers(table: str) -> tuple[str, ...]:
    """The queries (checkpoint names) whose source is the Delta table ``table``."""
    return tuple(q for layer, (_, up) in _UPSTREAM.items() if up == table for q in _CHECKPOINTS[layer])


def unread_version(settings: Settings, table: str) -> int | None:
    """The oldest version of ``table`` one of this lake's streams has yet to read (the start of
    its next batch, or of a replay of its last planned one), None when no started stream reads
    it. Log clean-up must keep it: a Delta source cannot skip a missing commit."""
    versions = []
    for query in delta_readers(table):
        for offset in _recent_offsets(settings.checkpoint_path(query)):
            if "reservoirVersion" in offset:
                versions.append(int(offset["reservoirVersion"]))
    return min(versions, default=None)


def _recent_offsets(checkpoint: str) -> list[dict]:
    """The first source's offsets of the last committed batch and of the batch planned after it."""
    batches = {_last_batch(Path(checkpoint, d)) for d in ("commits", "offsets")} - {None}
    offsets = [_source_offset(checkpoint, b) for b in sorted(batches)]  # often the same batch
    return [o for o in offsets if o is not None]


def _delta_done(offset: dict | None) -> tuple[int, int]:
    """(version, index): files of ``version`` after ``index`` and later versions are to do."""
    if offset is None:
        return -1, -1
    return int(offset["reservoirVersion"]), int(offset.get("index", -1))


def rows_to_do(settings: Settings, layer: str, query: str | None = None) -> int:
    """Upstream rows the layer (its ``query``, by default the one whose rows a backfill reports)
    has not processed yet (for progress: a Delta source part-way through its initial snapshot
    counts that snapshot as done)."""
    main, upstream = _UPSTREAM[layer]
    done = _committed_offset(settings.checkpoint_path(query or main))
    if upstream == "kafka":
        committed = (done or {}).get(settings.kafka.topic, {})
        return sum(max(0, high - int(committed.get(str(p), low)))
                   for p, (low, high) in kafka_offsets(settings).items())
    path = settings.table_path(upstream)
    if done is None:  # a fresh Delta source reads the latest snapshot, then the later commits
        return row_count(path)
    version, index = _delta_done(done)
    latest = latest_version(path)
    if done.get("isStartingVersion"):
        if index == -1:
            return row_count(path)  # the initial snapshot not started yet
        todo = 0
    elif version > latest:  # (latest + 1, -1): everything read
        return 0
    else:
        todo = sum(n for i, (_, n) in enumerate(commit_adds(path, version)) if i > index)
    return todo + sum(n for v in range(version + 1, latest + 1) for _, n in commit_adds(path, v))


#: Delta source offset index past a version's last file (``DeltaSourceOffset.END_INDEX``).
END_INDEX = 2**63 - 1 - 100


def _processed_through(offset: dict | None) -> int:
    """The last upstream version a Delta source has fully processed (-1: none): a version is
    done when the offset's index is ``END_INDEX``; -1 or a file index: the one before."""
    if offset is None:
        return -1
    version, index = _delta_done(offset)
    return version if index == END_INDEX else version - 1


def caught_up(settings: Settings, layer: str, bronze_version: int | None = None) -> bool:
    """Every query of a Delta-fed layer committed its upstream's latest version (for silver, at
    most ``bronze_version`` if given): a run would find nothing to do, so Spark need not start.

    Compares versions, not rows, so a commit without rows (compaction) still counts as work.
    """
    if _UPSTREAM[layer][1] == "kafka":  # only the stream knows
        return False
    target = latest_version(settings.table_path(_UPSTREAM[layer][1]))
    if layer == "silver" and bronze_version is not None:
        target = min(target, bronze_version)
    return all(_processed_through(_committed_offset(settings.checkpoint_path(q))) >= target
               for q in _CHECKPOINTS[layer])


def backfill(settings: Settings, layers: list[str], max_rows: int | None = None,
             progress_every: float = 2.0) -> dict[str, int]:
    """Catch the given layers up, upstream first; returns rows processed per layer."""
    from lakehouse.monitoring.metrics import BatchTotals
    from lakehouse.spark import spark_session
    from lakehouse.streams import lock_checkpoint, release_checkpoints
    from orchestration.pipeline import LAYERS, start_layers
    from orchestration.progress import follow

    unknown = [x for x in layers if x not in LAYERS]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}: choose from {', '.join(LAYERS)}")
    if max_rows is not None and max_rows <= 0:
        raise ValueError("--max-rows must be > 0")
    if max_rows:
        settings = settings.model_copy(deep=True)
        settings.stream.max_offsets_per_trigger = max_rows  # Kafka; Delta sources bound files
    done: dict[str, int] = {}
    spark = totals = None
    try:
        steps = _steps(settings, layers, LAYERS)
        # refuse before starting Spark (seconds) if a live stream holds any checkpoint needed
        for step, _ in steps:
            for query in _CHECKPOINTS[step]:
                lock_checkpoint(settings.checkpoint_path(query))
        storage.check(settings)  # what spark_session does first; the checks below read tables
        storage.configure(settings)
        for step, written in steps:
            if caught_up(settings, step):  # e.g. an Airflow rerun: no JVM for nothing
                log.info("backfill %s: nothing to do", step)
                done.update(dict.fromkeys(written, 0))
                continue
            if spark is None:
                spark = spark_session(settings, app_name="iotlake-backfill", batch=True)
                totals = BatchTotals()
                spark.streams.addListener(totals)
            todo = rows_to_do(settings, step)
            log.info("backfill %s: %d rows to do", step, todo)
            started = ("bronze", "silver") if step == "bronze_silver" else written
            queries = start_layers(spark, settings, started, trigger="available_now")
            main = queries[_UPSTREAM[step][0] if step != "gold" else "gold"]
            rows, _ = follow(totals, main, queries.values(), f"backfill {step}", todo, progress_every)
            for name, q in queries.items():
                if q.exception():
                    raise RuntimeError(f"backfill {step}: {name} failed: {q.exception()}")
            done.update(dict.fromkeys(written, rows))
    finally:
        if totals is not None:
            spark.streams.removeListener(totals)
        release_checkpoints()
    return done


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backfill", help="catch layers up in batch (availableNow) on the live checkpoints")
    p.add_argument("--layer", action="append", choices=["bronze", "silver", "gold"], required=True,
                   help="layer to catch up (repeatable; run upstream first)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="max Kafka records per bronze micro-batch (silver and gold batches are "
                        "bounded by files: stream.silver_max_files_per_trigger, "
                        "gold.max_files_per_trigger)")
    p.set_defaults(func=lambda a, s: (print(json.dumps(backfill(s, a.layer, a.max_rows))), 0)[1])
