"""Gold anomaly detector: pure numpy tests (no Spark, no brokers)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from gold.anomaly import (
    MODELS,
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
FLAT_FROM, FLAT_LEN = 3600, 60  # after the level shift's episode
N = 4500


def synthetic(seed: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Gaussian noise (sd 1) around 20, two spikes, a level shift, a flat-line stretch."""
    rng = np.random.default_rng(seed)
    x = 20.0 + rng.normal(0.0, 1.0, N)
    for i, d in SPIKES.items():
        x[i] += d
    x[SHIFT_AT:] += SHIFT
    x[FLAT_FROM:FLAT_FROM + FLAT_LEN] = x[FLAT_FROM]
    t = T0 + STEP * np.arange(N)
    return x, t, sorted(SPIKES) + [SHIFT_AT, FLAT_FROM]


@pytest.mark.parametrize("seed", range(5))
def test_flags_exactly_the_injected_anomalies(seed: int) -> None:
    """Each spike and the level shift at its first reading, against the level before it; the
    stuck value after a few repeats (a run this key has never had), named ``flat``."""
    x, t, expected = synthetic(seed)
    cfg = DetectorConfig()
    scores, baselines, flags, _, _, model, low, high = score_lanes(x, t, [0, N], initial_rows(1, cfg),
                                                                  cfg, explain=True)
    got = np.flatnonzero(flags).tolist()
    assert got[:3] == expected[:3], (got, expected)
    assert len(got) == 4 and FLAT_FROM < got[3] <= FLAT_FROM + 10, got
    assert [MODELS[m] for m in model[got]][3] == "flat"
    assert np.all((scores >= 0.0) & (scores <= 1.0))
    assert np.all(scores[flags] >= cfg.threshold)
    for i in got[:3]:  # compared with the level before the anomaly, which lies outside the range
        assert abs(baselines[i] - 20.0) < 1.5 and not low[i] <= x[i] <= high[i], i
    assert baselines[got[3]] == x[FLAT_FROM]


def _walk(rng: np.random.Generator, n: int, lo: float = 0.0, hi: float = 100.0) -> np.ndarray:
    """The simulator's healthy metric: a random walk (steps of 0.5% of the range) kept inside it."""
    v = lo + rng.uniform(0.3, 0.7) * (hi - lo)
    out = np.empty(n)
    for i, step in enumerate(rng.normal(0.0, 0.005 * (hi - lo), n)):
        v = min(hi, max(lo, v + step))
        out[i] = round(v, 3)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_quiet_on_healthy_series_at_any_rate(seed: int) -> None:
    """Gaussian, t(3) or Poisson noise, a random walk or a quantised slow signal, read every 5
    minutes (69 days) or four times a second (6 hours): within the alarm budget (at most 6 flags
    in 69 days, none in 6 hours)."""
    cfg = DetectorConfig()
    for step, n in ((300.0, 20_000), (0.25, 86_400)):
        rng = np.random.default_rng(100 + seed)
        i = np.arange(n)
        series = {"gaussian": 20.0 + rng.normal(0.0, 1.0, n), "t3": 20.0 + rng.standard_t(3, n),
                  "poisson": rng.poisson(5.0, n).astype(float), "walk": _walk(rng, n),
                  "quantised": np.round(20 + 3 * np.sin(2 * np.pi * i / n) + rng.normal(0, .05, n), 1)}
        for name, x in series.items():
            f = score_lanes(x, T0 + step * i, [0, n], initial_rows(1, cfg), cfg)[2]
            assert f.sum() <= cfg.false_alarms_per_day * n * step / 86400, (step, name, np.flatnonzero(f))


def test_the_alarm_budget_is_per_day_not_per_reading() -> None:
    """The same readings, read faster, get a wider boundary: a false alarm per key-day at most
    ``false_alarms_per_day`` whether a key sends every five minutes or four times a second."""
    cfg = DetectorConfig()
    x = 20.0 + np.random.default_rng(3).normal(0.0, 1.0, 20_000)
    widths = []
    for step in (300.0, 60.0, 1.0, 0.25):
        _, _, _, _, _, _, low, high = score_lanes(x, T0 + step * np.arange(x.size), [0, x.size],
                                                   initial_rows(1, cfg), cfg, explain=True)
        widths.append(float(np.nanmedian(high[-1000:] - low[-1000:])))
    assert widths == sorted(widths) and widths[-1] > 1.4 * widths[0], widths
    loud = DetectorConfig(false_alarms_per_day=100.0)
    quiet = score_lanes(x, T0 + 300.0 * np.arange(x.size), [0, x.size], initial_rows(1, cfg), cfg)[2]
    more = score_lanes(x, T0 + 300.0 * np.arange(x.size), [0, x.size], initial_rows(1, loud), loud)[2]
    assert more.sum() > quiet.sum()


@pytest.mark.parametrize("seed", range(3))
def test_a_random_walks_faults_are_flagged(seed: int) -> None:
    """The simulator's healthy walk, read four times a second: its spike, level shift and stuck
    value are flagged within their span; nothing else is."""
    cfg = DetectorConfig()
    rng = np.random.default_rng(200 + seed)
    x = _walk(rng, 5000, 0.0, 1000.0)  # a wide range: the walk stays clear of its bounds
    t = T0 + 0.25 * np.arange(x.size)
    faults = {"spike": (2000, 2002), "level_shift": (3000, 3119), "stuck": (4000, 4119)}
    x[2000:2003] += 250.0
    x[3000:3120] += 100.0
    x[4000:4120] = x[4000]
    _, _, f, _, _, model, _, _ = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg, explain=True)
    got = np.flatnonzero(f)
    for kind, (a, b) in faults.items():
        assert ((got >= a) & (got <= b + 1)).any(), (kind, got)
    assert all(any(a <= g <= b + 1 for a, b in faults.values()) for g in got), got
    assert MODELS[model[got[-1]]] == "flat"


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
    cfg = DetectorConfig()
    _, _, flags, _, _, model, _, _ = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg, explain=True)
    got = np.flatnonzero(flags)
    assert got.tolist() == [peak.start] and MODELS[model[peak.start]] == "daily"


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
    assert len(row) == len(STATE_FIELDS) == 13 + 2 * 6 + 4 * 7 + 13 + 2 * 48
    assert all(isinstance(v, float) for v in row)
    assert all(typ == "double" for _, typ in STATE_FIELDS)
    assert len({name for name, _ in STATE_FIELDS}) == len(STATE_FIELDS)
    assert state_schema_ddl().startswith("version DOUBLE, n DOUBLE")
    assert {"forecast_1024", "tail_u_daily", "runs_ge_4096", "daily_47"} <= {n for n, _ in STATE_FIELDS}
    x, t, _ = synthetic(0)
    _, _, _, st = score_batch(x[:500], t[:500], None)
    again = DetectorState.from_row(st.to_row())
    assert again.to_row() == st.to_row()
    assert len(state_fields(DetectorConfig(memory=8192))) == len(STATE_FIELDS)
    with pytest.raises(ValueError, match="neither"):
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
    with pytest.raises(ValueError, match="memory must be >= 4096"):
        DetectorConfig(memory=100)
    with pytest.raises(ValueError, match="tail_quantile"):
        DetectorConfig(tail_quantile=1.0)
    assert DetectorConfig().warmup == 500  # ten expected excesses over the 98% quantile


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


def test_explain_names_the_model_and_its_expected_range() -> None:
    """score_lanes(explain=True): the model behind each score, and the range it expected."""
    x, t, _ = synthetic(0)
    cfg = DetectorConfig()
    s, bl, f, _, _, model, low, high = score_lanes(x, t, [0, N], initial_rows(1, cfg), cfg,
                                                   explain=True)
    np.testing.assert_array_equal(s, score_batch(x, t, None, cfg)[0])
    assert model[0] == 0 and np.all(model[1:] > 0) and model.max() < len(MODELS)
    for i in np.flatnonzero(f):
        if MODELS[model[i]] != "flat":  # the reading lies outside the range its model expected
            assert not low[i] <= x[i] <= high[i], (i, MODELS[model[i]], low[i], x[i], high[i])
            assert low[i] <= bl[i] <= high[i], i
        else:
            assert np.isnan(low[i]) and np.isnan(high[i]) and bl[i] == x[i]
    assert x[900] > high[900] and x[1500] < low[1500]


@pytest.mark.parametrize("version", [1.0, 2.0, 3.0, 4.0])
def test_a_state_of_the_previous_method_starts_as_a_new_key(version: float) -> None:
    """Rows of versions 1-4 (another method: nothing of theirs is a forecast or a tail of this
    one) become new keys, directly and through the state store's encoding; current rows pass
    through; anything else is refused."""
    import gold.state_store as health
    from gold.anomaly import upgrade_rows

    cfg = DetectorConfig()
    old = np.r_[version, np.arange(1.0, 222.0)]  # version 4's 222 values; the width is not checked
    up = upgrade_rows(old[None, :], cfg)
    np.testing.assert_array_equal(up, initial_rows(1, cfg))
    np.testing.assert_array_equal(DetectorState.from_row(old.tolist()).to_row(), initial_state().to_row())
    x, t, _ = synthetic(1)
    row = np.asarray(score_batch(x[:800], t[:800], None, cfg)[3].to_row())
    np.testing.assert_array_equal(upgrade_rows(row[None, :], cfg)[0], row)
    with pytest.raises(ValueError, match="neither"):
        upgrade_rows(np.r_[9.0, row[1:]][None, :], cfg)
    metrics = ("a", "b", "c")
    b = health.Bucket.empty(old.size, len(metrics))
    b.index(np.array(["dev-1", "dev-2"], dtype=object))
    b.dets[0, 0] = old  # dev-1 has an old state for the first metric only
    b.det_set[0, 0] = True
    got = health.load_devices(health.dump_devices(b, metrics), len(STATE_FIELDS), metrics, cfg=cfg)
    assert got.dets.shape == (len(metrics), 2, len(STATE_FIELDS))
    assert got.det_set.tolist() == b.det_set.tolist()
    np.testing.assert_array_equal(got.dets[0, 0], initial_rows(1, cfg)[0])
    same = health.load_devices(health.dump_devices(got, metrics), len(STATE_FIELDS), metrics, cfg=cfg)
    np.testing.assert_array_equal(same.dets, got.dets)  # current states pass through


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
    counts = [n for n, _ in STATE_FIELDS].index("counts")
    since = [n for n, _ in STATE_FIELDS].index("since")
    x, t = _counts(seed)
    cfg = DetectorConfig()
    s, bl, f, _, st, _, low, high = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg,
                                                explain=True)
    assert st[0, counts] == 1.0
    assert np.flatnonzero(f).tolist() == [5000]
    assert x[5000] > high[5000] and low[5000] <= bl[5000] <= high[5000]
    assert 5.0 < bl[5000] < 40.0  # the expected count, not its square root
    y = x.copy()
    y[50] += 0.5  # not a count, within the warm-up
    got = score_lanes(y, t, [0, y.size], initial_rows(1, cfg), cfg)
    fresh = score_lanes(y[50:], t[50:], [0, y.size - 50], initial_rows(1, cfg), cfg)
    for k in range(3):
        np.testing.assert_array_equal(got[k][50:], fresh[k])
    keep = np.arange(st.shape[1]) != since  # all but the readings-since-a-hot-one counter
    np.testing.assert_array_equal(got[4][0, keep], fresh[4][0, keep])
    assert got[4][0, counts] == 0.0
    off = DetectorConfig(count_scale=False)
    raw = score_lanes(x, t, [0, x.size], initial_rows(1, off), off)
    assert raw[4][0, counts] == 1.0 and not np.array_equal(raw[0], s)  # flag kept, unused


def test_quiet_on_poisson_noise() -> None:
    """Counts without anomalies: sparse (mean 0.3) and busy (mean 50) keys stay within the alarm
    budget (69 days: at most 6 flags)."""
    cfg = DetectorConfig()
    for seed in (100, 101, 102):
        for lam in (0.3, 50.0):
            x = np.random.default_rng(seed).poisson(lam, 20_000).astype(float)
            t = T0 + 300.0 * np.arange(x.size)
            f = score_lanes(x, t, [0, x.size], initial_rows(1, cfg), cfg)[2]
            assert f.sum() <= cfg.false_alarms_per_day * x.size * 300.0 / 86400, (seed, lam, np.flatnonzero(f))
