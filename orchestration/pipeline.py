"""Start, watch and stop the layer streams: bronze -> silver -> gold.

One Spark session runs the layers' four streaming queries (bronze, silver, gold windows and gold
health; three with ``stream.topology = "fused"``); each has its own checkpoint under the data
root, so any of them can be stopped, killed and restarted without loss or duplication.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from lakehouse.delta.read import latest_version
from lakehouse.settings import Settings
from lakehouse.streams import between_batches, release_checkpoints

log = logging.getLogger(__name__)

LAYERS = ("bronze", "silver", "gold")


def _starters() -> dict[str, list[tuple[str, Callable[..., StreamingQuery]]]]:
    """Layer -> its streaming queries (gold has two: window aggregates and device health)."""
    import bronze.stream
    import gold.health
    import gold.windows
    import silver.stream

    return {
        "bronze": [("bronze", bronze.stream.start)],
        "silver": [("silver", silver.stream.start)],
        "gold": [("gold", gold.windows.start), ("gold_health", gold.health.start)],
    }


def start_layers(spark: SparkSession, settings: Settings, layers: tuple[str, ...] = LAYERS,
                 trigger: str = "live") -> dict[str, StreamingQuery]:
    """Start the layers' queries; with ``stream.topology = "fused"`` bronze and silver are one
    query (``bronze_silver``), so they start together or not at all."""
    from silver import from_kafka

    starters = _starters()
    unknown = [name for name in layers if name not in starters]
    if unknown:
        raise ValueError(f"unknown layer(s) {unknown}: choose from {', '.join(LAYERS)}")
    fused = settings.fused
    if fused and ("bronze" in layers) != ("silver" in layers):
        raise ValueError(f'stream.topology = "{settings.stream.topology}" runs bronze and silver '
                         'as one query: start both layers (the streams role), or set '
                         'stream.topology = "layered"')
    if fused and "bronze" in layers:
        from_kafka.check_topology(settings, from_kafka.QUERY)
        starters["bronze"], starters["silver"] = [(from_kafka.QUERY, from_kafka.start)], []
    elif "bronze" in layers or "silver" in layers:
        from_kafka.check_topology(settings, "layered")
    return {name: fn(spark, settings, trigger=trigger)
            for layer in layers for name, fn in starters[layer]}


#: Delta source offset index past a version's last file (``DeltaSourceOffset.END_INDEX``).
_END_INDEX = 2**63 - 1 - 100


def consumed_version(q: StreamingQuery) -> int | None:
    """The last upstream version a Delta-sourced query has read entirely, from its last
    progress (None before its first batch).

    Delta's source offset is (``reservoirVersion``, ``index``): ``index`` -1 means no file of
    that version read yet (a version fully read shows as the next version at -1), the
    END_INDEX sentinel that version read to its end, any other index a file within it."""
    p = q.lastProgress
    if not p or not p.get("sources"):
        return None
    end = p["sources"][0].get("endOffset")
    if isinstance(end, str):
        end = json.loads(end)
    if not isinstance(end, dict) or "reservoirVersion" not in end:
        return None
    v, i = int(end["reservoirVersion"]), int(end.get("index", -1))
    return v if i == _END_INDEX else v - 1


def check_alive(queries: dict[str, StreamingQuery]) -> None:
    for name, q in queries.items():
        if not q.isActive:
            err = q.exception()
            raise RuntimeError(f"{name} stream stopped: {err}" if err else f"{name} stream stopped")


def delta_caught_up(q: StreamingQuery, upstream_path: str) -> bool:
    """A Delta-sourced query has read its upstream's latest version and is idle."""
    v = consumed_version(q)
    return v is not None and v >= latest_version(upstream_path) and not q.status["isDataAvailable"] \
        and not q.status["isTriggerActive"]


@dataclass
class Running:
    spark: SparkSession
    settings: Settings
    queries: dict[str, StreamingQuery] = field(default_factory=dict)

    def wait_caught_up(self, bronze_rows: Callable[[], int], expected_bronze: int,
                       timeout: float = 600.0) -> None:
        """Block until bronze holds ``expected_bronze`` rows and silver and gold read it all."""
        deadline = time.monotonic() + timeout
        s = self.settings
        while time.monotonic() < deadline:
            check_alive(self.queries)
            if bronze_rows() >= expected_bronze:
                fused = self.queries.get("bronze_silver")  # silver commits after bronze
                if fused is not None:
                    silver_ok = not (fused.status["isDataAvailable"] or fused.status["isTriggerActive"])
                else:
                    silver_ok = "silver" not in self.queries or delta_caught_up(
                        self.queries["silver"], s.table_path("bronze"))
                gold_ok = all(delta_caught_up(self.queries[g], s.table_path("silver"))
                              for g in ("gold", "gold_health") if g in self.queries)
                if silver_ok and gold_ok:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"pipeline did not catch up within {timeout:.0f}s")

    def stop(self, wait_batch: float = 0.0, hurry: threading.Event | None = None) -> None:
        """Stop every query between micro-batches: each finishes the batch it is running and
        starts no other (``lakehouse.streams.between_batches``). ``wait_batch``: seconds the
        running batches may take; a query still in its batch then is stopped mid-batch (its jobs
        are cancelled; the batch is replayed at the next start). ``hurry`` set (a second Ctrl-C)
        ends that wait."""
        deadline = time.monotonic() + wait_batch
        pending = {q.name: q for q in self.queries.values()}
        stopping: list[tuple[str, StreamingQuery, threading.Thread]] = []
        with between_batches(pending) as gate:
            while pending:
                late = time.monotonic() >= deadline or (hurry is not None and hurry.is_set())
                for name, q in list(pending.items()):
                    if not gate.holding(name) and _in_batch(q):
                        if not late:
                            continue
                        log.warning("%s still in a micro-batch at the stop: stopping it mid-batch "
                                    "(replayed at the next start)", name)
                    t = threading.Thread(target=_stop_query, args=(name, q), name=f"stop-{name}")
                    t.start()
                    stopping.append((name, q, t))
                    del pending[name]
                time.sleep(0.02)
            for name, q, t in stopping:
                while t.is_alive() and _active(q):  # stop() marks the query terminated first
                    time.sleep(0.02)
                gate.open(name)
            for _, _, t in stopping:
                t.join()
        release_checkpoints()


def _active(q: StreamingQuery) -> bool:
    try:
        return q.isActive
    except Exception:  # noqa: BLE001 - the JVM going away
        return False


def _in_batch(q: StreamingQuery) -> bool:
    try:
        return q.isActive and q.status["isTriggerActive"]
    except Exception:  # noqa: BLE001 - the JVM going away: nothing to wait for
        return False


def _stop_query(name: str, q: StreamingQuery) -> None:
    try:
        q.stop()
    except Exception as e:  # noqa: BLE001 - stopping must go on for the others
        log.warning("stopping %s: %s", name, e)
