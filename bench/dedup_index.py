"""Silver's dedup index alone: CPU per batch and the driver's memory as the watermark fills.

Feeds ``silver.dedup.DedupIndex`` batches of new event ids at ``--rate`` per second of event
time (one duplicate per batch), with the watermark ``--watermark-seconds`` behind, as silver
does, and samples this process's RSS (glibc's mmap threshold fixed, as in ``iotlake run``). No Spark, no broker: the index's own cost.
Last line: ``keys``, ``bytes_per_key``, ``cpu_ms_per_batch``, ``rss_mb`` when the watermark
is first full, ``rss_mb_end`` and ``rss_growth_mb_after_full`` (end minus the most at or
before the first full watermark: 0 when memory is flat once the index holds its steady count).

    .venv/bin/python bench/dedup_index.py [--rate 1000] [--minutes 60] [--watermark-seconds 600]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lakehouse.runtime import native_memory  # noqa: E402
from silver.dedup import DedupIndex, fingerprints  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=1000, help="new event ids per second of event time")
    ap.add_argument("--minutes", type=float, default=60, help="minutes of event time")
    ap.add_argument("--watermark-seconds", type=int, default=600)
    ap.add_argument("--batch-seconds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rate, args.minutes, args.watermark_seconds = 100, 3, 60
    native_memory.fix_mmap_threshold()  # as `iotlake run` does
    with tempfile.TemporaryDirectory(prefix="iotlake-dedup-index-") as tmp:
        index = DedupIndex(tmp, delay_ms=0)
        start = 1_700_000_000_000
        batches = int(args.minutes * 60 // args.batch_seconds)
        full_at = args.watermark_seconds // args.batch_seconds
        cpu, peak_before_full, rss_full = 0.0, 0.0, None
        for b in range(batches):
            now = start + b * args.batch_seconds * 1000
            ids = [uuid.uuid4().hex for _ in range(args.rate * args.batch_seconds)] + ["repeated"]
            keys, times = pa.array(ids, pa.string()), pa.array([now] * len(ids), pa.int64())
            prints = fingerprints(keys)  # silver's Spark job computes these, not the driver
            c = time.process_time()
            _, added = index.first_seen(b, keys, times, now - args.watermark_seconds * 1000, prints)
            index.commit(b, added)
            cpu += time.process_time() - c
            if b <= full_at:
                peak_before_full = max(peak_before_full, rss_mb())
            if b == full_at:
                rss_full = rss_mb()
        end = rss_mb()
    out = {"rate": args.rate, "minutes": args.minutes, "watermark_seconds": args.watermark_seconds,
           "keys": len(index), "bytes_per_key": round(index.nbytes / max(len(index), 1), 1),
           "cpu_ms_per_batch": round(1000 * cpu / batches, 2), "rss_mb": round(rss_full or end, 1),
           "rss_mb_end": round(end, 1), "rss_growth_mb_after_full": round(end - peak_before_full, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
