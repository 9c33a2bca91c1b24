"""Gold anomaly detector: pure numpy tests (no Spark, no brokers)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from gold.anomaly import (
    STATE_FIELDS,
    DetectorConfig,
    DetectorState,
    WindowedGaussianBaseline,
    WindowedGaussianConfig,
    initial_rows,
    initial_state,
    score_batch,
    score_lanes,
    score_lanes_at,
    state_fields,
    state_schema_ddl,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.nab_scoring import corpus_score, score_series  # noqa: E402

T0 = 1_700_000_000.0  # epoch seconds
STEP = 60.0
SPIKES = {900: +12.0, 1500: -12.0}
SHIFT_AT, SHIFT = 2100, +10.0
FLAT_FROM, FLAT_LEN = 2900, 60  # after the level shift's episode (~550 readings, wide views)
N = 3300


def synthetic(seed: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Gaussian noise (sd 1) around 20, two spikes, a level shift, a flat-line stretch."""
    rng = np.random.default_rng(seed)
    x = 20.0 + rng.normal(0.0, 1.0, N)
    for i, d in SPIKES.items():
        x[i] += d
    x[SHIFT_AT:] += SHIFT
    x[FLAT_FROM:FLAT_FROM + FLAT_LEN] = x[FLAT_FROM]
    t = T0 + STEP * np.arange(N)
    cfg = DetectorConfig()
    expected = sorted(SPIKES) + [SHIFT_AT, FLAT_FROM + round(cfg.flat_min_run * cfg.flat_margin)]
    return x, t, expected


@pytest.mark.parametrize("seed", range(5))
def test_flags_exactly_the_injected_anomalies(seed: int) -> None:
    x, t, expected = synthetic(seed)
    scores, baselines, flags, _ = score_batch(x, t, None, DetectorConfig())
    got = np.flatnonzero(flags).tolist()
    assert len(got) == len(expected), (got, expected)
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1, (got, expected)
    assert np.all((scores >= 0.0) & (scores <= 1.0))
    assert np.all(scores[flags] >= DetectorConfig().threshold)
    # the spike was compared against the level around 20, the shift against the old level
    assert abs(baselines[900] - 20.0) < 1.5
    assert abs(baselines[SHIFT_AT] - 20.0) < 1.5


@pytest.mark.parametrize("seed", range(3))
def test_quiet_on_pure_noise(seed: int) -> None:
    """Gaussian noise: no flag in 20k readings; t(8) noise: its rare >7-sigma draws at most."""
    rng = np.random.default_rng(100 + seed)
    t = T0 + 300.0 * np.arange(20_000)
    _, _, flags, _ = score_batch(5.0 + rng.normal(0.0, 1.0, t.size), t, None)
    assert flags.sum() == 0
    x = 5.0 + rng.standard_t(df=8, size=t.size)
    scores, _, flags, _ = score_batch(x, t, None)
    assert flags.sum() <= 4
    assert np.all(np.abs(x[flags] - 5.0) > 6.0)  # only genuine outliers


def test_daily_profile_flags_a_missing_peak() -> None:
    """A daily square wave (5-min readings) is normal; a day without its peak is not."""
    rng = np.random.default_rng(7)
    per_day = 288
    days = 8
    i = np.arange(per_day * days)
    tod = i % per_day
    x = np.where((tod >= 108) & (tod < 216), 80.0, 20.0) + rng.normal(0.0, 2.0, i.size)
    missing_day = 6
    peak = slice(missing_day * per_day + 108, missing_day * per_day + 216)
    x[peak] = 20.0 + rng.normal(0.0, 2.0, 108)
    t = T0 - (T0 % 86400) + 300.0 * i  # midnight-aligned
    _, _, flags, _ = score_batch(x, t, None)
    got = np.flatnonzero(flags)
    after_warmup = got[got >= 2 * per_day]  # the first two days teach the profile
    assert after_warmup.size == 1, after_warmup
    assert peak.start <= after_warmup[0] < peak.start + 24  # within 2 hours


@pytest.mark.parametrize("seed", range(3))
def test_chunked_equals_whole_and_state_round_trips(seed: int) -> None:
    x, t, _ = synthetic(seed)
    x = x.copy()
    x[[5, 1000, 2000]] = np.nan  # missing readings pass through
    cfg = DetectorConfig()
    whole = score_batch(x, t, None, cfg)
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, N), size=60, replace=False))
    cuts = np.unique(np.concatenate([[0, 1, 2, 3], cuts, [N]]))
    parts = []
    state = None
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        s, bl, f, state = score_batch(x[a:b], t[a:b], state, cfg)
        parts.append((s, bl, f))
        state = DetectorState.from_row(state.to_row())  # as if stored in Spark's state store
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    assert state.to_row() == whole[3].to_row()
    assert np.isnan(whole[0][[5, 1000, 2000]]).sum() == 0
    assert not whole[2][[5, 1000, 2000]].any()


def test_score_lanes_equals_score_batch_per_lane_in_any_chunking() -> None:
    """One compiled call over many lanes is score_batch per lane, however the readings are split."""
    rng = np.random.default_rng(9)
    cfg = DetectorConfig()
    lanes = [synthetic(seed)[:2] for seed in range(3)]
    x = 5.0 + rng.standard_t(3, 700)
    x[rng.random(700) < 0.05] = np.nan
    lanes += [(x, T0 + 37.0 * np.arange(700)),  # another time grid, missing readings
              (np.array([]), np.array([])),  # a lane without readings keeps its state
              (np.array([1.0, np.nan, 2.0]), T0 + np.arange(3.0))]
    counts = rng.poisson(4.0, 700).astype(float)
    lanes += [(counts, T0 + 60.0 * np.arange(700)),  # counts: the count scale
              (np.r_[counts[:30], 2.5, counts[31:]], T0 + 60.0 * np.arange(700))]  # then not
    expected = [score_batch(x, t, None, cfg) for x, t in lanes]

    rounds = 6  # every lane cut at its own random points (empty chunks included)
    cuts = [np.sort(np.r_[0, rng.integers(0, len(x) + 1, rounds - 1), len(x)]) for x, _ in lanes]
    states = initial_rows(len(lanes), cfg)
    got: list[list[tuple]] = [[] for _ in lanes]
    for r in range(rounds):
        parts = [(x[c[r]:c[r + 1]], t[c[r]:c[r + 1]]) for (x, t), c in zip(lanes, cuts, strict=True)]
        offsets = np.r_[0, np.cumsum([len(p[0]) for p in parts])]
        before = states.copy()
        sc, bl, fl, nb, new = score_lanes(np.concatenate([p[0] for p in parts]),
                                          np.concatenate([p[1] for p in parts]),
                                          offsets, states, cfg)
        np.testing.assert_array_equal(states, before)  # the input is not modified
        states = new
        for j, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            got[j].append((sc[a:b], bl[a:b], fl[a:b], nb[a:b]))
    for j, (s, bl, f, st) in enumerate(expected):
        for k, want in enumerate((s, bl, f)):
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got[j]]), want)
        np.testing.assert_array_equal(states[j], np.asarray(st.to_row()))
    # n_before counts the readings learnt so far (NaN readings are not learnt)
    nb0 = np.concatenate([g[3] for g in got[0]])
    np.testing.assert_array_equal(nb0, np.arange(N))
    with pytest.raises(ValueError, match="offsets"):
        score_lanes(np.zeros(3), np.zeros(3), [0, 2], initial_rows(1, cfg), cfg)


def test_score_lanes_at_scores_states_where_they_are_held() -> None:
    """Lanes scored on rows of a larger matrix, in any order: the same scores and new states as
    score_lanes, written back in place; rows no lane names, and lanes without a valid reading,
    keep their values."""
    cfg = DetectorConfig()
    lanes = [synthetic(seed)[:2] for seed in range(3)] + [(np.array([np.nan]), T0 + np.arange(1.0))]

    def joined(part: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.concatenate([v[part] for v, _ in lanes]), np.concatenate([w[part] for _, w in lanes]),
                np.r_[0, np.cumsum([len(v[part]) for v, _ in lanes])])
    warm = score_lanes(*joined(slice(0, 500)), initial_rows(len(lanes), cfg), cfg)[4]
    x, t, offsets = joined(slice(500, None))
    want = score_lanes(x, t, offsets, warm, cfg, explain=True)
    held = np.full((9, warm.shape[1]), -1.0)  # rows 0, 2, 4, 5 and 8 unnamed
    rows = [7, 3, 1, 6]
    held[rows] = warm
    got = score_lanes_at(x, t, offsets, held, rows, cfg)
    for g, w in zip(got, (*want[:4], *want[5:]), strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(held[rows], want[4])
    np.testing.assert_array_equal(held[6], warm[3])  # no valid reading: as it was
    assert (held[[0, 2, 4, 5, 8]] == -1.0).all()
    for bad, match in ((np.ascontiguousarray(held[:, :-1]), "layout"), (held[::2], "C-contiguous"),
                       (held.astype(np.float32), "C-contiguous")):
        with pytest.raises(ValueError, match=match):
            score_lanes_at(x, t, offsets, bad, [0, 1, 2, 3], cfg)
    with pytest.raises(ValueError, match="distinct"):
        score_lanes_at(x, t, offsets, held, [7, 7, 1, 6], cfg)
    with pytest.raises(ValueError, match="version"):
        score_lanes_at(x, t, offsets, held, [7, 3, 1, 0], cfg)


def test_state_row_layout() -> None:
    st = initial_state()
    row = st.to_row()
    assert len(row) == len(STATE_FIELDS) == 30 + 4 * DetectorConfig().season_bins
    assert all(isinstance(v, float) for v in row)
    assert all(typ == "double" for _, typ in STATE_FIELDS)
    assert len({name for name, _ in STATE_FIELDS}) == len(STATE_FIELDS)
    x, t, _ = synthetic(0)
    _, _, _, st = score_batch(x[:500], t[:500], None)
    again = DetectorState.from_row(st.to_row())
    assert again.to_row() == st.to_row()
    small = DetectorConfig(season_bins=8)
    assert len(initial_state(small).to_row()) == len(state_fields(small))
    assert state_schema_ddl(small).startswith("version DOUBLE, n DOUBLE")
    with pytest.raises(ValueError, match="season bins"):
        score_batch(x[:10], t[:10], initial_state(small), DetectorConfig())
    with pytest.raises(ValueError, match="does not match"):
        DetectorState.from_row(row[:-1])


def test_input_is_not_mutated_and_empty_batches() -> None:
    x, t, _ = synthetic(1)
    _, _, _, st = score_batch(x[:300], t[:300], None)
    before = st.to_row()
    score_batch(x[300:600], t[300:600], st)
    assert st.to_row() == before
    s, b, f, st2 = score_batch(np.array([]), np.array([]), st)
    assert s.size == b.size == f.size == 0 and st2.to_row() == before


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="threshold"):
        DetectorConfig(threshold=1.5)
    with pytest.raises(ValueError, match="season_bins"):
        DetectorConfig(season_bins=0)


def test_windowed_gaussian_baseline() -> None:
    x, t, _ = synthetic(2)
    det = WindowedGaussianBaseline(WindowedGaussianConfig(window=500, z_threshold=6.0))
    s, mean, f, st = det.score_batch(x, t, None)
    assert np.all((s >= 0) & (s <= 1))
    assert f[900] and f[1500]
    parts, state = [], None
    for a in range(0, N, 700):
        parts.append(det.score_batch(x[a:a + 700], t[a:a + 700], state))
        state = parts[-1][3]
    np.testing.assert_allclose(np.concatenate([p[0] for p in parts]), s, rtol=0, atol=1e-9)
    assert len(state.values) == 500


def test_nab_scoring_null_and_perfect() -> None:
    n = 2000
    ts = (np.arange(n) * 300 * 10**9).astype(np.int64)
    windows = [(ts[1000], ts[1099]), (ts[1500], ts[1599])]
    null = score_series(ts, np.zeros(n, bool), windows)
    perfect_flags = np.zeros(n, bool)
    perfect_flags[[1000, 1500]] = True
    perfect = score_series(ts, perfect_flags, windows)
    assert null.normalized == 0.0 and math.isclose(perfect.normalized, 100.0)
    late = perfect_flags.copy()
    late[1500], late[1599] = False, True  # last reading of the window: ~0 reward
    fp = perfect_flags.copy()
    fp[400] = True  # before any window: -0.11
    assert score_series(ts, late, windows).raw < perfect.raw
    assert math.isclose(score_series(ts, fp, windows).raw, perfect.raw - 0.11)
    probation = perfect_flags.copy()
    probation[100] = True  # inside the probationary 15%: ignored
    assert score_series(ts, probation, windows).raw == perfect.raw
    assert math.isclose(corpus_score([null, perfect]), 50.0)


def test_explain_names_the_view_and_its_expected_range() -> None:
    """score_lanes(explain=True): the view behind each score, and the range it expected."""
    from gold.anomaly import MODELS

    x, t, _ = synthetic(0)
    cfg = DetectorConfig()
    s, bl, f, _, _, model, low, high = score_lanes(x, t, [0, N], initial_rows(1, cfg), cfg,
                                                   explain=True)
    np.testing.assert_array_equal(s, score_batch(x, t, None, cfg)[0])
    assert model[0] == 0 and np.all(model[1:] > 0) and model.max() < len(MODELS)
    for i in np.flatnonzero(f):
        name = MODELS[model[i]]
        if name in ("fast", "wide"):  # views of the reading itself: it lies outside the range
            assert not low[i] <= x[i] <= high[i], (i, name, low[i], x[i], high[i])
        if name != "flat":
            assert low[i] <= bl[i] <= high[i], (i, name)
    assert MODELS[model[900]] in ("fast", "wide") and x[900] > high[900]
    assert MODELS[model[1500]] in ("fast", "wide") and x[1500] < low[1500]


def _warm_row(seed: int) -> tuple[np.ndarray, np.ndarray, DetectorConfig, np.ndarray]:
    """6,000 daily-cycle readings with a spike at 5,000, and the state after the first 4,000."""
    rng = np.random.default_rng(seed)
    n = 6000
    t = T0 + 300.0 * np.arange(n)
    x = 50.0 + 5.0 * np.sin(2 * np.pi * t / 86400) + rng.normal(0.0, 1.0, n)
    x[5000] += 30.0
    cfg = DetectorConfig()
    _, _, _, st = score_batch(x[:4000], t[:4000], None, cfg)
    return x, t, cfg, np.asarray(st.to_row())


def test_version_1_state_continues_without_warm_up() -> None:
    """A state row of the previous layout is upgraded: no re-warm-up, no burst of flags."""
    from gold.anomaly import _V1_SCALARS, upgrade_rows

    x, t, cfg, row = _warm_row(3)
    n = x.size
    v1 = np.r_[1.0, row[1:_V1_SCALARS], row[len(initial_state().to_row()) - 4 * cfg.season_bins:]]
    assert v1.size == _V1_SCALARS + 4 * cfg.season_bins
    up = upgrade_rows(v1[None, :], cfg)
    assert up.shape == (1, len(STATE_FIELDS)) and up[0, 0] == row[0]
    assert DetectorState.from_row(v1.tolist()).to_row() == tuple(up[0])
    _, _, f, nb, _ = score_lanes(x[4000:], t[4000:], [0, n - 4000], up, cfg)
    assert nb[0] == 4000  # the count carries on: flags are possible at once
    assert np.flatnonzero(f).tolist() == [1000]  # the spike, and nothing from the upgrade
    np.testing.assert_array_equal(upgrade_rows(up, cfg), up)  # current rows pass through
    with pytest.raises(ValueError, match="neither"):
        upgrade_rows(v1[None, :-1], cfg)
    # the same as the state kept at the current version, but for the views the upgrade guessed
    np.testing.assert_array_equal(f, score_lanes(x[4000:], t[4000:], [0, n - 4000],
                                                 row[None, :], cfg)[2])


def test_version_2_state_continues_without_warm_up() -> None:
    """A version-2 row (before the short view's tail quantiles) upgrades without a warm-up."""
    import gold.state_store as health
    from gold.anomaly import _V2_SCALARS, upgrade_rows

    x, t, cfg, row = _warm_row(4)
    n = x.size
    v2 = np.r_[2.0, row[1:_V2_SCALARS], row[row.size - 4 * cfg.season_bins:]]
    up = upgrade_rows(v2[None, :], cfg)
    assert up.shape == (1, len(STATE_FIELDS)) and up[0, 0] == row[0]
    np.testing.assert_array_equal(up[0, :_V2_SCALARS], np.r_[row[0], row[1:_V2_SCALARS]])
    assert up[0, _V2_SCALARS] == row[25] and up[0, _V2_SCALARS + 1] == row[26]  # wide tails
    assert DetectorState.from_row(v2.tolist()).to_row() == tuple(up[0])
    _, _, f, nb, _ = score_lanes(x[4000:], t[4000:], [0, n - 4000], up, cfg)
    assert nb[0] == 4000
    assert np.flatnonzero(f).tolist() == [1000]
    with pytest.raises(ValueError, match="neither"):
        upgrade_rows(v2[None, :-1], cfg)
    # through the state store's encoding as well
    metrics = ("a", "b", "c")
    k = len(metrics)
    b = health.Bucket.empty(v2.size, k)
    b.index(np.array(["dev-1"], dtype=object))
    b.dets[0, 0] = v2
    b.det_set[0, 0] = True
    got = health.load_devices(health.dump_devices(b, metrics), len(STATE_FIELDS), metrics, cfg=cfg)
    np.testing.assert_array_equal(got.dets[0, 0], up[0])


def test_health_state_of_version_1_loads_upgraded() -> None:
    """The state store's bucket state written by the previous detector loads without a re-warm-up."""
    import gold.state_store as health
    from gold.anomaly import _V1_SCALARS

    cfg = DetectorConfig()
    x, t, _ = synthetic(1)
    row = np.asarray(score_batch(x[:800], t[:800], None, cfg)[3].to_row())
    v1 = np.r_[1.0, row[1:_V1_SCALARS], row[row.size - 4 * cfg.season_bins:]]
    metrics = ("a", "b", "c")
    k = len(metrics)
    b = health.Bucket.empty(v1.size, k)
    b.index(np.array(["dev-1", "dev-2"], dtype=object))
    b.dets[0, 0] = v1  # dev-1 has a version-1 state for the first metric only
    b.det_set[0, 0] = True
    got = health.load_devices(health.dump_devices(b, metrics), len(STATE_FIELDS), metrics, cfg=cfg)
    assert got.dets.shape == (k, 2, len(STATE_FIELDS))
    assert got.det_set.tolist() == b.det_set.tolist()
    assert got.dets[0, 0, 0] == row[0] and got.dets[0, 0, 1] == 800  # version, readings learnt
    np.testing.assert_array_equal(got.dets[0, 0], DetectorState.from_row(v1.tolist()).to_row())
    same = health.load_devices(health.dump_devices(got, metrics), len(STATE_FIELDS), metrics, cfg=cfg)
    np.testing.assert_array_equal(same.dets, got.dets)  # current states pass through


def test_version_3_state_continues_unchanged() -> None:
    """A version-3 row (before the count scale) was learnt on the raw scale and stays there."""
    from gold.anomaly import _V3_SCALARS, upgrade_rows

    x, t, cfg, row = _warm_row(5)
    n = x.size
    assert row[_V3_SCALARS] == 0.0  # readings that are not counts: the raw scale
    v3 = np.r_[3.0, row[1:_V3_SCALARS], row[row.size - 4 * cfg.season_bins:]]
    up = upgrade_rows(v3[None, :], cfg)
    np.testing.assert_array_equal(up[0], row)
    assert DetectorState.from_row(v3.tolist()).to_row() == tuple(up[0])
    _, _, f, nb, _ = score_lanes(x[4000:], t[4000:], [0, n - 4000], up, cfg)
    assert nb[0] == 4000 and np.flatnonzero(f).tolist() == [1000]
    with pytest.raises(ValueError, match="neither"):
        upgrade_rows(v3[None, :-1], cfg)


def _counts(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Poisson counts every 5 minutes with a daily cycle (mean 10-30), a burst at 5,000."""
    rng = np.random.default_rng(seed)
    t = T0 + 300.0 * np.arange(6000)
    x = rng.poisson(20.0 + 10.0 * np.sin(2 * np.pi * t / 86400)).astype(float)
    x[5000] += 60.0
    return x, t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_are_scored_on_the_count_scale(seed: int) -> None:
    """A key of non-negative integers is scored on the count scale; its explanations are in
    the reading's own units; a key that sends anything else during its warm-up is scored on the
    raw scale, exactly as if it had started with that reading."""
    from gold.anomaly import _V3_SCALARS

    x, t = _counts(seed)
    cfg = DetectorConfig()
    s, bl, f, _, st, _, low, high = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg,
                                                explain=True)
    assert st[0, _V3_SCALARS] == 1.0
    assert np.flatnonzero(f).tolist() == [5000]
    assert x[5000] > high[5000] and low[5000] <= bl[5000] <= high[5000]
    assert 5.0 < bl[5000] < 40.0  # the expected count, not its square root
    y = x.copy()
    y[50] += 0.5  # not a count, within the warm-up
    got = score_lanes(y, t, [0, y.size], initial_rows(1, cfg), cfg)
    fresh = score_lanes(y[50:], t[50:], [0, y.size - 50], initial_rows(1, cfg), cfg)
    for k in range(3):
        np.testing.assert_array_equal(got[k][50:], fresh[k])
    keep = np.arange(st.shape[1]) != 14  # all but the readings-since-a-hot-one counter
    np.testing.assert_array_equal(got[4][0, keep], fresh[4][0, keep])
    assert got[4][0, _V3_SCALARS] == 0.0
    off = DetectorConfig(count_scale=False)
    raw = score_lanes(x, t, [0, x.size], initial_rows(1, off), off)
    assert raw[4][0, _V3_SCALARS] == 1.0 and not np.array_equal(raw[0], s)  # flag kept, unused


def test_quiet_on_poisson_noise() -> None:
    """Counts without anomalies: sparse (mean 0.3) and busy (mean 50) keys stay quiet."""
    cfg = DetectorConfig()
    for seed in (100, 101, 102):
        for lam in (0.3, 50.0):
            x = np.random.default_rng(seed).poisson(lam, 20_000).astype(float)
            t = T0 + 300.0 * np.arange(x.size)
            f = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg)[2]
            assert f.sum() <= 1, (seed, lam, np.flatnonzero(f))
