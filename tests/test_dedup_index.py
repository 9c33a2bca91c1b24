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
    assert sorted(ix._expiry) == ["a", "c"]
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
    assert sorted(again._expiry) == ["a", "b", "c", "d", "e"]
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
    assert sorted(ix._expiry) == ["b", "c"]
