"""Streaming, unsupervised anomaly scoring of one device's metric (gold layer).

One detector instance per ``(device_id, metric)`` key; its whole memory is a :class:`DetectorState`
that flattens to a tuple of floats (a Spark state struct), so ``score_batch`` can run inside
``applyInPandasWithState`` / ``transformWithStateInPandas`` on micro-batches of any size. The
state is updated reading by reading in event-time order, so scoring a series in one call or in
any split into chunks gives bit-identical results.

Method: an ensemble (max) of normalised surprises, each >= 1 meaning "anomalous". Local views
(robust, per time of day) know this key's recent shape; wide views know how far it may roam;
the likelihood view knows how surprised it usually is. One view alone misses what another sees.

- **fast** (spikes, dips, sudden level shifts): the reading against a robust EWMA level ``L``
  (Huber-clipped updates), divided by the larger of ``k_fast`` x a robust scale and
  ``tail_factor`` x a tracked 98% residual quantile. Scales are asymmetric (up/down separately)
  and there is a per-time-of-day scale as well: a series whose normal life contains big upward
  spikes (CPU bursts, load-balancer peaks) or a daily on/off switch learns that those are
  normal, and still notices an unusual *drop*. After ``shift_readings`` consecutive same-sign
  exceedances the level (and the slow baseline) re-baselines to the new value: a level shift is
  reported once, then it is the new normal. Gated (``fast_gate``): the deviation must also
  exceed the wide view's tracked 99.5% quantile of this key's deviations (below), so a spike no
  larger than the key's usual bursts is not flagged, however calm the last hours were.
- **slow** (drifts, contextual / seasonal anomalies): a smoother robust level ``M`` against a slow
  baseline plus a time-of-day profile (``season_bins`` bins over ``season_period`` seconds,
  linearly interpolated), in units of its own robust scale (global and per bin): a gradual
  slide the fast model follows, a value ordinary in itself but wrong for the time of day.
- **flat-line**: a run of identical readings longer than ``flat_min_run`` and twice the longest
  run seen recently (learnt, so series that idle at exactly 0 are not flagged), in a series
  that normally moves.
- **wide**: the reading against an EWMA mean and variance with a long memory (``wide_alpha``,
  ~3000 readings), beyond ``wide_k`` standard deviations *and* ``wide_tail_k`` x a tracked
  99.5% quantile of its own deviations, so a bursty series (tweet volumes) must beat its own
  bursts. The robust local views adapt to a slow change; this one does not.
- **short / long** (multi-scale): the reading averaged over ~5 (``short_alpha``) and ~50
  (``long_alpha``) readings against the same wide mean, in wide standard deviations: a
  sustained shift too small for any single reading to stand out. The short view is gated
  like the wide one (``short_tail_k``): beyond a tracked 99.5% quantile of its own deviations,
  so a key whose bursts last a few readings must beat its own bursts there too.
- **likelihood** (as in HTM's anomaly likelihood): the views' surprise (the wide one ungated,
  capped at ``lik_cap``) averaged over ~5 readings, against its own long EWMA mean and
  variance: ``lik_k`` standard deviations above its usual level flags. A series that is never
  surprised gets sensitive; one that always is, does not.

**Count scale** (``count_scale``): a key whose readings are all non-negative integers through
its warm-up (event counts: tweets, requests, errors) is scored on Anscombe's scale
``2 sqrt(x + 3/8)``, where Poisson noise has a standard deviation of about 1 at any level, so a
burst at a busy hour and one at a quiet hour are weighed alike. Every view works on that scale;
the expected value and range are reported back in the reading's units. A key that sends
anything else (a fraction, a negative) during its warm-up forgets what it learnt and starts on
the raw scale from that reading (nothing is flagged during the warm-up, so nothing is lost).

The local views flag at ``local_margin`` / ``slow_margin`` / ``flat_margin`` x their own
boundaries (the wide views do most of the flagging). Scales of a local model stop learning
while it says "anomalous" (so a long anomaly does not teach itself to be normal), except the
per-bin ones (so what recurs daily becomes normal). A slow deviation that lasts
``accept_after`` readings (net) becomes the new normal.
``score = z^2 / (1 + z^2)`` with ``z`` the largest surprise: 0.5 at the detection boundary.
A flag needs ``score >= threshold`` and ``cooldown`` readings below the threshold before it:
one flag per anomalous episode, which keeps detections sparse (NAB charges every false one).
The price: while an episode lasts a second, different anomaly on the same key is not flagged,
though its score is still reported; a lasting level shift of many standard deviations stays
one episode until the wide mean has moved to it (~550 readings for 10 sigma).
``score_lanes(..., explain=True)`` also says which view explains each score (:data:`MODELS`)
and the range that view expected.

Why this method, how the defaults were chosen (a leave-one-category-out check on NAB), the
figures and the known misses: docs/anomaly.md.

State: 30 scalars + 4 x ``season_bins`` floats (222 doubles, 1,776 bytes per key with the
defaults). Version-1 rows (before the wide and likelihood views), version-2 rows (before the
short view's tail quantiles) and version-3 rows (before the count scale; they stay on the raw
scale) upgrade in place (:func:`upgrade_rows`), without a new warm-up.

The recursion is one numba kernel over that flat row (``cache=True``: compiled once per machine,
then ~0.25 s to load per process); :func:`score_lanes` runs it over many keys in one call, as
the health stream does per bucket, since a Python loop over keys cost more than the scoring
(:func:`score_lanes_at`: on the states where the caller holds them, updated in place).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numba
import numpy as np

STATE_VERSION = 4.0


#: ``model`` codes of ``score_lanes(..., explain=True)``: the view that explains a score.
MODELS: tuple[str, ...] = ("none", "fast", "slow", "flat", "wide", "short", "long", "likelihood")


@dataclass(frozen=True)
class DetectorConfig:
    """One configuration for every device and metric (no per-series tuning)."""

    threshold: float = 0.5  # flag when score >= threshold; 0.5 = each model's own boundary
    cooldown: int = 96  # readings below threshold needed before the next flag (one per episode)
    warmup: int = 100  # readings learnt before any flag
    k_fast: float = 8.0  # fast boundary, in robust (mean absolute deviation) units
    k_slow: float = 4.0  # slow/seasonal boundary, in its own robust units
    tail_factor: float = 2.0  # fast boundary >= tail_factor x the 98% residual quantile
    tail_quantile: float = 0.98
    tail_rate: float = 0.002  # quantile tracker: relative decay per reading
    slow_floor: float = 0.25  # slow boundary >= slow_floor x fast boundary
    level_alpha: float = 0.3  # fast level EWMA weight
    mid_alpha: float = 0.05  # the slow model watches this smoother robust level (~20 readings)
    scale_alpha: float = 0.01  # fast scale EWMA weight
    baseline_alpha: float = 0.002  # slow baseline EWMA weight (~500 readings)
    slow_scale_alpha: float = 0.005
    season_bins: int = 48
    season_period: float = 86400.0  # seconds
    season_alpha: float = 0.05  # per-bin learning rate (per visit)
    season_scale_alpha: float = 0.05
    season_early_visits: float = 2.0  # first visits of a bin learn unclipped
    huber_c: float = 3.0  # residuals clipped at huber_c x scale when learning
    shift_readings: int = 6  # consecutive same-sign fast exceedances = level shift
    accept_after: int = 288  # net same-sign slow exceedances = new normal (re-baseline)
    flat_min_run: int = 12  # identical readings before a flat-line can be flagged
    flat_factor: float = 2.0  # ... and more than flat_factor x the longest recent run
    flat_decay: float = 0.999  # per-reading decay of the remembered longest run
    scale_floor: float = 1e-6  # relative floor of every scale: 1e-6 x (1 + |x|)
    local_margin: float = 2.0  # the fast model flags at local_margin x its own boundary, ...
    slow_margin: float = 1.5  # ... the slow one at slow_margin x its own, ...
    flat_margin: float = 2.5  # ... the flat-line one at flat_margin x its own
    wide_alpha: float = 1.0 / 3000  # wide view: EWMA mean/variance of the raw value
    wide_k: float = 6.0  # raw reading vs the wide mean, in wide standard deviations, and ...
    wide_tail_k: float = 2.0  # ... in units of a tracked tail quantile of |reading - wide mean|
    wide_tail_quantile: float = 0.995
    wide_tail_rate: float = 0.0005  # quantile tracker: relative decay per reading
    short_alpha: float = 0.2  # short-smoothed value (~5 readings) vs the wide mean ...
    short_k: float = 3.5  # ... in wide standard deviations
    long_alpha: float = 0.02  # long-smoothed value (~50 readings) vs the wide mean ...
    long_k: float = 2.0  # ... in wide standard deviations
    wide_season: float = 1.0  # weight of the time-of-day profile taken off before the wide views
    lik_cap: float = 2.0  # likelihood view: the views' surprise, capped at lik_cap, ...
    lik_short_alpha: float = 0.2  # ... averaged over ~5 readings, ...
    lik_alpha: float = 1.0 / 3000  # ... against its own EWMA mean and variance ...
    lik_k: float = 6.0  # ... flags lik_k standard deviations above its mean
    fast_gate: float = 1.0  # the fast view also needs fast_gate x the wide view's tail quantile
    short_tail_k: float = 1.0  # the short view also needs short_tail_k x its own tail quantile
    count_scale: bool = True  # a key whose warm-up readings are all non-negative integers
    # (counts) is scored on the Anscombe scale 2 sqrt(x + 3/8), where Poisson noise has sd ~1

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 < self.threshold < 1.0:
            problems.append("threshold must be in (0, 1)")
        for name in ("cooldown", "warmup", "shift_readings", "accept_after", "flat_min_run"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if self.season_bins < 1:
            problems.append("season_bins must be >= 1")
        if self.season_period <= 0:
            problems.append("season_period must be > 0 seconds")
        for name in ("tail_quantile", "wide_tail_quantile"):
            if not 0.0 < getattr(self, name) < 1.0:
                problems.append(f"{name} must be in (0, 1)")
        for name in ("level_alpha", "mid_alpha", "scale_alpha", "baseline_alpha", "slow_scale_alpha",
                     "season_alpha", "season_scale_alpha", "tail_rate", "wide_alpha", "short_alpha",
                     "long_alpha", "lik_short_alpha", "lik_alpha", "wide_tail_rate"):
            if not 0.0 < getattr(self, name) <= 1.0:
                problems.append(f"{name} must be in (0, 1]")
        for name in ("k_fast", "k_slow", "huber_c", "flat_factor", "local_margin", "slow_margin",
                     "flat_margin", "wide_k",
                     "short_k", "long_k", "lik_cap", "lik_k", "wide_tail_k"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0")
        for name in ("fast_gate", "short_tail_k"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (0 = off)")
        if problems:
            raise ValueError("invalid DetectorConfig: " + "; ".join(problems))


_SCALARS: tuple[str, ...] = (
    "version",  # state layout version
    "n",  # readings learnt
    "x_last",  # previous reading (flat-line runs)
    "level",  # fast robust level L
    "mid_level",  # smoother robust level M (input of the slow model)
    "fast_up", "fast_dn",  # fast robust scales (mean absolute deviation, up / down)
    "tail_up", "tail_dn",  # fast residual tail quantiles (up / down)
    "baseline",  # slow baseline B (without the time-of-day profile)
    "slow_up", "slow_dn",  # slow robust scales
    "run",  # current run of identical readings
    "run_max",  # longest recent run (decayed)
    "since",  # readings below threshold since the last one at/above it
    "streak",  # signed count of consecutive fast exceedances (+ up, - down)
    "slow_streak",  # signed count of slow exceedances (eroded by readings back inside)
    "last_time",  # event time of the last reading (epoch s), informational
    "wide_mean", "wide_var",  # wide view: EWMA mean and variance of the raw value
    "short_mean", "long_mean",  # short- and long-smoothed value
    "lik_short", "lik_mean", "lik_var",  # likelihood view: short mean of the surprise, its stats
    "wide_tail_up", "wide_tail_dn",  # wide view: tail quantiles of reading - wide mean
    "short_tail_up", "short_tail_dn",  # short view: tail quantiles of short mean - wide mean
    "counts",  # 1: scored on the count scale (every warm-up reading a non-negative integer)
)
_ARRAYS: tuple[str, ...] = ("season", "season_visits", "bin_scale_fast", "bin_scale_slow")


def state_fields(config: DetectorConfig | None = None) -> list[tuple[str, str]]:
    """(name, type) of each element of ``DetectorState.to_row()``: all ``double``."""
    k = (config or DetectorConfig()).season_bins
    names = list(_SCALARS) + [f"{a}_{i}" for a in _ARRAYS for i in range(k)]
    return [(name, "double") for name in names]


#: State fields for the default configuration (a Spark state struct of doubles).
STATE_FIELDS: list[tuple[str, str]] = state_fields()


def state_schema_ddl(config: DetectorConfig | None = None) -> str:
    """The state as a Spark DDL struct body, e.g. for ``applyInPandasWithState``."""
    return ", ".join(f"{n} {t.upper()}" for n, t in state_fields(config))


@dataclass
class DetectorState:
    """Everything the detector remembers about one (device, metric)."""

    n: float = 0.0
    x_last: float = 0.0
    level: float = 0.0
    mid_level: float = 0.0
    fast_up: float = 0.0
    fast_dn: float = 0.0
    tail_up: float = 0.0
    tail_dn: float = 0.0
    baseline: float = 0.0
    slow_up: float = 0.0
    slow_dn: float = 0.0
    run: float = 0.0
    run_max: float = 0.0
    since: float = 1e18
    streak: float = 0.0
    slow_streak: float = 0.0
    last_time: float = float("nan")
    wide_mean: float = 0.0
    wide_var: float = 0.0
    short_mean: float = 0.0
    long_mean: float = 0.0
    lik_short: float = 0.0
    lik_mean: float = 0.0
    lik_var: float = 0.0
    wide_tail_up: float = 0.0
    wide_tail_dn: float = 0.0
    short_tail_up: float = 0.0
    short_tail_dn: float = 0.0
    counts: float = 1.0
    season: list[float] = field(default_factory=list)
    season_visits: list[float] = field(default_factory=list)
    bin_scale_fast: list[float] = field(default_factory=list)
    bin_scale_slow: list[float] = field(default_factory=list)

    def to_row(self) -> tuple[float, ...]:
        """Flat tuple of floats in ``state_fields()`` order."""
        head = (STATE_VERSION,) + tuple(float(getattr(self, n)) for n in _SCALARS[1:])
        return head + tuple(float(v) for a in _ARRAYS for v in getattr(self, a))

    @classmethod
    def from_row(cls, row: Sequence[float]) -> DetectorState:
        """Inverse of :meth:`to_row` (the number of bins follows from the row's length)."""
        row = [float(v) for v in row]
        for version, scalars in ((1.0, _V1_SCALARS), (2.0, _V2_SCALARS), (3.0, _V3_SCALARS)):
            if row and row[0] == version and (len(row) - scalars) % len(_ARRAYS) == 0:
                k1 = (len(row) - scalars) // len(_ARRAYS)
                row = upgrade_rows([row], DetectorConfig(season_bins=k1))[0].tolist()
                break
        ns = len(_SCALARS)
        if len(row) < ns or (len(row) - ns) % len(_ARRAYS):
            raise ValueError(f"state row of {len(row)} values does not match the layout")
        if row[0] != STATE_VERSION:
            raise ValueError(f"state version {row[0]} is not {STATE_VERSION}")
        k = (len(row) - ns) // len(_ARRAYS)
        st = cls(**{name: row[i] for i, name in enumerate(_SCALARS) if name != "version"})
        for j, a in enumerate(_ARRAYS):
            setattr(st, a, row[ns + j * k: ns + (j + 1) * k])
        return st

    def copy(self) -> DetectorState:
        return DetectorState.from_row(self.to_row())


def initial_state(config: DetectorConfig | None = None) -> DetectorState:
    """State of a key never seen before."""
    k = (config or DetectorConfig()).season_bins
    return DetectorState(season=[0.0] * k, season_visits=[0.0] * k,
                         bin_scale_fast=[0.0] * k, bin_scale_slow=[0.0] * k)


#: Scalars of state versions 1, 2 and 3 (the rest of ``_SCALARS`` were added by later versions).
_V1_SCALARS = 18
_V2_SCALARS = 27
_V3_SCALARS = 29


def upgrade_rows(rows: np.ndarray, config: DetectorConfig | None = None) -> np.ndarray:
    """State rows of an older layout (version 1, 2 or 3) as rows of this one, without re-warm-up.

    The views added since start conservatively: the wide view from the level, fast scale and
    time-of-day profile, the likelihood view with a wide variance (it calms down as it learns)
    (version 1); the short view's tail quantiles from the wide view's, which are wider than
    the short mean's own, so the short view is quieter until they have decayed (version 2; a
    version-1 row has no wide tails yet, so both are learnt from the next readings, as for a
    new key); a version-3 row was learnt on the raw scale and stays there (``counts`` 0), so
    its key goes on exactly as before.
    Rows already at this version pass through.
    """
    rows = np.array(rows, dtype=np.float64, ndmin=2)
    k = (config or DetectorConfig()).season_bins
    if rows.shape[1] == len(_SCALARS) + len(_ARRAYS) * k and np.all(rows[:, 0] == STATE_VERSION):
        return rows
    cfg = config or DetectorConfig()
    if rows.shape[1] == _V1_SCALARS + len(_ARRAYS) * k and np.all(rows[:, 0] == 1.0):
        season = rows[:, _V1_SCALARS:_V1_SCALARS + k]
        f_up, f_dn, base = rows[:, 5], rows[:, 6], rows[:, 9]
        kept = 1.0 - cfg.wide_season  # the share of the daily profile the wide views see
        wide_mean = base + kept * season.mean(axis=1)
        wide_var = (0.625 * (f_up + f_dn)) ** 2 + kept ** 2 * season.var(axis=1)
        z = np.zeros(len(rows))
        added = np.column_stack([wide_mean, wide_var, wide_mean, wide_mean, z, z, z + 1.0, z, z])
        rows = np.hstack([rows[:, :_V1_SCALARS], added, rows[:, _V1_SCALARS:]])
        rows[:, 0] = 2.0
    if rows.shape[1] == _V2_SCALARS + len(_ARRAYS) * k and np.all(rows[:, 0] == 2.0):
        wt_up, wt_dn = rows[:, 25], rows[:, 26]  # version 1 rows: 0, learnt from the next reading
        rows = np.hstack([rows[:, :_V2_SCALARS], np.column_stack([wt_up, wt_dn]),
                          rows[:, _V2_SCALARS:]])
        rows[:, 0] = 3.0
    if rows.shape[1] != _V3_SCALARS + len(_ARRAYS) * k or np.any(rows[:, 0] != 3.0):
        raise ValueError(f"state rows of {rows.shape[1]} values are neither version 1, 2, 3 nor "
                         f"{STATE_VERSION} with {k} season bins")
    out = np.hstack([rows[:, :_V3_SCALARS], np.zeros((len(rows), 1)), rows[:, _V3_SCALARS:]])
    out[:, 0] = STATE_VERSION
    return out


def initial_rows(lanes: int, config: DetectorConfig | None = None) -> np.ndarray:
    """``lanes`` copies of ``initial_state(config).to_row()`` as a ``[lanes, state_len]`` matrix."""
    return np.tile(np.asarray(initial_state(config).to_row()), (lanes, 1))


@lru_cache(maxsize=32)
def _params(cfg: DetectorConfig) -> tuple[float, ...]:
    """The configuration as the kernel's flat tuple of floats (derived constants included)."""
    q_dn = 1.0 - cfg.tail_rate
    q_up = 1.0 + cfg.tail_rate * (1.0 + cfg.tail_quantile) / (1.0 - cfg.tail_quantile)
    wq = cfg.wide_tail_quantile
    wq_dn = 1.0 - cfg.wide_tail_rate
    wq_up = 1.0 + cfg.wide_tail_rate * (1.0 + wq) / (1.0 - wq)
    return tuple(float(v) for v in (
        cfg.threshold, cfg.cooldown, cfg.warmup, cfg.k_fast, cfg.k_slow, cfg.tail_factor,
        cfg.slow_floor, cfg.level_alpha, cfg.mid_alpha, cfg.scale_alpha, cfg.baseline_alpha,
        cfg.slow_scale_alpha, cfg.season_period, cfg.season_alpha, cfg.season_scale_alpha,
        cfg.season_early_visits, cfg.huber_c, q_dn, q_up, cfg.shift_readings, cfg.accept_after,
        cfg.flat_min_run, cfg.flat_factor, cfg.flat_decay, cfg.scale_floor, 1.0 / cfg.local_margin,
        1.0 / cfg.slow_margin, 1.0 / cfg.flat_margin,
        cfg.wide_alpha, cfg.wide_k, cfg.short_alpha, cfg.short_k, cfg.long_alpha, cfg.long_k, cfg.wide_season, cfg.lik_cap, cfg.lik_short_alpha, cfg.lik_alpha,
        cfg.lik_k, cfg.wide_tail_k, wq_dn, wq_up, cfg.fast_gate, cfg.short_tail_k,
        1.0 if cfg.count_scale else 0.0))


def score_lanes(values: np.ndarray, times: np.ndarray, offsets: np.ndarray, states: np.ndarray,
                config: DetectorConfig | None = None, explain: bool = False) -> tuple[np.ndarray, ...]:
    """Score many independent (device, metric) lanes in one compiled call.

    ``values``/``times`` hold every lane's readings back to back, each lane in event-time order;
    lane ``j`` is ``[offsets[j], offsets[j + 1])`` (``len(offsets) == lanes + 1``) and starts
    from ``states[j]`` (a ``DetectorState.to_row()``; see :func:`initial_rows`). Per lane this
    is exactly :func:`score_batch`: one call per micro-batch instead of one per key is what
    makes per-key scoring cheap. Returns ``(scores, baselines, flags, n_before, new_states)``:
    ``n_before`` is the count of readings the lane had learnt before each reading; ``states``
    is not modified. With ``explain``, also ``(model, low, high)`` per reading: which view was
    the most surprised (:data:`MODELS`) and the range it expected (NaN for the flat-line view).
    """
    st = np.array(states, dtype=np.float64, order="C", ndmin=2)  # a copy: updated in place
    out = score_lanes_at(values, times, offsets, st, np.arange(st.shape[0]), config)
    scores, baselines, flags, n_before, model, low, high = out
    if explain:
        return scores, baselines, flags, n_before, st, model, low, high
    return scores, baselines, flags, n_before, st


def score_lanes_at(values: np.ndarray, times: np.ndarray, offsets: np.ndarray, states: np.ndarray,
                   rows: np.ndarray, config: DetectorConfig | None = None) -> tuple[np.ndarray, ...]:
    """:func:`score_lanes` on states held in a larger matrix, updated in place: lane ``j``
    starts from ``states[rows[j]]`` and leaves its new state there (a lane without a valid
    reading leaves its row as it was). A caller keeping every key's state in one C-contiguous
    float64 matrix scores a batch without copying the states out and back. Returns
    ``(scores, baselines, flags, n_before, model, low, high)``."""
    cfg = config or DetectorConfig()
    x = np.ascontiguousarray(values, dtype=np.float64).ravel()
    t = np.ascontiguousarray(times, dtype=np.float64).ravel()
    offs = np.ascontiguousarray(offsets, dtype=np.int64).ravel()
    at = np.ascontiguousarray(rows, dtype=np.int64).ravel()
    if states.dtype != np.float64 or states.ndim != 2 or not states.flags.c_contiguous:
        raise ValueError("states must be a C-contiguous float64 matrix (updated in place)")
    if x.shape != t.shape:
        raise ValueError(f"{x.size} values but {t.size} times")
    if (offs.size != at.size + 1 or offs[0] != 0 or offs[-1] != x.size
            or np.any(np.diff(offs) < 0)):
        raise ValueError("offsets must rise from 0 to len(values), one more than the lanes")
    if at.size and (at.min() < 0 or at.max() >= states.shape[0] or np.unique(at).size != at.size):
        raise ValueError("rows must be distinct rows of states, one per lane")
    k = (states.shape[1] - len(_SCALARS)) // len(_ARRAYS)
    if states.shape[1] != len(_SCALARS) + len(_ARRAYS) * k or k != cfg.season_bins:
        raise ValueError(f"state rows of {states.shape[1]} values do not match the layout "
                         f"({cfg.season_bins} season bins)")
    if np.any(states[at, 0] != STATE_VERSION):
        raise ValueError(f"state version is not {STATE_VERSION}")
    return _kernel(x, t, offs, states, at, k, _params(cfg))


def score_batch(values: np.ndarray, times: np.ndarray, state: DetectorState | None,
                config: DetectorConfig | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, DetectorState]:
    """Score readings (event-time order) of one (device, metric) and advance its state.

    Returns ``(scores in [0, 1], baselines, flags, new_state)``; ``baselines`` is the value the
    reading was compared against (fast level, or slow baseline + time-of-day profile, whichever
    found it more surprising). NaN readings get score 0, no flag, a NaN baseline and leave the
    state untouched. The input state is not modified. One lane of :func:`score_lanes`.
    """
    cfg = config or DetectorConfig()
    st = initial_state(cfg) if state is None else state
    if len(st.season) != cfg.season_bins:
        raise ValueError(f"state has {len(st.season)} season bins, config {cfg.season_bins}")
    x = np.asarray(values, dtype=np.float64).ravel()
    scores, baselines, flags, _, rows = score_lanes(x, times, [0, x.size], [st.to_row()], cfg)
    return scores, baselines, flags, DetectorState.from_row(rows[0].tolist())


def _njit_cached(fn):
    """``njit(cache=True)`` when the on-disk cache is writable, else a per-process compile.

    Numba caches next to the source, in ``NUMBA_CACHE_DIR`` or in the user cache dir (also for
    the package zip shipped to a cluster's executors); without a writable one it would fail on
    the first call (zip) or at import (no locator), and scoring must work regardless.
    """
    try:
        disp = numba.njit(cache=True)(fn)
        path = disp.stats.cache_path
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return disp
    except (RuntimeError, OSError):
        return numba.njit(fn)


_C0 = 2.0 * math.sqrt(0.375)  # the count scale of a zero reading
_C1 = math.sqrt(0.375)  # its slope there is 1 / _C1


@_njit_cached
def _to_count_scale(x):
    """Anscombe's 2 sqrt(x + 3/8) (Poisson counts: sd ~1 at any level); below 0 (not a count,
    after the warm-up) its tangent at 0, so the map stays monotone and invertible."""
    return 2.0 * np.sqrt(x + 0.375) if x >= 0.0 else _C0 + x / _C1


@_njit_cached
def _from_count_scale(y):
    """Inverse of :func:`_to_count_scale`."""
    return 0.25 * y * y - 0.375 if y >= _C0 else (y - _C0) * _C1


@_njit_cached
def _tail(q, d, grow, decay):
    """A tracked tail quantile of one side's deviations: ``d`` beyond it raises it (by at most
    ``grow`` x), anything else lets it decay."""
    if d > q:
        return (d if d < q * grow else q * grow) if q > 0.0 else d
    return q * decay


@_njit_cached
def _kernel(xs, ts, offs, states, at, k, p):
    """The per-reading recursion and episode flags of every lane (``states[at[lane]]`` updated
    in place)."""
    (thr, cooldown, warm, kf, ks, fq, kappa, a_l, a_m, a_f, a_b, a_s, period, g_s, g_sb, early_v,
     c, q_dn, q_up, shift_m, accept, flat_min, flat_f, flat_dec, floor_rel, inv_margin,
     inv_ms, inv_mf,
     a_w, k_w, a_sh, k_sh, a_lo, k_lo, w_se, l_cap, a_ls, a_ll, k_l, k_t, wq_dn, wq_up,
     k_fg, k_st, k_ct) = p
    total = xs.size
    scores = np.zeros(total)
    base_out = np.full(total, np.nan)
    lo_out = np.full(total, np.nan)
    hi_out = np.full(total, np.nan)
    model_out = np.zeros(total, dtype=np.int8)
    flags = np.zeros(total, dtype=np.bool_)
    n_out = np.zeros(total)
    o_s = 30  # season, season_visits, bin_scale_fast, bin_scale_slow follow the 30 scalars
    o_c, o_f, o_b = o_s + k, o_s + 2 * k, o_s + 3 * k
    for lane in range(offs.size - 1):
        row = states[at[lane]]
        n = row[1]
        xl, lev, mid = row[2], row[3], row[4]
        f_up, f_dn, t_up, t_dn = row[5], row[6], row[7], row[8]
        bas, s_up, s_dn = row[9], row[10], row[11]
        run, run_max = row[12], row[13]
        since0 = row[14]
        streak, sstreak = row[15], row[16]
        m = 0  # valid readings so far in this lane (the episode counter's index)
        last_hot = -1
        t_last = row[17]
        w_m, w_v, sh_m, lo_m = row[18], row[19], row[20], row[21]
        l_s, l_m, l_v = row[22], row[23], row[24]
        wt_up, wt_dn = row[25], row[26]
        st_up, st_dn = row[27], row[28]
        cnt = row[29] if k_ct > 0.0 else 0.0
        for i in range(offs[lane], offs[lane + 1]):
            xv = xs[i]
            tv = ts[i]
            if np.isnan(xv) or np.isnan(tv):
                n_out[i] = n
                continue
            if cnt > 0.0:
                if n < warm and (xv < 0.0 or xv != np.floor(xv)):
                    # not a count: learn this key on the raw scale, from this reading on (still
                    # in its warm-up, so nothing was flagged from what is forgotten)
                    cnt = 0.0
                    n = 0.0
                    f_up = f_dn = t_up = t_dn = s_up = s_dn = 0.0
                    run = run_max = streak = sstreak = 0.0
                    l_s = l_m = l_v = 0.0
                    wt_up = wt_dn = st_up = st_dn = 0.0
                    for j in range(o_s, row.size):
                        row[j] = 0.0
                else:
                    xv = _to_count_scale(xv)
            u = (tv % period) / period * k - 0.5
            fl = np.floor(u)
            w1 = u - fl
            b0 = np.int64(fl) % k
            b1 = (b0 + 1) % k
            w0 = 1.0 - w1
            seas = w0 * row[o_s + b0] + w1 * row[o_s + b1]
            n_out[i] = n
            t_last = tv
            if n == 0.0:
                lev = xv
                mid = xv
                bas = xv - seas
                xl = xv
                w_m = xv
                w_v = 0.0
                sh_m = xv
                lo_m = xv
                n = 1.0
                base_out[i] = xs[i]
                z = 0.0
            else:
                sbf = w0 * row[o_f + b0] + w1 * row[o_f + b1]
                sbs = w0 * row[o_b + b0] + w1 * row[o_b + b1]
                fl_ = floor_rel * (1.0 + abs(xv))
                learning = n >= warm
                inv = 1.0 / (n + 1.0)

                # -- fast model: reading vs robust level
                rf = xv - lev
                arf = abs(rf)
                sf = sbf if sbf > fl_ else fl_
                d_up = kf * (f_up if f_up > sf else sf)
                d_dn = kf * (f_dn if f_dn > sf else sf)
                e_up = fq * t_up
                e_dn = fq * t_dn
                if e_up > d_up:
                    d_up = e_up
                if e_dn > d_dn:
                    d_dn = e_dn
                zf = arf / (d_up if rf >= 0.0 else d_dn)
                slow_floor = kappa * (d_up if d_up > d_dn else d_dn)

                # level update (Huber), level-shift re-baselining
                mf = 0.5 * (f_up + f_dn)
                if mf < fl_:
                    mf = fl_
                if n <= 10.0:
                    limf = arf
                else:
                    limf = c * (mf if mf > sbf else sbf)
                rfc = rf if arf <= limf else (limf if rf > 0.0 else -limf)
                base_f = lev
                if zf >= 1.0:
                    if rf > 0.0:
                        streak = streak + 1.0 if streak > 0.0 else 1.0
                    else:
                        streak = streak - 1.0 if streak < 0.0 else -1.0
                else:
                    streak = 0.0
                if shift_m != 0.0 and abs(streak) >= shift_m:
                    bas += xv - lev
                    lev = xv
                    mid = xv
                    streak = 0.0
                else:
                    lev += (a_l if a_l > inv else inv) * rfc
                    rm = xv - mid
                    rm = rm if abs(rm) <= limf else (limf if rm > 0.0 else -limf)
                    mid += (a_m if a_m > inv else inv) * rm

                # -- slow model: smoother level vs baseline + time-of-day profile
                base_s = bas + seas
                rs = mid - base_s
                ars = abs(rs)
                ss = sbs if sbs > fl_ else fl_
                ds_up = ks * (s_up if s_up > ss else ss)
                ds_dn = ks * (s_dn if s_dn > ss else ss)
                if slow_floor > ds_up:
                    ds_up = slow_floor
                if slow_floor > ds_dn:
                    ds_dn = slow_floor
                zsl = ars / (ds_up if rs >= 0.0 else ds_dn)

                # -- flat line
                if xv == xl:
                    run += 1.0
                else:
                    if run > 0.0:
                        decayed = run_max * flat_dec ** run
                        run_max = run if run > decayed else decayed
                    run = 0.0
                if run > 0.0 and mf > fl_:
                    lim_run = flat_f * run_max * flat_dec ** run
                    zfl = run / (lim_run if lim_run > flat_min else flat_min)
                else:
                    zfl = 0.0

                # -- wide view: raw, short- and long-smoothed value vs a wide Gaussian
                xw = xv - w_se * seas
                sh_m += (a_sh if a_sh > inv else inv) * (xw - sh_m)
                lo_m += (a_lo if a_lo > inv else inv) * (xw - lo_m)
                sd_w = np.sqrt(w_v)
                if sd_w < fl_:
                    sd_w = fl_
                dw = xw - w_m
                zw = abs(dw) / (k_w * sd_w)  # ungated: what the likelihood view counts
                # the fast view's gate: beyond this key's own tail of deviations (before update)
                g_up = k_fg * wt_up
                g_dn = k_fg * wt_dn
                # gated: a deviation must also be unusual for this key's own tail (bursts)
                w_up = k_w * sd_w
                w_dn = w_up
                if k_t * wt_up > w_up:
                    w_up = k_t * wt_up
                if k_t * wt_dn > w_dn:
                    w_dn = k_t * wt_dn
                if (wt_up if dw >= 0.0 else wt_dn) > 0.0:
                    zwg = abs(dw) / (w_up if dw >= 0.0 else w_dn)
                else:
                    zwg = 0.0
                dsh = sh_m - w_m
                zsh = abs(dsh) / (k_sh * sd_w)
                # gated: the short mean must also be unusual for its own tail (bursts)
                s_lim = k_sh * sd_w
                if k_st > 0.0:
                    gs_ = st_up if dsh >= 0.0 else st_dn
                    if gs_ > 0.0:
                        if k_st * gs_ > s_lim:
                            s_lim = k_st * gs_
                            zsh = abs(dsh) / s_lim
                    else:
                        zsh = 0.0
                    st_up = _tail(st_up, dsh, wq_up, wq_dn)
                    st_dn = _tail(st_dn, -dsh, wq_up, wq_dn)
                zlo = abs(lo_m - w_m) / (k_lo * sd_w)
                aw = a_w if a_w > inv else inv
                w_m += aw * dw
                w_v = (1.0 - aw) * (w_v + aw * dw * dw)
                wt_up = _tail(wt_up, dw, wq_up, wq_dn)
                wt_dn = _tail(wt_dn, -dw, wq_up, wq_dn)

                # the most surprised view explains the score: its code, expected value, range
                z = zf * inv_margin
                which = 1
                f_lo = d_dn / inv_margin
                f_hi = d_up / inv_margin
                if k_fg > 0.0 and (g_up if rf >= 0.0 else g_dn) > 0.0:
                    # a spike within this key's usual range (its bursts) is not one
                    zg = arf / (g_up if rf >= 0.0 else g_dn)
                    if zg < z:
                        z = zg
                    if g_up > f_hi:
                        f_hi = g_up
                    if g_dn > f_lo:
                        f_lo = g_dn
                bo, lo, hi = base_f, base_f - f_lo, base_f + f_hi
                if zsl * inv_ms > z:
                    z = zsl * inv_ms
                    which = 2
                    bo, lo, hi = base_s, base_s - ds_dn / inv_ms, base_s + ds_up / inv_ms
                if zfl * inv_mf > z:
                    z = zfl * inv_mf
                    which = 3
                wm0 = w_m - aw * dw + w_se * seas  # the wide mean before this reading
                if zwg > z:
                    z = zwg
                    which = 4
                    bo, lo, hi = wm0, wm0 - w_dn, wm0 + w_up
                if zsh > z:
                    z = zsh
                    which = 5
                    bo, lo, hi = wm0, wm0 - s_lim, wm0 + s_lim
                if zlo > z:
                    z = zlo
                    which = 6
                    bo, lo, hi = wm0, wm0 - k_lo * sd_w, wm0 + k_lo * sd_w
                # -- likelihood: is this much surprise unusual for this key lately?
                zin = z if z > zw else zw
                l_s += (a_ls if a_ls > inv else inv) * ((zin if zin < l_cap else l_cap) - l_s)
                sd_l = np.sqrt(l_v)
                if sd_l < 1e-3:
                    sd_l = 1e-3
                zli = (l_s - l_m) / (k_l * sd_l)
                dl = l_s - l_m
                al = a_ll if a_ll > inv else inv
                l_m += al * dl
                l_v = (1.0 - al) * (l_v + al * dl * dl)
                if zli > z:
                    z = zli
                    which = 7
                if cnt > 0.0:  # the expected value and range on the reading's own scale
                    bo = _from_count_scale(bo)
                    lo = _from_count_scale(lo)
                    hi = _from_count_scale(hi)
                base_out[i] = bo
                lo_out[i] = lo
                hi_out[i] = hi
                model_out[i] = which

                # -- learning: fast scales (frozen while fast says anomalous), tail quantiles
                if not (learning and zf >= 1.0):
                    a = a_f if a_f > inv else inv
                    if rf >= 0.0:
                        lim = c * f_up if n > 10.0 else arf
                        f_up += a * (2.0 * (arf if arf < lim else lim) - f_up)
                        f_dn -= a * f_dn
                    else:
                        lim = c * f_dn if n > 10.0 else arf
                        f_dn += a * (2.0 * (arf if arf < lim else lim) - f_dn)
                        f_up -= a * f_up
                t_up = _tail(t_up, rf, q_up, q_dn)
                t_dn = _tail(t_dn, -rf, q_up, q_dn)

                # slow baseline and scales
                ms = 0.5 * (s_up + s_dn)
                if ms < fl_:
                    ms = fl_
                lims = ars if n <= 10.0 else c * (ms if ms > sbs else sbs)
                rsc = rs if ars <= lims else (lims if rs > 0.0 else -lims)
                if zsl >= 1.0:
                    if rs > 0.0:
                        sstreak = sstreak + 1.0 if sstreak > 0.0 else 1.0
                    else:
                        sstreak = sstreak - 1.0 if sstreak < 0.0 else -1.0
                elif sstreak > 0.0:  # a reading back inside only erodes the count: flicker
                    sstreak -= 1.0  # near the boundary does not restart it
                elif sstreak < 0.0:
                    sstreak += 1.0
                if accept != 0.0 and abs(sstreak) >= accept:
                    bas = mid - seas  # a lasting deviation becomes the new normal
                    sstreak = 0.0
                else:
                    bas += (a_b if a_b > inv else inv) * rsc
                if not (learning and zsl >= 1.0):
                    a = a_s if a_s > inv else inv
                    if rs >= 0.0:
                        lim = c * s_up if n > 10.0 else ars
                        s_up += a * (2.0 * (ars if ars < lim else lim) - s_up)
                        s_dn -= a * s_dn
                    else:
                        lim = c * s_dn if n > 10.0 else ars
                        s_dn += a * (2.0 * (ars if ars < lim else lim) - s_dn)
                        s_up -= a * s_up

                # time-of-day bins (both neighbours, by interpolation weight)
                for b, wb in ((b0, w0), (b1, w1)):
                    if wb > 0.0:
                        cb = row[o_c + b] + wb
                        row[o_c + b] = cb
                        r = wb / cb
                        early = cb <= early_v
                        row[o_s + b] += (g_s if g_s > r else r) * wb * (rs if early else rsc)
                        gs = (g_sb if g_sb > r else r) * wb
                        v = row[o_f + b]
                        if not early:
                            lim = c * (mf if mf > v else v)
                            row[o_f + b] = v + gs * ((arf if arf < lim else lim) - v)
                        else:
                            row[o_f + b] = v + gs * (arf - v)
                        v = row[o_b + b]
                        if not early:
                            lim = c * (ms if ms > v else v)
                            row[o_b + b] = v + gs * ((ars if ars < lim else lim) - v)
                        else:
                            row[o_b + b] = v + gs * (ars - v)

                xl = xv
                n += 1.0

            # score and episode flag: a hot reading after ``cooldown`` non-hot ones
            zz = z * z
            sc = zz / (1.0 + zz)
            scores[i] = sc
            if sc >= thr:
                prev = since0 + m if last_hot < 0 else float(m - last_hot - 1)
                flags[i] = prev >= cooldown and n_out[i] >= warm
                last_hot = m
            m += 1

        if m:
            row[1] = n
            row[2], row[3], row[4] = xl, lev, mid
            row[5], row[6], row[7], row[8] = f_up, f_dn, t_up, t_dn
            row[9], row[10], row[11] = bas, s_up, s_dn
            row[12], row[13] = run, run_max
            row[14] = float(m - 1 - last_hot) if last_hot >= 0 else since0 + m
            row[15], row[16] = streak, sstreak
            row[17] = t_last
            row[18], row[19], row[20], row[21] = w_m, w_v, sh_m, lo_m
            row[22], row[23], row[24] = l_s, l_m, l_v
            row[25], row[26] = wt_up, wt_dn
            row[27], row[28] = st_up, st_dn
            row[29] = cnt if k_ct > 0.0 else row[29]
    return scores, base_out, flags, n_out, model_out, lo_out, hi_out


# --------------------------------------------------------------------------------------------
# Comparison baseline: NAB's "windowedGaussian"


@dataclass(frozen=True)
class WindowedGaussianConfig:
    """Trailing-window Gaussian z-score (NAB ``windowedGaussian``: window 1000, step 1)."""

    window: int = 1000
    z_threshold: float = 4.0  # flag when |z| >= z_threshold (erf saturates, so not on score)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError("window must be >= 2 readings")
        if self.z_threshold <= 0:
            raise ValueError("z_threshold must be > 0")


@dataclass
class WindowedGaussianState:
    """The last ``window`` readings (a large state: this detector is for comparison only)."""

    values: list[float] = field(default_factory=list)

    def to_row(self) -> tuple[float, ...]:
        return (float(len(self.values)),) + tuple(self.values)

    @classmethod
    def from_row(cls, row: Sequence[float]) -> WindowedGaussianState:
        k = int(row[0])
        return cls(values=[float(v) for v in row[1:1 + k]])


class WindowedGaussianBaseline:
    """``score_batch`` with the detector's signature, scoring against the trailing window.

    score = erf(|z| / sqrt 2) (two-sided Gaussian probability), z from the mean and population
    standard deviation of the previous ``window`` readings (1e-6 if zero; score 0 for the
    first reading); flag when ``|z| >= z_threshold``. Chunked calls agree with one call up to
    floating-point rounding (pandas' rolling sums), not bit for bit.
    """

    def __init__(self, config: WindowedGaussianConfig | None = None) -> None:
        self.config = config or WindowedGaussianConfig()

    def initial_state(self) -> WindowedGaussianState:
        return WindowedGaussianState()

    def zscores(self, values: np.ndarray, state: WindowedGaussianState | None
                ) -> tuple[np.ndarray, np.ndarray, WindowedGaussianState]:
        """|z| and the window mean of each reading, and the new state."""
        import pandas as pd

        w = self.config.window
        prev = [] if state is None else list(state.values)
        x = np.asarray(values, dtype=np.float64).ravel()
        allv = pd.Series(np.concatenate([np.asarray(prev, dtype=np.float64), x]))
        mean = allv.rolling(w, min_periods=1).mean().shift(1).to_numpy()[len(prev):]
        std = allv.rolling(w, min_periods=1).std(ddof=0).shift(1).to_numpy()[len(prev):]
        std = np.where(std > 0, std, 1e-6)
        z = np.abs(x - mean) / std
        z = np.where(np.isnan(z), 0.0, z)
        keep = np.concatenate([np.asarray(prev, dtype=np.float64), x])[-w:]
        return z, mean, WindowedGaussianState(values=keep.tolist())

    def score_batch(self, values: np.ndarray, times: np.ndarray,
                    state: WindowedGaussianState | None,
                    config: WindowedGaussianConfig | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, WindowedGaussianState]:
        if config is not None:
            self.config = config
        from scipy.special import erf

        z, mean, new = self.zscores(values, state)
        scores = erf(z / math.sqrt(2.0))
        return scores, mean, z >= self.config.z_threshold, new
