"""Silver's driver-side dedup index: membership, eviction by watermark, rebuild after a crash."""

from __future__ import annotations

import pyarrow as pa
import pytest

from silver.dedup import DedupIndex

S = 1000  # ms


def batch(index: DedupIndex, batch_id: int, rows: list[tuple[str, int | None]], wm: int,
          commit: bool = True) -> list[bool]:
    keys = pa.array([k for k, _ in rows], pa.string())
    times = pa.array([t for _, t in rows], pa.int64())
    keep, added = index.first_seen(batch_id, keys, times, wm)
    index.log(batch_id, added)
    if commit:
        index.commit(batch_id, added)
    return keep.to_pylist()


def test_first_occurrence_wins_within_and_across_batches(tmp_path):
    ix = DedupIndex(str(tmp_path), delay_ms=60 * S)
    assert batch(ix, 0, [("a", 10 * S), ("b", 11 * S), ("a", 12 * S), ("x", None), ("x", None)],
                 wm=0) == [True, True, False, True, True]  # no event time: never a duplicate
    assert batch(ix, 1, [("b", 99 * S), ("c", 20 * S)], wm=0) == [False, True]
    assert len(ix) == 3
    assert sorted(p.name for p in (tmp_path / "dedup").iterdir()) == ["0.arrow", "1.arrow"]


def test_keys_expire_at_event_time_plus_delay(tmp_path):
    ix = DedupIndex(str(tmp_path), delay_ms=60 * S)
    batch(ix, 0, [("a", 10 * S), ("b", 30 * S)], wm=0)
    # a expires at 70 s, b at 90 s: a watermark of exactly 70 s forgets a, keeps b
    assert batch(ix, 1, [("a", 71 * S), ("b", 80 * S)], wm=70 * S) == [True, False]
    assert len(ix) == 2  # b, and a again (expiry 131 s)
    assert batch(ix, 2, [("c", 95 * S)], wm=90 * S) == [True]
    assert [k for k in "abc" if k in ix] == ["a", "c"]
    # batch 0's file held only expired keys: deleted; the others still hold live ones
    assert sorted(p.name for p in (tmp_path / "dedup").iterdir()) == ["1.arrow", "2.arrow"]


def test_rebuild_after_a_crash_ignores_the_uncommitted_batch(tmp_path):
    ix = DedupIndex(str(tmp_path), delay_ms=60 * S)
    batch(ix, 0, [("a", 10 * S), ("b", 20 * S)], wm=0)
    batch(ix, 1, [("c", 30 * S)], wm=0)
    batch(ix, 2, [("d", 40 * S)], wm=0, commit=False)  # logged, then the process died
    again = DedupIndex(str(tmp_path), delay_ms=60 * S)  # a restart replays batch 2
    assert batch(again, 2, [("d", 40 * S), ("a", 41 * S), ("e", 42 * S)], wm=75 * S) == [
        True, True, True]  # a expired at 70 s; d is new again (its batch never committed)
    assert len(again) == 5 and all(k in again for k in "abcde")
    # a replay of a batch the index already moved past rebuilds from the files before it
    assert batch(again, 1, [("c", 30 * S), ("b", 20 * S)], wm=0) == [True, False]


def test_a_checkpoint_keeps_its_dedup_mode(tmp_path):
    from silver.stream import pin_dedup_mode

    ck = tmp_path / "ck"
    pin_dedup_mode(str(ck), "index")
    pin_dedup_mode(str(ck), "index")  # same mode: fine
    with pytest.raises(ValueError, match=r"started with stream.dedup = 'index'.*set stream.dedup"):
        pin_dedup_mode(str(ck), "state_store")
    legacy = tmp_path / "legacy"  # started before the setting existed: Spark's state store
    (legacy / "offsets").mkdir(parents=True)
    with pytest.raises(ValueError, match="'state_store', not 'index'"):
        pin_dedup_mode(str(legacy), "index")
    pin_dedup_mode(str(legacy), "state_store")


def test_without_delay_a_key_lives_until_the_watermark_reaches_its_event_time(tmp_path):
    """Silver's setting: a copy at or before the watermark is late (quarantined before the index
    is asked), so the index need not remember its key any longer."""
    ix = DedupIndex(str(tmp_path), delay_ms=0)
    batch(ix, 0, [("a", 10 * S), ("b", 20 * S)], wm=0)
    assert batch(ix, 1, [("a", 11 * S), ("b", 21 * S)], wm=10 * S - 1) == [False, False]
    assert batch(ix, 2, [("c", 30 * S)], wm=10 * S) == [True]
    assert [k for k in "abc" if k in ix] == ["b", "c"]


def test_keys_whose_fingerprints_share_a_high_half_stay_apart(tmp_path, monkeypatch):
    """The index sorts by the fingerprint's high 64 bits; two ids sharing them (rare, not
    impossible) are still told apart by the low half."""
    import numpy as np

    import silver.dedup as dedup

    def shared_high_half(keys):
        hi, lo = real(keys)
        return np.zeros_like(hi), lo

    real = dedup.fingerprints
    monkeypatch.setattr(dedup, "fingerprints", shared_high_half)
    ix = DedupIndex(str(tmp_path), delay_ms=60 * S)
    assert batch(ix, 0, [("a", 10 * S), ("b", 11 * S), ("c", 12 * S)], wm=0) == [True, True, True]
    assert batch(ix, 1, [("c", 13 * S), ("d", 14 * S), ("a", 15 * S), ("d", 16 * S)], wm=0) == [
        False, True, False, False]
    assert len(ix) == 4


def test_memory_is_24_bytes_per_live_key(tmp_path):
    ix = DedupIndex(str(tmp_path), delay_ms=0)
    batch(ix, 0, [(f"event-{i}", 10 * S + i) for i in range(10_000)], wm=0)
    assert len(ix) == 10_000 and ix.nbytes == 24 * 10_000
    batch(ix, 1, [("late-key", 20_000 * S)], wm=10 * S + 4_999)  # the first 5,000 expire
    assert len(ix) == 5_001 and "event-4999" not in ix and "event-5000" in ix
    assert ix.evict(10 * S + 4_999) == 5_000 and ix.nbytes == 24 * 5_001  # dropped at the next merge


def test_fresh_keys_merge_into_the_main_run_without_their_expired_ones(tmp_path):
    """Thousands of small batches: membership holds across the merges, and what expired goes."""
    ix = DedupIndex(str(tmp_path), delay_ms=0)
    for b in range(40):  # 500 keys per batch, 10 s of event time, a 100 s watermark delay
        rows = [(f"k{b}-{i}", (b * 10 + i // 50) * S) for i in range(500)]
        assert sum(batch(ix, b, rows + rows[:3], wm=(b * 10 - 100) * S)) == 500
    assert batch(ix, 40, [("k39-0", 390 * S), ("k30-499", 309 * S), ("k28-0", 280 * S)],
                 wm=300 * S) == [False, False, True]  # k28-0 expired at 280 s: new again
    assert len(ix) == 500 * 9 + 450  # batch 30's first 50 keys expire at 300 s, as k28-0 does
    assert ix.nbytes <= 24 * 500 * 16  # never more than twice the ~10 batches a watermark holds


def test_spark_and_the_driver_compute_the_same_fingerprints(spark):
    """A batch's fingerprints come from Spark, a rebuild's from the driver: the same keys must
    give the same fingerprints (ids of every kind: unicode, empty, long)."""
    import numpy as np

    from silver.dedup import fingerprint_columns, fingerprints, from_spark

    keys = ["a", "", "3f2b8c1e-4a5d-4e6f-9a7b-000000000001", "Kühlraum-Ost/传感器", "x" * 1000,
            "bronze:telemetry:0:17"] + [f"event-{i}" for i in range(200)]
    df = spark.createDataFrame([(k,) for k in keys], "key string")
    got = df.select("key", *(c.alias(n) for c, n in zip(fingerprint_columns("key"), "hl", strict=True)))
    got = got.toArrow()
    assert got.column("key").to_pylist() == keys
    spark_hi, spark_lo = from_spark(got.column("h"), got.column("l"))
    hi, lo = fingerprints(got.column("key"))
    assert np.array_equal(spark_hi, hi) and np.array_equal(spark_lo, lo)
    assert len(set(zip(hi.tolist(), lo.tolist(), strict=True))) == len(keys)
    assert not np.array_equal(hi, lo)  # two seeds, two halves
