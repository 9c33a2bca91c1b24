"""Chaos harness: the whole pipeline as separate processes under steady load, killed at random.

Shared by ``bench/chaos.py`` (20 kills) and ``tests/test_chaos.py`` (a few kills, a broker
outage). The harness starts its own Mosquitto and Apache Kafka on their own ports, then each role as
its own process (``python -m orchestration.cli run --role bridge|bronze|silver|gold``, settings from
a JSON file written with ``Settings.save``) and a publisher sending known simulated telemetry
(fixed clock start and seed, so every event id is known; some duplicates, some malformed
payloads) at a steady rate. At seeded-random moments it ``kill -9``s one role's whole process
group (the Python driver, its JVM and Python workers, as a pod kill would) or every role at
once ("whole run"), waits, and restarts it; optionally it also stops and restarts the brokers
and compacts every table while the streams write (``compactions``).
A role that dies by itself is restarted too (a supervisor's job) and counted as a crash.

After the load stops and the pipeline drained, :func:`verify` checks the guarantees:

- bronze holds every published payload (multiset); extra copies are allowed only as MQTT
  redeliveries of published payloads (``bronze_extra``), and each Kafka (partition, offset)
  lands exactly once;
- every published valid event id is in silver exactly once, nothing else is;
- every malformed payload is in quarantine (as many times as bronze holds it) with a reason;
- per silver micro-batch ``rows_in = silver + quarantine + duplicates + late`` and the batches'
  ``rows_in`` add up to the bronze rows;
- ``gold_metrics_1m`` and ``gold_metrics_5m`` equal a pandas recomputation from silver;
- ``gold_metrics_1m_final`` / ``gold_metrics_5m_final`` hold each (device_id, metric,
  window_start) once, each row equal to the merged row of ``gold_metrics_1m`` / ``_5m``, and
  every merged window ending at or before the latest final ``window_end`` is there;
- every file the current snapshot of every Delta table references exists;
- every role is alive at the end and caught up (no stuck stream): bronze holds every Kafka
  record, and silver and gold each committed a batch ending at their upstream's latest version,
  three polls in a row.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fleets import SENSOR

from lakehouse.settings import Settings, load_settings
from orchestration.services import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Streaming queries (checkpoint names) each role runs.
ROLE_QUERIES = {"bridge": (), "bronze": ("bronze",), "silver": ("silver",),
                "gold": ("gold_metrics_1m", "gold_health"),
                "streams": ("bronze_silver", "gold_metrics_1m", "gold_health")}
WHOLE_RUN = "whole run"


@dataclass
class ChaosConfig:
    root: Path
    kills: int = 20
    rate: float = 300.0  # messages per second published
    devices: int = 50
    duplicate_fraction: float = 0.02
    malformed_fraction: float = 0.01
    #: simulated event seconds per wall second: > 1 lets a short run close windows under the
    #: watermark, so the final-window tables have rows to check
    event_time_speedup: float = 1.0
    seed: int = 0
    #: role processes; ("bridge", "streams") runs bronze+silver+gold in one Spark process
    roles: tuple[str, ...] = ("bridge", "bronze", "silver", "gold")
    whole_run_weight: float = 0.5  # relative to 1.0 per single role
    interval: tuple[float, float] = (4.0, 10.0)  # seconds between disruptions
    downtime: tuple[float, float] = (0.5, 4.0)  # seconds a killed role / broker stays down
    #: seconds a victim must have been *working* (new committed batch / subscribed) before it is
    #: killed again, so kills land on a running pipeline rather than on a JVM still starting
    ready_timeout: float = 120.0
    mosquitto_outages: int = 0
    #: the embedded Kafka is durable: an outage (SIGTERM or kill -9, seeded-random, then a restart
    #: on the same log) loses nothing
    kafka_outages: int = 0
    #: ``iotlake compact`` of every table (in this process, delta-spark) while the streams write,
    #: placed in the second half of the plan so there are small files to rewrite
    compactions: int = 0
    #: tables each compaction rewrites (None: every table)
    compact_tables: tuple[str, ...] | None = None
    #: event time of the first reading: yesterday, so the built-in upkeep's retention (30 days
    #: and more) leaves the run's rows alone while the checks read them
    start: datetime = field(default_factory=lambda: datetime.now(UTC).replace(
        minute=0, second=0, microsecond=0) - timedelta(days=1))
    kafka_port: int = 0  # 0: pick a free port
    mqtt_port: int = 0
    partitions: int = 4  # Kafka partitions of the telemetry topic (the project default)
    spark_master: str = "local[2]"
    driver_memory: str = "1g"
    trigger_seconds: float = 1.0
    warmup_seconds: float = 5.0  # load before the first disruption
    tail_seconds: float = 5.0  # load after the last disruption
    drain_timeout: float = 600.0
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))


# ---- processes --------------------------------------------------------------------------------


class Role:
    """One ``iotlake run --role NAME`` process group; every incarnation logs to its own file."""

    def __init__(self, name: str, config: Path, logs: Path, checkpoints: list[Path]) -> None:
        self.name, self.config, self.logs, self.checkpoints = name, config, logs, checkpoints
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.started_at = 0.0
        self.kills = 0
        self.crashes = 0
        self._commits_at_start = 0

    @property
    def log_file(self) -> Path:
        return self.logs / f"{self.name}-{self.incarnation}.log"

    def start(self) -> None:
        self.incarnation += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
        env["IOTLAKE_CONFIG"] = str(self.config)
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestration.cli", "run", "--role", self.name], env=env,
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)  # own process group: kill -9 takes the JVM along
        self.started_at = time.monotonic()
        self._commits_at_start = self._commits()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL the whole process group (driver, JVM, Python workers) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        _wait_group_gone(self.proc.pid)

    def stop(self, timeout: float = 90.0) -> int | None:
        """Graceful stop (SIGTERM to the driver); SIGKILL of the group if it does not exit."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if rc is None:
            self.proc.wait(30)
        _wait_group_gone(self.proc.pid)
        return rc

    def _commits(self) -> int:
        n = 0
        for c in self.checkpoints:
            d = c / "commits"
            if d.is_dir():
                n += sum(1 for p in d.iterdir() if p.name.isdigit())
        return n

    def ready(self, batches: int = 1) -> bool:
        """Working: the bridge subscribed; a stream role committed ``batches`` batches since it
        started."""
        if not self.alive:
            return False
        if self.name == "bridge":
            return self.log_file.exists() and "subscribed to" in self.log_file.read_text(errors="replace")
        return self._commits() >= self._commits_at_start + batches


def _log_tail(path: Path, chars: int = 2500) -> str:
    """The end of a role's log without JVM warnings and Java stack frames: why it exited."""
    if not path.exists():
        return ""
    lines = [ln for ln in path.read_text(errors="replace").splitlines()
             if not ln.lstrip().startswith("at ") and " WARN " not in ln and "FutureWarning" not in ln]
    return "\n".join(lines)[-chars:]


def _data_files(table: str) -> int:
    """Files in the table's current version (0 before it exists)."""
    from lakehouse.delta.read import open_table, table_exists

    return len(open_table(table).file_uris()) if table_exists(table) else 0


def _wait_group_gone(pgid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def message_stream(settings: Settings, rate: float, devices: int, seed: int, start: datetime,
                   duplicate_fraction: float, malformed_fraction: float,
                   chunk: int = 10_000) -> Iterator:
    """Known simulated telemetry without end, generated a chunk at a time.

    Chunk ``i`` is ``ingest.simulator.generate`` with seed ``(seed, i)`` and its clock starting
    where chunk ``i - 1``'s ended, so event time advances ``rate`` messages per event second over
    the whole run and a duplicate re-sends a reading at most one chunk (``chunk / rate`` s of
    event time) old: never late while that is well under the watermark.
    """
    from ingest.simulator import generate

    for i in itertools.count():
        yield from generate(settings, chunk, devices=devices, duplicates=int(chunk * duplicate_fraction),
                            malformed=int(chunk * malformed_fraction), seed=seed * 1_000_003 + i,
                            start=start + timedelta(seconds=i * chunk / rate), rate=rate)


class Publisher:
    """Publishes QoS 1 at a steady rate on one long-lived MQTT connection (paho re-sends
    unacknowledged publishes after a reconnect) until stopped; ``messages`` holds what it sent."""

    def __init__(self, settings: Settings, source: Iterator, rate: float) -> None:
        from ingest.simulator.publisher import _Publisher

        self.source, self.rate = source, rate
        self.messages: list = []
        self.pub = _Publisher(settings, max_inflight=1000)
        self.pub.client.reconnect_delay_set(min_delay=0.2, max_delay=2)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="chaos-publisher", daemon=True)

    @property
    def sent(self) -> int:
        return len(self.messages)

    def start(self) -> Publisher:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            t0 = time.monotonic()
            for i, m in enumerate(self.source):
                delay = t0 + i / self.rate - time.monotonic()
                if delay > 0 and self.stop_event.wait(delay):
                    break
                if delay < -1.0:  # blocked (broker down): resume the steady rate, no burst
                    t0 -= delay + 1.0
                if self.stop_event.is_set():
                    break
                self.messages.append(m)
                self.pub.send(m.topic, m.payload)
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def finish(self, timeout: float = 300.0, stop: bool = True) -> int:
        """Stop publishing (``stop=False``: once the source is exhausted); wait until the broker
        acknowledged everything sent; return the count."""
        if stop:
            self.stop_event.set()
        self.thread.join(timeout)
        deadline = time.monotonic() + timeout
        while self.pub.acked < self.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        self.pub.close()
        if self.error is not None:
            raise RuntimeError(f"publisher failed: {self.error}") from self.error
        if self.pub.acked < self.sent:
            raise TimeoutError(f"only {self.pub.acked}/{self.sent} publishes acknowledged")
        return self.sent


# ---- checkpoints and Kafka --------------------------------------------------------------------


def checkpoint_position(ckpt: str | Path) -> tuple[int, dict, bool] | None:
    """(last planned batch id, its source end offset, whether that batch is committed)."""
    offsets = Path(ckpt, "offsets")
    if not offsets.is_dir():
        return None
    ids = [int(p.name) for p in offsets.iterdir() if p.name.isdigit()]
    if not ids:
        return None
    b = max(ids)
    try:
        lines = Path(offsets, str(b)).read_text().splitlines()
        end = json.loads(lines[2])
    except (OSError, IndexError, json.JSONDecodeError):
        return None
    return b, end, Path(ckpt, "commits", str(b)).exists()


def _rows(path: str) -> int:
    from deltalake import DeltaTable

    from lakehouse.delta.read import table_exists

    return DeltaTable(path).to_pyarrow_dataset().count_rows() if table_exists(path) else 0


def kafka_end_offsets(settings: Settings, timeout: float = 10.0) -> dict[int, int]:
    """End offset (high watermark) per partition of the telemetry topic."""
    from confluent_kafka import Consumer, TopicPartition

    from lakehouse.kafka.config import client_config

    topic = settings.kafka.topic
    c = Consumer(client_config(settings, **{"group.id": "iotlake-chaos-probe",
                                            "enable.auto.commit": False}))
    try:
        parts = c.list_topics(topic, timeout=timeout).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1]
                for p in parts}
    finally:
        c.close()


def _read_through(end: dict, version: int) -> bool:
    """A Delta source end offset at or past everything of table ``version``: Delta's source
    names the next (version, file index), -1 meaning before the version's first file."""
    if "reservoirVersion" in end:
        rv, index = end["reservoirVersion"], end.get("index", -1)
        return rv > version or (rv == version and index >= 0)
    return end.get("version") == version  # a hand-made source's offset (older checkpoints)


def caught_up(settings: Settings, published: int) -> dict[str, bool]:
    """Per layer: has it read everything upstream has (bronze: >= published, and every record
    the durable Kafka holds)?"""
    from lakehouse.delta.read import latest_version

    bronze_rows = _rows(settings.table_path("bronze"))
    state = {"bronze": bronze_rows >= published}
    if state["bronze"]:
        try:
            state["bronze"] = bronze_rows >= sum(kafka_end_offsets(settings).values())
        except Exception:  # noqa: BLE001 - broker busy: not caught up yet
            state["bronze"] = False
    if settings.fused:  # silver commits in bronze's batch
        pos = checkpoint_position(settings.checkpoint_path("bronze_silver"))
        state["silver"] = state["bronze"] and pos is not None and pos[2]
    readers = (("gold_metrics_1m", "silver"), ("gold_health", "silver"))
    if not settings.fused:
        readers = (("silver", "bronze"), *readers)
    for query, upstream in readers:
        pos = checkpoint_position(settings.checkpoint_path(query))
        v = latest_version(settings.table_path(upstream))
        state[query] = pos is not None and pos[2] and _read_through(pos[1], v)
    return state


# ---- verification -----------------------------------------------------------------------------


def _table(settings: Settings, name: str, columns: list[str] | None = None):
    from deltalake import DeltaTable

    from lakehouse.delta.read import table_exists

    path = settings.table_path(name)
    if not table_exists(path):
        return None
    return DeltaTable(path).to_pyarrow_table(columns=columns)


def gold_expected(silver, size: int = 60, every: int | None = None) -> Any:
    """Gold windows of ``size`` seconds starting every ``every`` (default: tumbling) seconds,
    recomputed with pandas from silver rows."""
    import pandas as pd


    every = every or size
    df = silver.select(["device_id", "event_time", *SENSOR.metric_names]).to_pandas()
    if df.empty:
        return pd.DataFrame(columns=["device_id", "metric", "window_start", "count", "mean", "min",
                                     "max", "std", "last"])
    first = df["event_time"].dt.floor(f"{every}s")  # the latest window start covering a reading
    df = pd.concat([df.assign(window_start=first - pd.Timedelta(seconds=k * every))
                    for k in range(size // every)], ignore_index=True)
    long = df.melt(id_vars=["device_id", "window_start", "event_time"], value_vars=list(SENSOR.metric_names),
                   var_name="metric").dropna(subset=["value"]).sort_values("event_time", kind="stable")
    g = long.groupby(["device_id", "metric", "window_start"])["value"]
    return g.agg(["count", "mean", "min", "max", "std", "last"]).reset_index()


def mismatched_windows(gold, silver, size: int = 60, every: int | None = None) -> int:
    """Windows present on one side only, or whose count / mean / min / max / stddev / last differ."""
    exp = gold_expected(silver, size, every)
    got = gold.to_pandas()
    keys = ["device_id", "metric", "window_start"]
    for df in (exp, got):
        df["window_start"] = df["window_start"].astype("datetime64[us, UTC]")
    m = exp.merge(got, on=keys, how="outer", suffixes=("_exp", ""), indicator=True)
    bad = int((m["_merge"] != "both").sum())
    both = m[m["_merge"] == "both"]
    wrong = both["count_exp"] != both["count"]
    for c in ("mean", "min", "max", "last"):
        wrong |= (both[f"{c}_exp"] - both[c]).abs() > 1e-9 * (1 + both[c].abs())
    s_exp, s_got = both["std"], both["stddev"]
    wrong |= (s_exp.isna() != s_got.isna()) | ((s_exp - s_got).abs() > 1e-6 * (1 + s_got.abs().fillna(0)))
    return bad + int(wrong.sum())


#: Append-only final-window table -> the merged table its rows are copied from.
FINAL_TABLES = {"gold_metrics_1m_final": "gold_metrics_1m", "gold_metrics_5m_final": "gold_metrics_5m"}


def final_window_problems(settings: Settings) -> dict[str, dict[str, int]]:
    """Per final-window table: keys appended more than once, rows absent from or different to
    the merged table (exact: a final row is a copy, and a final window never changes again), and
    merged windows ending at or before the latest final ``window_end`` that never became final."""
    import pandas as pd

    keys = ["device_id", "metric", "window_start"]
    out: dict[str, dict[str, int]] = {}
    from gold.windows import tables

    written = tables(settings)  # the sliding pair only while it is on
    for name, merged_name in FINAL_TABLES.items():
        if name not in written:
            continue
        final, merged = _table(settings, name), _table(settings, merged_name)
        if final is None or merged is None:
            out[name] = {"rows": 0, "table_missing": 1}
            continue
        f, m = final.to_pandas(), merged.to_pandas()
        j = f.drop_duplicates(keys).merge(m, on=keys, how="left", suffixes=("", "_merged"),
                                          indicator=True)
        both = j[j["_merge"] == "both"]
        differ = pd.Series(False, index=both.index)
        for c in (c for c in f.columns if c not in keys):
            a, b = both[c], both[f"{c}_merged"]
            differ |= (a != b) & ~(a.isna() & b.isna())
        never = 0
        if len(f):
            due = m[m["window_end"] <= f["window_end"].max()]
            never = len(due) - len(due.merge(f[keys].drop_duplicates(), on=keys))
        out[name] = {"rows": len(f), "duplicate_keys": int(f.duplicated(keys).sum()),
                     "not_in_merged": int((j["_merge"] != "both").sum()),
                     "differ": int(differ.sum()), "never_final": never}
    return out


def snapshot_files(settings: Settings) -> dict[str, list[Path]]:
    """Per Delta table under the data root: the local files its current snapshot references."""
    from urllib.parse import unquote, urlparse

    from deltalake import DeltaTable

    tables = settings.root / "tables"
    return {d.name: [Path(unquote(urlparse(u).path)) for u in DeltaTable(str(d)).file_uris()]
            for d in (sorted(tables.iterdir()) if tables.is_dir() else [])
            if (d / "_delta_log").is_dir()}


def missing_files(settings: Settings, snapshot: dict[str, list[Path]] | None = None) -> dict[str, int]:
    """Per Delta table: files its current snapshot references that do not exist."""
    out = {}
    for name, files in (snapshot_files(settings) if snapshot is None else snapshot).items():
        gone = sum(not f.exists() for f in files)
        if gone:
            out[name] = gone
    return out


def quality_accounting(settings: Settings) -> dict[str, Any]:
    """Per silver batch, rows_in = silver + quarantine + duplicates + late; totals."""
    ql = _table(settings, "quality_log")
    if ql is None:
        return {"batches": 0, "bad_batches": 0, "rows_in": 0, "totals": {}}
    batches: dict[tuple, dict[str, int]] = {}
    for r in ql.to_pylist():
        if r["kind"] == "counter":
            batches.setdefault((r["query_id"], r["batch_id"]), {})[r["expectation"]] = \
                json.loads(r["details"])["count"]
    bad = [k for k, c in batches.items()
           if c.get("rows_in", 0) != sum(c.get(n, 0) for n in ("silver", "quarantine", "duplicates", "late"))]
    totals: Counter = Counter()
    for c in batches.values():
        totals.update(c)
    return {"batches": len(batches), "bad_batches": len(bad), "rows_in": totals["rows_in"],
            "totals": dict(totals)}


def verify(settings: Settings, messages: list) -> dict[str, Any]:
    """Check every guarantee for the published ``messages``; counts of violations."""
    import pyarrow.compute as pc

    from gold.windows import SLIDING_TABLE, tables

    published = Counter(m.payload for m in messages)
    valid_ids = {m.event_id for m in messages if m.kind in ("valid", "late")}
    malformed = {m.payload for m in messages if m.kind == "malformed"}

    bronze = _table(settings, "bronze", ["value", "partition", "offset"])
    in_bronze = Counter(bronze.column("value").to_pylist()) if bronze is not None else Counter()
    bronze_missing = published - in_bronze
    extra = in_bronze - published
    unknown_in_bronze = sum(n for p, n in extra.items() if p not in published)
    coords = Counter(zip(bronze.column("partition").to_pylist(), bronze.column("offset").to_pylist(),
                         strict=True)) if bronze is not None else Counter()
    bronze_dup_offsets = sum(n - 1 for n in coords.values() if n > 1)

    silver = _table(settings, "silver")
    silver_ids = Counter(silver.column("event_id").to_pylist()) if silver is not None else Counter()
    silver_missing = len(valid_ids - set(silver_ids))
    silver_dups = sum(n - 1 for n in silver_ids.values() if n > 1)
    silver_unexpected = sum(n for i, n in silver_ids.items() if i not in valid_ids)

    quarantine = _table(settings, "quarantine", ["value", "reason"])
    q_vals = Counter(quarantine.column("value").to_pylist()) if quarantine is not None else Counter()
    no_reason = 0 if quarantine is None else int(pc.sum(pc.or_kleene(
        pc.is_null(quarantine.column("reason")),
        pc.equal(pc.utf8_length(quarantine.column("reason")), 0))).as_py() or 0)
    expected_q = Counter({p: in_bronze[p] for p in malformed if in_bronze[p]})
    quarantine_missing = sum((Counter(dict.fromkeys(malformed, 1)) - q_vals).values())
    quarantine_excess = sum((q_vals - expected_q).values())
    quarantine_short = sum((expected_q - q_vals).values())

    acct = quality_accounting(settings)
    bronze_rows = bronze.num_rows if bronze is not None else 0
    gold, gold5 = _table(settings, "gold_metrics_1m"), _table(settings, "gold_metrics_5m")
    g = settings.gold
    windows_bad = -1
    sliding = SLIDING_TABLE in tables(settings)  # off: no sliding tables to check
    if gold is not None and (gold5 is not None or not sliding) and silver is not None:
        windows_bad = mismatched_windows(gold, silver, settings.stream.window_seconds)
        if sliding:
            windows_bad += mismatched_windows(gold5, silver, g.slide_window_seconds, g.slide_every_seconds)
    finals = final_window_problems(settings)
    snapshot = snapshot_files(settings)
    files = missing_files(settings, snapshot)

    lost = sum(bronze_missing.values()) + silver_missing + quarantine_missing + quarantine_short
    duplicated = silver_dups + silver_unexpected + bronze_dup_offsets + quarantine_excess + unknown_in_bronze
    return {
        "lost": lost,
        "duplicated": duplicated,
        "mismatched_windows": windows_bad,
        "bronze_rows": bronze_rows,
        "bronze_extra": sum(extra.values()),
        "silver_rows": silver.num_rows if silver is not None else 0,
        "quarantine_rows": quarantine.num_rows if quarantine is not None else 0,
        "gold_windows": gold.num_rows if gold is not None else 0,
        "final_windows": {t: p["rows"] for t, p in finals.items()},
        "final_windows_bad": sum(n for p in finals.values() for k, n in p.items() if k != "rows"),
        "detail": {
            "bronze_missing": sum(bronze_missing.values()), "bronze_unknown_payloads": unknown_in_bronze,
            "bronze_duplicate_offsets": bronze_dup_offsets, "silver_missing": silver_missing,
            "silver_duplicates": silver_dups, "silver_unexpected": silver_unexpected,
            "quarantine_missing": quarantine_missing + quarantine_short,
            "quarantine_excess": quarantine_excess, "quarantine_without_reason": no_reason,
            "quality_batches": acct["batches"], "quality_bad_batches": acct["bad_batches"],
            "quality_rows_in": acct["rows_in"], "quality_rows_in_matches_bronze": acct["rows_in"] == bronze_rows,
            "final_window_problems": finals,
            "missing_files": files, "tables_checked": len(snapshot),
            "files_checked": sum(map(len, snapshot.values())),
        },
        "accounting_ok": acct["bad_batches"] == 0 and acct["rows_in"] == bronze_rows and no_reason == 0,
    }


# ---- the run ----------------------------------------------------------------------------------


def chaos_settings(cfg: ChaosConfig, kafka_port: int, mqtt_port: int) -> Settings:
    return load_settings(
        environ={}, telemetry=SENSOR.model_dump(mode="json"),
        data_root=str(cfg.root / "lake"),
        kafka={"bootstrap": f"127.0.0.1:{kafka_port}", "embedded_port": kafka_port,
               "topic": "telemetry", "dead_letter_topic": "telemetry-dlq",
               "partitions": cfg.partitions},
        mqtt={"host": "127.0.0.1", "port": mqtt_port, "embedded_port": mqtt_port,
              "client_id": "chaos-bridge", "topic_filter": "devices/+/telemetry"},
        bridge={"log_interval_seconds": 5.0},
        # bronze and silver in role processes of their own need the layered topology
        stream={"trigger_seconds": cfg.trigger_seconds,
                "topology": "layered" if {"bronze", "silver"} & set(cfg.roles) else "auto"},
        spark={"master": cfg.spark_master, "driver_memory": cfg.driver_memory, "shuffle_partitions": 2},
        observability={"metrics_port": 0},
    )


class Chaos:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        kp = cfg.kafka_port or free_port(pair=True)
        mp = cfg.mqtt_port or free_port()
        self.plan = self._plan()
        self.settings = chaos_settings(cfg, kp, mp)
        self.config_file = self.settings.save(cfg.root / "settings.json")
        lake = self.settings
        self.roles = {
            r: Role(r, self.config_file, cfg.root / "logs",
                    [Path(lake.checkpoint_path(q)) for q in ROLE_QUERIES[r]])
            for r in cfg.roles}
        self.brokers: dict[str, Any] = {}
        self.events: list[dict] = []
        self.outages = Counter()
        self.compacted: list[int] = []  # files rewritten by each compaction

    def _plan(self) -> list[tuple[float, str]]:
        """(seconds after the previous disruption, victim) for kills, broker outages, compactions."""
        cfg, rng = self.cfg, self.rng
        victims = [*cfg.roles, WHOLE_RUN]
        weights = [1.0] * len(cfg.roles) + [cfg.whole_run_weight]
        kinds = [rng.choices(victims, weights)[0] for _ in range(cfg.kills)]
        for broker, n in (("mosquitto", cfg.mosquitto_outages), ("kafka", cfg.kafka_outages)):
            for _ in range(n):
                kinds.insert(rng.randint(1, max(1, len(kinds))), f"broker:{broker}")
        for _ in range(cfg.compactions):
            kinds.insert(rng.randint(len(kinds) // 2 + 1, max(1, len(kinds))), "compact")
        return [(rng.uniform(*cfg.interval), k) for k in kinds]

    def log(self, msg: str) -> None:
        self.cfg.log(f"[chaos {time.strftime('%H:%M:%S')}] {msg}")

    # -- brokers --
    def start_broker(self, name: str) -> None:
        from lakehouse.kafka.topics import ensure_topics
        from orchestration.services import kafka_service, mosquitto_service

        s = self.settings
        svc = (kafka_service(s, s.kafka.embedded_port) if name == "kafka"
               else mosquitto_service(s, s.mqtt.embedded_port))
        self.brokers[name] = svc.start(timeout=120)
        if name == "kafka":
            ensure_topics(s)

    def stop_broker(self, name: str, kill9: bool = False) -> None:
        svc = self.brokers.pop(name)
        if kill9:  # records Kafka acknowledged are in its log files (page cache) already
            svc.proc.kill()
            svc.proc.wait(10)
        else:
            svc.stop()

    # -- supervision --
    def supervise(self) -> None:
        """Restart roles that died on their own (what a process supervisor would do)."""
        for r in self.roles.values():
            if r.proc is not None and not r.alive:
                r.crashes += 1
                tail = _log_tail(r.log_file)
                self.log(f"{r.name} exited by itself (rc={r.proc.returncode}); restarting. Log tail:\n{tail}")
                self.events.append({"t": self._t(), "crash": r.name, "rc": r.proc.returncode, "tail": tail})
                r.start()

    def _t(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def _wait_ready(self, roles: list[Role], batches: int = 1) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout
        while not all(r.ready(batches) for r in roles) and time.monotonic() < deadline:
            self.supervise()
            time.sleep(0.3)

    def compact(self) -> None:
        """Compact every table while the stream roles are working (compaction under load), once
        they committed a few batches since they started: small files to rewrite."""
        from orchestration.maintenance import compact

        self._wait_ready([r for r in self.roles.values() if r.name != "bridge"], batches=4)
        # ready() counts commits of all of a role's queries (no-data batches too): also wait for
        # bronze to hold more than one data file, or there may be nothing to rewrite yet
        bronze = self.settings.table_path("bronze")
        deadline = time.monotonic() + self.cfg.ready_timeout
        while time.monotonic() < deadline and _data_files(bronze) < 2:
            self.supervise()
            time.sleep(0.3)
        t = time.monotonic()
        tables = list(self.cfg.compact_tables) if self.cfg.compact_tables else None
        stats = compact(self.settings, tables)
        files = sum(x.get("files_removed", 0) for x in stats)
        self.compacted.append(files)
        self.events.append({"t": self._t(), "compact": files})
        self.log(f"compacted {', '.join(tables or ['every table'])} under load: {files} files "
                 f"rewritten in {time.monotonic() - t:.1f}s")

    def disrupt(self, victim: str) -> None:
        if victim == "compact":
            self.compact()
            return
        down = self.rng.uniform(*self.cfg.downtime)
        if victim.startswith("broker:"):
            broker = victim.split(":", 1)[1]
            # Mosquitto saves its queues on a clean stop only: kill -9 is for Kafka
            kill9 = broker == "kafka" and self.rng.random() < 0.5
            self.log(f"{'kill -9' if kill9 else 'stopping'} {broker} for {down:.1f}s")
            self.stop_broker(broker, kill9)
            self.outages[broker] += 1
            self.events.append({"t": self._t(), "outage": broker, "down_s": round(down, 1),
                                "kill9": kill9})
            time.sleep(down)
            self.start_broker(broker)
            self.log(f"{broker} back")
            return
        targets = list(self.roles.values()) if victim == WHOLE_RUN else [self.roles[victim]]
        self._wait_ready(targets)
        self._sleep(self.rng.uniform(0.0, 2.0))  # a random moment of the working pipeline
        self.log(f"kill -9 {victim}; down {down:.1f}s")
        for r in targets:
            r.kill9()
            r.kills += 1
        self.events.append({"t": self._t(), "kill": victim, "down_s": round(down, 1)})
        time.sleep(down)
        for r in targets:
            r.start()

    def drain(self, published: int) -> dict[str, bool]:
        """Wait until every layer caught up and stayed so; returns the last state."""
        deadline = time.monotonic() + self.cfg.drain_timeout
        stable, state = 0, {}
        while time.monotonic() < deadline:
            self.supervise()
            state = caught_up(self.settings, published)
            stable = stable + 1 if all(state.values()) else 0
            if stable >= 3:
                return state
            time.sleep(2.0)
        return state

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.monotonic()
        self.t0 = t_start
        s = self.settings
        event_rate = cfg.rate / cfg.event_time_speedup
        # a duplicate re-sends a reading at most one chunk old: keep a chunk well inside the
        # watermark, so no copy (nor an MQTT redelivery of one) arrives late
        chunk = max(100, min(10_000, int(event_rate * s.stream.watermark_seconds / 4)))
        source = message_stream(s, event_rate, cfg.devices, cfg.seed, cfg.start,
                                cfg.duplicate_fraction, cfg.malformed_fraction, chunk=chunk)
        publisher = None
        try:
            self.start_broker("kafka")
            self.start_broker("mosquitto")
            for r in self.roles.values():
                r.start()
            # Publish only once the bridge's session exists: MQTT keeps messages for a
            # subscription, and before the first one there is none.
            self._wait_ready([self.roles[r] for r in cfg.roles if r == "bridge"])
            self.log(f"roles started: {', '.join(self.roles)}; publishing at {cfg.rate:.0f} msg/s")
            publisher = Publisher(s, source, cfg.rate).start()
            self._sleep(cfg.warmup_seconds)
            for i, (gap, victim) in enumerate(self.plan):
                self._sleep(gap)
                self.disrupt(victim)
                self.log(f"disruption {i + 1}/{len(self.plan)} done ({victim}); sent {publisher.sent}")
            self._sleep(cfg.tail_seconds)
            published = publisher.finish()
            messages, publisher = publisher.messages[:published], None
            self.log(f"load stopped: {published} published; draining")
            state = self.drain(published)
            stuck = sorted(k for k, ok in state.items() if not ok)
            dead = sorted(r.name for r in self.roles.values() if not r.alive)
            self.log(f"drained: {state}; verifying")
            result = verify(s, messages)
        finally:
            if publisher is not None:
                with contextlib.suppress(Exception):
                    publisher.finish(timeout=10)
            rcs = {r.name: r.stop() for r in self.roles.values()}
            for b in list(self.brokers):
                self.stop_broker(b)
        kills = {r.name: r.kills for r in self.roles.values()}
        out = {
            "kills": sum(1 for e in self.events if "kill" in e),
            "published": published,
            "lost": result["lost"],
            "duplicated": result["duplicated"],
            "mismatched_windows": result["mismatched_windows"],
            "seconds": round(time.monotonic() - t_start, 1),
            "bronze_extra": result["bronze_extra"],
            "kills_by_role": kills,
            "whole_run_kills": sum(1 for e in self.events if e.get("kill") == WHOLE_RUN),
            "broker_outages": dict(self.outages),
            "compacted_files": self.compacted,
            "crashes": {r.name: r.crashes for r in self.roles.values()},
            "stuck": stuck + [f"{d} dead" for d in dead],
            "clean_exit": {k: v for k, v in rcs.items()},
            "rate": cfg.rate, "partitions": cfg.partitions,
            **{k: result[k] for k in ("bronze_rows", "silver_rows", "quarantine_rows", "gold_windows",
                                      "final_windows", "final_windows_bad", "accounting_ok")},
            "detail": {**result["detail"],  # why a role exited by itself (CI shows only this)
                       "crash_logs": [{k: e[k] for k in ("t", "crash", "rc", "tail")}
                                      for e in self.events if "crash" in e][:3]},
        }
        out["ok"] = (out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched_windows"] == 0
                     and out["final_windows_bad"] == 0 and not out["stuck"] and out["accounting_ok"]
                     and not result["detail"]["missing_files"])
        return out


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    cfg.root.mkdir(parents=True, exist_ok=True)
    return Chaos(cfg).run()


def summary_line(result: dict[str, Any]) -> str:
    """The bench's last line: one JSON object (floats finite)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v
    return json.dumps(clean(result))
