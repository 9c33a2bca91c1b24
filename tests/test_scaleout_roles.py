"""Scale-out: bronze, silver and gold as three processes (``iotlake run --role``), one killed -9.

Extended suite only: the default suite's test_chaos.py kills role processes (``--role bridge`` and
``--role streams``) and restarts them.

Its own file so pytest-xdist (``--dist loadfile``) runs it beside the other scale-out tests.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable
from test_scaleout import (
    CLI,
    EXTENDED,
    SPARK_FLAKES,
    START,
    _child_env,
    _count,
    _matches,
    _produce,
    _variant,
    _wait,
)

from ingest.simulator import generate
from lakehouse.settings import Settings


@pytest.mark.skipif(not EXTENDED, reason="IOTLAKE_EXTENDED_TESTS=1: three Spark processes (~3 min on "
                    "2 cores); kill -9 and restart of a role process is test_chaos.py's")
def test_roles_in_separate_processes_survive_kill_9(settings: Settings, tmp_path: Path) -> None:
    """bronze, silver and gold as three processes; silver is killed -9 mid-stream and restarted
    (long version: gold too)."""
    from test_pipeline import assert_gold_matches

    s = _variant(settings, tmp_path, "roles", master="local[1]", shuffle_partitions=2)
    cfg = s.save(tmp_path / "roles.json")
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    log_from: dict[str, int] = {}
    restarts: list[str] = []

    def start(role: str) -> None:
        log_file = tmp_path / f"role-{role}.log"
        log_from[role] = log_file.stat().st_size if log_file.exists() else 0
        with open(log_file, "a") as out:
            procs[role] = (subprocess.Popen([*CLI, "--config", str(cfg), "run", "--role", role],
                                            stdout=out, stderr=subprocess.STDOUT, env=_child_env()),
                            log_file)

    def restart(role: str) -> bool:
        """A supervisor's restart, only after one of Spark's own flakes (at most two)."""
        log = procs[role][1].read_bytes()[log_from[role]:].decode(errors="replace")
        if len(restarts) >= 2 or not any(f in log for f in SPARK_FLAKES):
            return False
        restarts.append(role)
        start(role)
        return True

    def wait(pred, timeout: float, what: str) -> None:
        _wait(pred, timeout, what, procs, restart)

    def kill9(role: str) -> None:
        p, _ = procs.pop(role)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    msgs = generate(s, 900, devices=6, duplicates=20, malformed=10, seed=11,
                    start=pd.Timestamp(START).to_pydatetime())

    def expect(n: int) -> tuple[int, int]:
        """(silver, quarantine) rows for the first n messages."""
        head = msgs[:n]
        return (len({m.event_id for m in head if m.kind in ("valid", "late", "duplicate")}),
                sum(m.kind == "malformed" for m in head))

    def layer_done(n: int) -> bool:
        return _count(s, "bronze") == n and (_count(s, "silver"), _count(s, "quarantine")) == expect(n)

    # Roles start one after another: on a loaded machine, three JVMs starting at once can miss
    # Spark's fixed 10 s for a Python worker to connect back.
    try:
        start("bronze")
        _produce(s, msgs[:300])
        wait(lambda: _count(s, "bronze") == 300, 240, "bronze 300")
        start("silver")
        wait(lambda: _count(s, "silver") + _count(s, "quarantine") > 0, 240, "silver rows")
        kill9("silver")  # mid-stream: a batch may be half committed
        _produce(s, msgs[300:600])
        wait(lambda: _count(s, "bronze") == 600, 120, "bronze 600 while silver is down")
        start("silver")
        wait(lambda: layer_done(600), 240, "silver to catch up after kill -9")
        start("gold")
        if EXTENDED:
            wait(lambda: _count(s, "gold_metrics_1m") > 0, 240, "gold rows")
            kill9("gold")
        _produce(s, msgs[600:])
        wait(lambda: layer_done(900), 240, "silver 900")
        if EXTENDED:
            start("gold")
        wait(lambda: _count(s, "gold_metrics_1m") > 0 and _matches(assert_gold_matches, s, msgs), 240,
              "gold to catch up")
        time.sleep(3)  # a duplicate write would show up now
    finally:
        for role in list(procs):
            p, _ = procs.pop(role)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    bronze = DeltaTable(s.table_path("bronze")).to_pandas()
    assert len(bronze) == 900 and not bronze.duplicated(["partition", "offset"]).any()
    silver = DeltaTable(s.table_path("silver")).to_pandas()
    assert len(silver) == 900 - 30 and silver["event_id"].is_unique
    assert _count(s, "quarantine") == 10
    assert_gold_matches(s, msgs)
    devices = DeltaTable(s.table_path("device_current")).to_pandas()
    assert sorted(devices["device_id"]) == [f"dev-{i:05d}" for i in range(1, 7)]
    print(f"\nroles: restarted after a Spark flake: {restarts or 'none'}")
