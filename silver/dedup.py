"""Silver's dedup index: event ids seen within the watermark, kept by the driver.

Spark's ``dropDuplicatesWithinWatermark`` scans its whole state store on every micro-batch to
evict expired keys (``numRowsReadDuringEviction`` = every state row; Spark 4.3's incremental
cleanup does not cover it). At 5,000 events/s with a 600 s watermark that is ~3M keys read per
batch, seconds of CPU, however few rows the batch holds. This index gives the same answer
(first occurrence of a key wins while its expiry, ``event time + delay_ms``, has not passed the
watermark) at a cost proportional to the batch, plus a merge of every live key once per few
dozen batches. Silver passes ``delay_ms = 0``: it quarantines rows at or before the watermark
as late before asking the index.

Each key is held as a 128-bit fingerprint (XXH64 of its UTF-8 bytes under two seeds, which
Spark's ``xxhash64`` computes on the executors: ``fingerprint_columns``) and its expiry: 24
bytes in sorted NumPy arrays, none of them a Python object per key. So the driver's memory
is flat once the watermark's worth of keys is live (rate x (watermark delay + the stream's
lag) keys: 72 MB for 3M keys at 5,000 events/s and 600 s), with no allocator fragmentation or
dict resizing to make it creep. Two different ids share a fingerprint with
probability ~2^-128 per pair.

Durability is the driver-held state's changelog (``lakehouse.streams.driver_state``): before
batch N's Delta commits, the keys it adds are written to ``<checkpoint>/dedup/N.arrow`` (the ids
themselves). After a restart the index is rebuilt from the files of batches < N less the
entries already expired; a replayed batch N rewrites its own file; a file goes once every key
in it has expired. ``stream.dedup = "state_store"`` keeps Spark's operator for volumes a driver should
not hold.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from pyspark.sql import Column
from pyspark.sql import functions as F

from lakehouse.streams.driver_state import Changelog

log = logging.getLogger(__name__)

_SCHEMA = pa.schema([("key", pa.string()), ("expiry_ms", pa.int64())])
_SPARK_SEED = 42  # the seed of Spark's xxhash64
_LOW_SALT = "iotlake-dedup-lo"
# Spark's xxhash64(a, b) hashes b with a's hash as the seed: the low half's seed
_LOW_SEED = xxhash.xxh64_intdigest(_LOW_SALT.encode(), _SPARK_SEED)


def fingerprint_columns(key: str) -> tuple[Column, Column]:
    """(high, low) halves of the key column's fingerprints, computed by Spark (signed 64-bit:
    ``from_spark`` reads them)."""
    return F.xxhash64(key), F.xxhash64(F.lit(_LOW_SALT), key)


def from_spark(hi: pa.ChunkedArray | pa.Array, lo: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``fingerprint_columns``' values as ``fingerprints`` returns them."""
    return tuple(np.asarray(c.to_numpy()).view(np.uint64) for c in (hi, lo))


def fingerprints(keys: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of each key's 128-bit fingerprint, as Spark computes them (a
    rebuild from the changelog, and keys that did not come from Spark)."""
    values = [k.encode() for k in keys.to_pylist()]
    return tuple(np.fromiter((xxhash.xxh64_intdigest(v, seed) for v in values), np.uint64, len(values))
                 for seed in (_SPARK_SEED, _LOW_SEED))


class _Run:
    """Fingerprints (high half sorted, low half and expiry alongside) of a set of keys."""

    __slots__ = ("hi", "lo", "exp")

    def __init__(self, hi=None, lo=None, exp=None) -> None:
        self.hi = np.empty(0, np.uint64) if hi is None else hi
        self.lo = np.empty(0, np.uint64) if lo is None else lo
        self.exp = np.empty(0, np.int64) if exp is None else exp

    def __len__(self) -> int:
        return len(self.hi)

    def live(self, watermark_ms: int) -> _Run:
        keep = self.exp > watermark_ms
        return self if keep.all() else _Run(self.hi[keep], self.lo[keep], self.exp[keep])

    def merged(self, other: _Run) -> _Run:
        at = np.searchsorted(self.hi, other.hi)
        return _Run(np.insert(self.hi, at, other.hi), np.insert(self.lo, at, other.lo),
                    np.insert(self.exp, at, other.exp))

    def member(self, hi: np.ndarray, lo: np.ndarray, watermark_ms: int) -> np.ndarray:
        """Whether each fingerprint is here and has not expired."""
        n = len(self.hi)
        if not n:
            return np.zeros(len(hi), bool)
        pos = np.searchsorted(self.hi, hi)
        at = np.minimum(pos, n - 1)
        same_hi = (pos < n) & (self.hi[at] == hi)
        found = same_hi & (self.lo[at] == lo) & (self.exp[at] > watermark_ms)
        # rare: another key shares the high half, or this key's expired entry sorts first
        for i in np.flatnonzero(same_hi & ~found):
            j = pos[i]
            while j < n and self.hi[j] == hi[i]:
                if self.lo[j] == lo[i] and self.exp[j] > watermark_ms:
                    found[i] = True
                    break
                j += 1
        return found


def _first_in_batch(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Whether each fingerprint is the first of its value in the batch."""
    order = np.argsort(hi, kind="stable")
    sh = hi[order]
    first = np.ones(len(hi), bool)
    tie = np.flatnonzero(sh[1:] == sh[:-1])
    if len(tie):  # equal high halves (duplicates, almost always): by both halves, then row
        rows = order[np.union1d(tie, tie + 1)]
        rows = rows[np.lexsort((rows, lo[rows], hi[rows]))]
        again = (hi[rows][1:] == hi[rows][:-1]) & (lo[rows][1:] == lo[rows][:-1])
        first[rows[1:][again]] = False
    return first


class DedupIndex:
    """Fingerprints of live keys with their expiry (epoch ms), rebuilt from the changelog.

    New keys go to a small ``fresh`` run; it is merged into ``main``, dropping what expired,
    once it holds an eighth as many keys as ``main``: each batch costs O(batch + fresh), and
    the O(keys) merge runs every few dozen batches at a steady rate."""

    def __init__(self, checkpoint: str, delay_ms: int) -> None:
        self.changelog = Changelog(Path(checkpoint, "dedup"), "dedup index")
        self.delay_ms = delay_ms
        self._main, self._fresh = _Run(), _Run()
        self._watermark_ms = -(2**63)
        self._files: dict[int, int] = {}  # batch id -> max expiry_ms of its keys
        self._pending: tuple[int, pa.Table, np.ndarray, np.ndarray] | None = None  # first_seen's fingerprints

    def __len__(self) -> int:
        """Live keys (expiry after the last watermark seen)."""
        wm = self._watermark_ms
        return int(np.count_nonzero(self._main.exp > wm) + np.count_nonzero(self._fresh.exp > wm))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for r in (self._main, self._fresh) for a in (r.hi, r.lo, r.exp))

    def __contains__(self, key: str) -> bool:
        hi, lo = fingerprints(pa.array([key], pa.string()))
        return bool(self._member(hi, lo)[0])

    # ---- per batch ---------------------------------------------------------------------------
    def first_seen(self, batch_id: int, keys: pa.ChunkedArray | pa.Array,
                   times_ms: pa.ChunkedArray | pa.Array, watermark_ms: int,
                   prints: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[pa.Array, pa.Table]:
        """(mask of rows to keep, their new keys with expiry) for one batch, index unchanged.
        ``prints``: the keys' ``fingerprints``, where Spark computed them.

        Rows with a null time are never duplicates (they have no event time to expire by).
        What expired at or before ``watermark_ms`` is forgotten."""
        self._ensure_loaded(batch_id, watermark_ms)
        self._watermark_ms = max(self._watermark_ms, watermark_ms)
        self._delete_spent_files()
        timed = pc.is_valid(times_ms).to_numpy(zero_copy_only=False)
        keep = np.ones(len(timed), bool)
        rows = np.flatnonzero(timed)
        if len(rows):
            if prints is None:
                hi, lo = fingerprints(pc.take(keys, pa.array(rows)))
            else:
                hi, lo = prints[0][rows], prints[1][rows]
            keep[rows] = _first_in_batch(hi, lo) & ~self._member(hi, lo)
        else:
            hi = lo = np.empty(0, np.uint64)
        new = np.flatnonzero(keep & timed)
        added = pa.table([pc.take(keys, pa.array(new)),
                          pc.add(pc.take(times_ms, pa.array(new)), self.delay_ms)], schema=_SCHEMA)
        # the new keys' fingerprints, for commit (hashing them again is a Python loop per key)
        kept = keep[rows]
        self._pending = (batch_id, added, hi[kept], lo[kept])
        return pa.array(keep, pa.bool_()), added

    def log(self, batch_id: int, added: pa.Table) -> None:
        """Write the batch's new keys durably (before the batch commits anything)."""
        if added.num_rows:
            self.changelog.write(batch_id, added)

    def commit(self, batch_id: int, added: pa.Table) -> None:
        """The batch committed: its keys join the index."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == batch_id and pending[1] is added:
            self._add(added, pending[2], pending[3])
        else:
            self._add(added)
        if added.num_rows:
            self._files[batch_id] = pc.max(added.column("expiry_ms")).as_py()
        self.changelog.next_batch = batch_id + 1

    def evict(self, watermark_ms: int) -> int:
        """Drop every key whose expiry is at or before the watermark now; how many went."""
        self._watermark_ms = max(self._watermark_ms, watermark_ms)
        before = len(self._main) + len(self._fresh)
        self._main = self._main.live(self._watermark_ms).merged(self._fresh.live(self._watermark_ms))
        self._fresh = _Run()
        self._delete_spent_files()
        return before - len(self._main)

    # ---- the runs ----------------------------------------------------------------------------
    def _member(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        wm = self._watermark_ms
        return self._main.member(hi, lo, wm) | self._fresh.member(hi, lo, wm)

    def _add(self, added: pa.Table, hi: np.ndarray | None = None, lo: np.ndarray | None = None) -> None:
        if not added.num_rows:
            return
        if hi is None:
            hi, lo = fingerprints(added.column("key"))
        exp = added.column("expiry_ms").to_numpy()
        order = np.argsort(hi, kind="stable")
        self._fresh = self._fresh.merged(_Run(hi[order], lo[order], exp[order]))
        if len(self._fresh) > max(len(self._main) // 8, 4096):
            self.evict(self._watermark_ms)

    def _delete_spent_files(self) -> None:
        for b in [b for b, m in self._files.items() if m <= self._watermark_ms]:
            del self._files[b]
            self.changelog.drop(b)

    # ---- rebuild -----------------------------------------------------------------------------
    def _ensure_loaded(self, batch_id: int, watermark_ms: int) -> None:
        if self.changelog.expects(batch_id):
            return
        self._main, self._fresh = _Run(), _Run()
        self._watermark_ms = watermark_ms
        self._files.clear()
        live_tables = []
        for b, t in self.changelog.replay(batch_id):
            live = t.filter(pc.greater(t.column("expiry_ms"), watermark_ms))
            if live.num_rows:
                live_tables.append(live)
                self._files[b] = pc.max(live.column("expiry_ms")).as_py()
            else:
                self.changelog.drop(b)
        if live_tables:
            self._add(pa.concat_tables(live_tables))
            self.evict(watermark_ms)
        self.changelog.next_batch = batch_id
        log.info("dedup index: %d keys live at batch %s", len(self), batch_id)
