"""Benchmark: idempotent Arrow appends, iotlake's path against delta-rs's.

The driver appends Arrow tables it holds (device status history, alerts) once per micro-batch:
``lakehouse.delta.tables.append_table`` writes the Parquet files with pyarrow and commits them
through delta-spark's transaction with the batch as its app transaction. delta-rs offers the
same from Python alone: ``write_deltalake`` with ``CommitProperties(app_transactions=...)``,
after ``DeltaTable.transaction_version`` says the batch is new (delta-rs records the
transaction but does not skip a replay by itself). This appends the same batches of ``--rows``
status-history rows into pairs of tables iotlake created, alternating per append:
``partitioned`` as ``device_status_history`` is (its generated time-bucket partition column)
and ``plain`` (the same columns, no partitioning); then replays every batch (each must write
nothing) and checks that both tables of a pair read back the same rows.

    .venv/bin/python bench/delta_append.py [--appends 40] [--rows 200]

Last line, per kind: per-append median and p90 milliseconds of each path, their ratio
(delta-rs / iotlake), ``replays_written`` (must be 0) and ``same_rows``; or ``delta_rs_error``
where delta-rs cannot write to such a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from lakehouse.delta.tables import append_table, ensure_named_table, ensure_table
from lakehouse.settings import load_settings
from lakehouse.spark import spark_session
from lakehouse.tables import DEVICE_STATUS_HISTORY

TABLE = "device_status_history"
APP = "bench"


def batch(i: int, rows: int) -> pa.Table:
    t0 = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i)
    cols = {f.name: [] for f in DEVICE_STATUS_HISTORY}
    for r in range(rows):
        values = {"device_id": f"d-{r:05d}", "status": "online" if r % 3 else "degraded",
                  "previous_status": "offline", "reason": "data", "changed_at": t0 + timedelta(seconds=r % 60)}
        for f in DEVICE_STATUS_HISTORY:
            cols[f.name].append(values.get(f.name))
    return pa.table(cols, schema=DEVICE_STATUS_HISTORY)


def delta_rs_append(path: str, table: pa.Table, batch_id: int) -> bool:
    """One idempotent append through delta-rs; False if the batch was already committed."""
    dt = DeltaTable(path)
    try:
        if dt.transaction_version(APP) is not None and dt.transaction_version(APP) >= batch_id:
            return False
    except Exception:  # noqa: BLE001 - no transaction of this app yet
        pass
    write_deltalake(dt, table, mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction(APP, batch_id)]))
    return True


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def run(spark, root: Path, kind: str, appends: int, rows: int) -> dict:
    """Both paths on a fresh pair of tables: ``partitioned`` as iotlake creates
    ``device_status_history`` (generated time-bucket column), ``plain`` without partitioning."""
    paths = []
    for side in ("iotlake", "delta_rs"):
        if kind == "partitioned":
            s = load_settings(environ={}, data_root=str(root / kind / side))
            ensure_named_table(spark, s, TABLE, DEVICE_STATUS_HISTORY)
            paths.append(s.table_path(TABLE))
        else:
            paths.append(str(root / kind / side))
            ensure_table(spark, paths[-1], DEVICE_STATUS_HISTORY)
    p_ours, p_theirs = paths
    out: dict = {}
    ms: dict[str, list[float]] = {"iotlake": [], "delta_rs": []}
    for i in range(appends):
        t = batch(i, rows)
        c = time.perf_counter()
        append_table(spark, t, p_ours, APP, i)
        ms["iotlake"].append((time.perf_counter() - c) * 1000)
        if "delta_rs_error" not in out:
            c = time.perf_counter()
            try:
                delta_rs_append(p_theirs, t, i)
                ms["delta_rs"].append((time.perf_counter() - c) * 1000)
            except Exception as e:  # noqa: BLE001 - reported: what delta-rs refuses
                out["delta_rs_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for name, xs in ms.items():
        warm = xs[1:] or xs  # the first warms up
        out[f"{name}_ms_p50"] = round(statistics.median(warm), 1) if warm else None
        out[f"{name}_ms_p90"] = pct(warm, 0.9) if warm else None
    if "delta_rs_error" in out:
        return out
    versions = (DeltaTable(p_ours).version(), DeltaTable(p_theirs).version())
    replays = 0
    for i in range(appends):  # a replay of every batch writes nothing
        append_table(spark, batch(i, rows), p_ours, APP, i)
        replays += delta_rs_append(p_theirs, batch(i, rows), i)
    replays += (DeltaTable(p_ours).version(), DeltaTable(p_theirs).version()) != versions
    order = [(k, "ascending") for k in ("device_id", "changed_at")]
    cols = DEVICE_STATUS_HISTORY.names
    out["ratio"] = round(out["delta_rs_ms_p50"] / out["iotlake_ms_p50"], 2)
    out["replays_written"] = int(replays)
    out["same_rows"] = (DeltaTable(p_ours).to_pyarrow_table(columns=cols).sort_by(order)
                        .equals(DeltaTable(p_theirs).to_pyarrow_table(columns=cols).sort_by(order)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=40)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.appends, args.rows = 4, 20
    root = Path(tempfile.mkdtemp(prefix="iotlake-append-"))
    settings = load_settings(environ={}, data_root=str(root / "spark"),
                             spark={"master": "local[2]", "shuffle_partitions": 2})
    spark = spark_session(settings, app_name="bench-delta-append")
    try:
        got = {kind: run(spark, root, kind, args.appends, args.rows) for kind in ("partitioned", "plain")}
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"appends": args.appends, "rows": args.rows, **got}))


if __name__ == "__main__":
    main()
