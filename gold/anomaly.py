"""Streaming, unsupervised anomaly scoring of one device's metric (gold layer).

One detector per ``(device_id, metric)`` key; its whole memory is a flat row of 162 floats (a
Spark state struct, 1,296 bytes), updated reading by reading in event-time order, so scoring a
series in one call or in any split into micro-batches gives bit-identical results.

**Method: forecasts judged against their own tails, at an alarm budget per day.** Each part is
a published idea with its published setting, or a stated principle (:data:`DESIGN_CHOICES`);
none was set by a NAB score, one (the young tail's weight) on synthetic series (docs/anomaly.md
keeps the evidence).

1. **Seven forecasts.** Exponential smoothing (Brown 1956) at six time scales: the previous
   reading and the mean of about the last 4, 16, 64, 256 and 1,024 readings (:data:`SCALES`,
   powers of 4: scale-free, to ~3.5 days at 5-minute readings); and a **daily profile**, the
   value at this half hour of the day over about a week (once that half hour has been seen
   whole). A series that wanders (a random walk) is predictable at the short scales; one that
   holds a level, at the long ones, which see a lasting shift for as long as their scale; one
   with a daily cycle, by its profile, which sees a missing peak.
2. **Surprise per forecast**: the reading's distance from it in units of that forecast's typical
   error (mean absolute error x 1.2533, the Gaussian standard deviation), learnt over
   ``memory`` readings; errors beyond the forecast's alarm boundary are clipped when learning,
   so an anomaly does not teach itself to be normal.
3. **Each forecast's own tail** (peaks over threshold, SPOT: Siffer et al., KDD 2017): its
   surprise beyond a tracked ``tail_quantile`` (98%, SPOT's) is an excess; a generalised Pareto
   fitted to the excesses by moments gives the surprise exceeded with probability ``q``; the
   readings a forecast calls anomalous are not learnt by its tail (SPOT's rule). The shape is
   kept in [0, 0.45]: never a bounded tail, finite variance; a young key's is assumed heavy
   (weighing as five excesses, half the warm-up's) until its excesses show otherwise; and the
   boundary is never nearer the tail quantile than a Gaussian's would be (a lattice of
   surprises, as from integer readings, fits a degenerate tail).
4. **An alarm budget in time**: ``false_alarms_per_day`` per key (0.1: one per device-day at
   ten metrics), shared by the seven forecasts and the stuck test (Bonferroni:
   ``q = budget x interval / 1 day / 8``), the interval between readings learnt from the event
   times. An operator's tolerance is per day, not per reading: a key read four times a second
   gets a ~1,000x smaller ``q`` than one read every five minutes.
5. **Stuck values**: a run of identical readings, as improbable as this key's own runs make it:
   the chance that a reading repeats the last one, times the share of its finished runs that
   reached this length (counted by length class 1, 2, 4, ... 4,096; one run of prior mass
   spread as ``0.5^(k - 1)``); beyond the longest class seen, a run goes on as a memoryless one
   that reaches that class as often. A run flags once that probability falls below ``q``; a
   flagged run is not learnt; a key that has never changed is constant, not stuck.

``score = r^2 / (1 + r^2)``, ``r`` the largest of each forecast's surprise over its boundary
and the stuck run's ``log P / log q``: 0.5 at the boundary; 0 until ``warmup`` readings are
learnt (ten expected excesses: ``10 / (1 - tail_quantile)`` = 500). A flag needs ``score >=
threshold`` and ``cooldown`` readings below the threshold before it: one flag per episode.
``score_lanes(..., explain=True)`` names the model that explains each score (:data:`MODELS`:
``mean_16`` is "the mean of about the last 16 readings", ``flat`` a stuck value) and the range
it expected.

**Count scale** (``count_scale``): a key whose readings are all non-negative integers through
its warm-up (event counts) is scored on Anscombe's scale ``2 sqrt(x + 3/8)``, where Poisson
noise has a standard deviation of about 1 at any level; expected values and ranges are
reported in the reading's units. A key that sends anything else during its warm-up starts
again on the raw scale from that reading (nothing was flagged yet, so nothing is lost).

State rows of the previous method (versions 1-4) hold nothing this one can continue from:
:func:`upgrade_rows` turns them into new keys, which learn for ``warmup`` readings before they
flag again.

The recursion is one numba kernel over the flat rows (``cache=True``: compiled once per
machine); :func:`score_lanes` runs it over many keys in one call, as the health stream does per
bucket (:func:`score_lanes_at`: on the states where the caller holds them, updated in place).
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

STATE_VERSION = 5.0

#: The forecasts' time scales, in readings.
SCALES: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)

#: ``model`` codes of ``score_lanes(..., explain=True)``: the model that explains a score.
MODELS: tuple[str, ...] = ("none", "previous", *(f"mean_{h}" for h in SCALES[1:]), "daily", "flat")
_FLAT = len(MODELS) - 1
#: The daily profile's bins (half an hour each) and how many days it remembers (a week: weekdays
#: and weekends alike).
DAY_BINS, PROFILE_DAYS = 48, 7.0

_MAX_SHAPE, _YOUNG_TAIL, _FIRST_LEARNT = 0.45, 5.0, 16.0
#: "never hot": the readings-since counter stops here, where float64 still counts exactly
_SINCE_MAX = 1e15

#: Every value the method fixes beside :class:`DetectorConfig`, with the principle that set it
#: (none by a NAB score); ``bench/anomaly_quality.py`` counts them.
DESIGN_CHOICES: dict[str, tuple[float, str]] = {
    "scale_factor": (4, "forecast scales in powers of 4: scale-free, six cover 1 to ~1,000 readings"),
    "scales": (len(SCALES), "from the previous reading to ~3.5 days at 5-minute readings"),
    "day_bins": (DAY_BINS, "the daily profile's resolution: half an hour"),
    "profile_days": (PROFILE_DAYS, "the profile remembers a week: weekdays and weekends alike"),
    "max_shape": (_MAX_SHAPE, "a generalised Pareto tail with finite variance (shape < 0.5)"),
    "young_tail_weight": (_YOUNG_TAIL, "a new key's tail is assumed heavy, weighing as five excesses "
                                       "(half the warm-up's ten; chosen on synthetic series)"),
    "first_learnt": (_FIRST_LEARNT, "a tail or the daily model's error is learnt from 16 readings on"),
}


@dataclass(frozen=True)
class DetectorConfig:
    """One configuration for every device and metric (no per-series tuning)."""

    threshold: float = 0.5  # flag when score >= threshold; 0.5 = the alarm boundary
    false_alarms_per_day: float = 0.1  # the alarm budget per key, in time
    memory: int = 4096  # readings the typical errors, the tail and the runs are learnt over
    tail_quantile: float = 0.98  # SPOT's: excesses above this quantile of z fit the tail
    cooldown: int = 64  # readings below the threshold before a new episode can flag
    count_scale: bool = True  # non-negative integer keys on Anscombe's scale

    @property
    def warmup(self) -> int:
        """Readings learnt before any flag: ten expected excesses for the tail fit."""
        return math.ceil(10.0 / (1.0 - self.tail_quantile))

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 < self.threshold < 1.0:
            problems.append("threshold must be in (0, 1)")
        if not self.false_alarms_per_day > 0.0:
            problems.append("false_alarms_per_day must be > 0")
        if self.memory < 4 * SCALES[-1]:
            problems.append(f"memory must be >= {4 * SCALES[-1]} readings (4 x the longest scale)")
        if not 0.5 <= self.tail_quantile < 1.0:
            problems.append("tail_quantile must be in [0.5, 1)")
        if self.cooldown < 0:
            problems.append("cooldown must be >= 0")
        if problems:
            raise ValueError("invalid DetectorConfig: " + "; ".join(problems))


_SCALARS: tuple[str, ...] = (
    "version",  # state layout version
    "n",  # readings learnt
    "x_last",  # previous reading (on the scored scale)
    "last_time",  # event time of the last reading (epoch s)
    "since",  # readings below threshold since the last one at/above it
    "counts",  # 1: scored on the count scale (every warm-up reading a non-negative integer)
    "interval",  # typical seconds between readings (the alarm budget's clock)
    "run",  # repeats of the current value so far
    "run_hot",  # 1: the current run was flagged (it will not be learnt)
    "starts",  # decayed count of readings that repeated the one before (outside runs) ...
    "trials",  # ... out of this many
    "daily_error", "daily_n",  # the daily profile's typical |error|, over this many readings
)
#: The models that forecast a value (all but ``none`` and ``flat``): each has its own tail.
_VALUE_MODELS: tuple[str, ...] = MODELS[1:-1]
#: finished runs are counted by length class: ``runs_ge_L``, the decayed count of runs of at
#: least L repeats, L = 1, 2, 4, ..., 4096
RUN_CLASSES: tuple[int, ...] = tuple(2 ** b for b in range(13))
#: the row's arrays after the scalars: (name, element names)
_ROW_ARRAYS: tuple[tuple[str, tuple], ...] = (
    ("forecast", SCALES),  # the forecast per scale ...
    ("error", SCALES),  # ... and its typical |error|
    ("tail_u", _VALUE_MODELS),  # per model: the tracked tail_quantile of its surprise, ...
    ("excess_m1", _VALUE_MODELS),  # ... the first and second moments of its excesses ...
    ("excess_m2", _VALUE_MODELS),
    ("excesses", _VALUE_MODELS),  # ... over this many
    ("runs_ge", RUN_CLASSES),
    ("daily", range(DAY_BINS)),  # the daily profile, per half hour ...
    ("daily_seen", range(DAY_BINS)),  # ... and the readings each has learnt
)


def state_fields(config: DetectorConfig | None = None) -> list[tuple[str, str]]:
    """(name, type) of each element of ``DetectorState.to_row()``: all ``double``."""
    names = list(_SCALARS) + [f"{a}_{e}" for a, elements in _ROW_ARRAYS for e in elements]
    return [(name, "double") for name in names]


#: State fields for the default configuration (a Spark state struct of doubles).
STATE_FIELDS: list[tuple[str, str]] = state_fields()
_WIDTH = len(STATE_FIELDS)


def state_schema_ddl(config: DetectorConfig | None = None) -> str:
    """The state as a Spark DDL struct body, e.g. for ``applyInPandasWithState``."""
    return ", ".join(f"{n} {t.upper()}" for n, t in state_fields(config))


@dataclass
class DetectorState:
    """Everything the detector remembers about one (device, metric)."""

    n: float = 0.0
    x_last: float = 0.0
    last_time: float = float("nan")
    since: float = _SINCE_MAX
    counts: float = 1.0
    interval: float = 0.0
    run: float = 0.0
    run_hot: float = 0.0
    starts: float = 0.0
    trials: float = 0.0
    daily_error: float = 0.0
    daily_n: float = 0.0
    arrays: dict[str, list[float]] = field(default_factory=lambda: {
        a: [0.0] * len(elements) for a, elements in _ROW_ARRAYS})

    def to_row(self) -> tuple[float, ...]:
        """Flat tuple of floats in ``state_fields()`` order."""
        head = (STATE_VERSION,) + tuple(float(getattr(self, n)) for n in _SCALARS[1:])
        return head + tuple(float(v) for a, _ in _ROW_ARRAYS for v in self.arrays[a])

    @classmethod
    def from_row(cls, row: Sequence[float]) -> DetectorState:
        """Inverse of :meth:`to_row`; a row of an older version loads as a new key."""
        row = [float(v) for v in row]
        if len(row) != _WIDTH or row[0] != STATE_VERSION:
            row = upgrade_rows([row])[0].tolist()
        st = cls(**{name: row[i] for i, name in enumerate(_SCALARS) if name != "version"})
        at = len(_SCALARS)
        for a, elements in _ROW_ARRAYS:
            st.arrays[a] = row[at:at + len(elements)]
            at += len(elements)
        return st

    def copy(self) -> DetectorState:
        return DetectorState.from_row(self.to_row())


def initial_state(config: DetectorConfig | None = None) -> DetectorState:
    """State of a key never seen before."""
    return DetectorState()


def upgrade_rows(rows: np.ndarray, config: DetectorConfig | None = None) -> np.ndarray:
    """State rows of an older layout as rows of this one.

    Versions 1-4 were another method (robust local views, a time-of-day profile, wide views):
    nothing of theirs is a forecast per scale or a tail of this method's surprise, so their
    keys start as new ones and learn for ``warmup`` readings. Rows already at this version pass
    through; anything else is refused."""
    rows = np.array(rows, dtype=np.float64, ndmin=2)
    if rows.shape[1] == _WIDTH and np.all(rows[:, 0] == STATE_VERSION):
        return rows
    if rows.size and np.all(np.isin(rows[:, 0], (1.0, 2.0, 3.0, 4.0))):
        return initial_rows(len(rows), config)
    raise ValueError(f"state rows of {rows.shape[1]} values are neither version 1-4 nor "
                     f"{STATE_VERSION} ({_WIDTH} values)")


def initial_rows(lanes: int, config: DetectorConfig | None = None) -> np.ndarray:
    """``lanes`` copies of ``initial_state(config).to_row()`` as a ``[lanes, state_len]`` matrix."""
    return np.tile(np.asarray(initial_state(config).to_row()), (lanes, 1))


@lru_cache(maxsize=32)
def _params(cfg: DetectorConfig) -> tuple[float, ...]:
    """The configuration as the kernel's flat tuple of floats."""
    return (float(cfg.threshold), float(cfg.false_alarms_per_day), float(cfg.memory),
            float(cfg.tail_quantile), float(cfg.cooldown), float(cfg.warmup),
            1.0 if cfg.count_scale else 0.0)


def score_lanes(values: np.ndarray, times: np.ndarray, offsets: np.ndarray, states: np.ndarray,
                config: DetectorConfig | None = None, explain: bool = False) -> tuple[np.ndarray, ...]:
    """Score many independent (device, metric) lanes in one compiled call.

    ``values``/``times`` hold every lane's readings back to back, each lane in event-time order;
    lane ``j`` is ``[offsets[j], offsets[j + 1])`` (``len(offsets) == lanes + 1``) and starts
    from ``states[j]`` (a ``DetectorState.to_row()``; see :func:`initial_rows`). Per lane this
    is exactly :func:`score_batch`: one call per micro-batch instead of one per key is what
    makes per-key scoring cheap. Returns ``(scores, baselines, flags, n_before, new_states)``:
    ``n_before`` is the count of readings the lane had learnt before each reading; ``states``
    is not modified. With ``explain``, also ``(model, low, high)`` per reading: which model was
    the most surprised (:data:`MODELS`) and the range it expected (NaN for ``flat``).
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
    if states.shape[1] != _WIDTH:
        raise ValueError(f"state rows of {states.shape[1]} values do not match the layout "
                         f"({_WIDTH} values; older versions: upgrade_rows)")
    if np.any(states[at, 0] != STATE_VERSION):
        raise ValueError(f"state version is not {STATE_VERSION}")
    return _kernel(x, t, offs, states, at, np.asarray(SCALES, dtype=np.float64), _params(cfg))


def score_batch(values: np.ndarray, times: np.ndarray, state: DetectorState | None,
                config: DetectorConfig | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, DetectorState]:
    """Score readings (event-time order) of one (device, metric) and advance its state.

    Returns ``(scores in [0, 1], baselines, flags, new_state)``; ``baselines`` is the value the
    reading was compared against (the forecast of the most surprised scale, or the stuck
    value). NaN readings get score 0, no flag, a NaN baseline and leave the state untouched.
    The input state is not modified. One lane of :func:`score_lanes`.
    """
    cfg = config or DetectorConfig()
    st = initial_state(cfg) if state is None else state
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
_SD = math.sqrt(math.pi / 2.0)  # Gaussian standard deviation per mean absolute deviation
_DAY = 86400.0


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
def _gauss_quantile(q):
    """|z| a standard Gaussian exceeds with probability ``q`` (both sides; Abramowitz and
    Stegun 26.2.23, error < 5e-4)."""
    t = math.sqrt(-2.0 * math.log(0.5 * q))
    return t - (2.515517 + 0.802853 * t + 0.010328 * t * t) / (
        1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t)


@_njit_cached
def _boundary(u, m1, m2, ne, lg, zq, z98):
    """The surprise exceeded with probability ``q``: a generalised Pareto above ``u`` (which
    ``z`` exceeds with probability ``1 - pq``) fitted to the excesses' moments, its shape
    shrunk towards the heaviest allowed (0.45) with the weight of five excesses, so a young
    key's tail is assumed heavy until it has shown otherwise; never below the Gaussian
    quantile of ``q``. ``lg``: log((1 - pq) / q); ``zq``, ``z98``: the Gaussian quantiles of
    ``q`` and ``1 - pq`` (per reading and per call: the same for every model)."""
    xi = 0.0
    sigma = m1
    v = m2 - m1 * m1
    if v > 0.0:
        ratio = m1 * m1 / v
        xi = 0.5 * (1.0 - ratio)
        if xi > 1e-6:
            sigma = 0.5 * m1 * (ratio + 1.0)
        else:
            xi = 0.0
    # until the tail is known, the heaviest shape allowed weighs as five excesses
    xi = (ne * (xi if xi < _MAX_SHAPE else _MAX_SHAPE) + _YOUNG_TAIL * _MAX_SHAPE) / (ne + _YOUNG_TAIL)
    zs = u + sigma / xi * (math.exp(xi * lg) - 1.0)
    # never a lighter tail than a Gaussian's: as far beyond u as its q-quantile is beyond its
    # pq-quantile (u of a Gaussian surprise; a lattice of surprises has a degenerate fit)
    zg = zq / z98 * (u if u > z98 else z98)
    return zs if zs > zg else zg


@_njit_cached
def _kernel(xs, ts, offs, states, at, hs, p):
    """The per-reading recursion and episode flags of every lane (``states[at[lane]]`` updated
    in place)."""
    thr, budget, mem, pq, cooldown, warm, k_ct = p
    total = xs.size
    ns = hs.size  # forecast scales
    nm = ns + 1  # value models: the scales and the daily profile
    nr = len(RUN_CLASSES)
    o_f = 13  # after the 13 scalars: the row's arrays, in _ROW_ARRAYS order
    o_e = o_f + ns
    o_u = o_e + ns
    o_m1 = o_u + nm
    o_m2 = o_m1 + nm
    o_ne = o_m2 + nm
    o_r = o_ne + nm
    o_d = o_r + nr
    scores = np.zeros(total)
    base_out = np.full(total, np.nan)
    lo_out = np.full(total, np.nan)
    hi_out = np.full(total, np.nan)
    model_out = np.zeros(total, dtype=np.int8)
    flags = np.zeros(total, dtype=np.bool_)
    n_out = np.zeros(total)
    keep = 1.0 - 1.0 / mem  # per-reading decay of the run counts
    up = pq / (1.0 - pq)  # the quantile tracker's step up, per step down
    z98 = _gauss_quantile(1.0 - pq)
    zj = np.zeros(nm)
    zsj = np.zeros(nm)
    fj = np.zeros(nm)
    ej = np.zeros(nm)
    for lane in range(offs.size - 1):
        row = states[at[lane]]
        n, xl, tl, since0 = row[1], row[2], row[3], row[4]
        cnt = row[5] if k_ct > 0.0 else 0.0
        dt, run, run_hot, starts, trials = row[6], row[7], row[8], row[9], row[10]
        de, dn = row[11], row[12]
        m = 0  # valid readings so far in this lane (the episode counter's index)
        last_hot = -1
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
                    n = dt = run = run_hot = starts = trials = de = dn = 0.0
                    for j in range(o_f, row.size):
                        row[j] = 0.0
                else:
                    xv = _to_count_scale(xv)
            n_out[i] = n
            r = 0.0
            if n == 0.0:
                for j in range(ns):
                    row[o_f + j] = xv
                xl = xv
                tl = tv
                n = 1.0
                base_out[i] = xs[i]
            else:
                gap = tv - tl
                if gap > 0.0:
                    ag = 1.0 / n if 1.0 / n > 1.0 / mem else 1.0 / mem
                    dt = gap if dt <= 0.0 else dt + ag * (gap - dt)
                    tl = tv
                # the budget per reading, shared by the models (Bonferroni) and the stuck test
                q = budget * (dt if dt > 0.0 else 1.0) / 86400.0 / (nm + 1)
                if q > 0.5 * (1.0 - pq):
                    q = 0.5 * (1.0 - pq)
                if q < 1e-15:
                    q = 1e-15
                lg = math.log((1.0 - pq) / q)
                zq = _gauss_quantile(q)
                floor = 1e-9 * (1.0 + abs(xv))
                learnt = n >= warm

                # each value model's forecast, typical error, surprise and boundary
                for j in range(ns):
                    fj[j] = row[o_f + j]
                    ej[j] = row[o_e + j]
                per_visit = 86400.0 / DAY_BINS / (dt if dt > 0.0 else 1.0)
                b = o_d + np.int64((tv % 86400.0) / 86400.0 * DAY_BINS) % DAY_BINS
                fj[ns] = row[b]
                ej[ns] = de
                # the daily profile speaks once this half hour of the day was seen whole and its
                # typical error was learnt (as a tail is: from 16 readings)
                daily = row[b + DAY_BINS] >= per_visit
                models = nm if daily and dn >= _FIRST_LEARNT else ns
                model = 0
                for j in range(models):
                    zj[j] = abs(xv - fj[j]) / (_SD * (ej[j] if ej[j] > floor else floor))
                    zsj[j] = _boundary(row[o_u + j], row[o_m1 + j], row[o_m2 + j], row[o_ne + j],
                                       lg, zq, z98)
                    if zj[j] / zsj[j] > r:
                        r = zj[j] / zsj[j]
                        model = j + 1
                if model == 0:
                    model = 1

                # stuck: this reading repeats the last one. P(a run reaches k repeats): the
                # chance of a repeat, times the share of finished runs that reached k (its
                # length class), one run of prior mass spread as 0.5^(k - 1)
                rep = xv == xl
                if rep and trials > starts:  # a key that never changed is constant, not stuck
                    p_rep = (starts + 0.5) / (trials + 1.0)
                    k = run + 1.0
                    cls = 0
                    while cls + 1 < nr and 2.0 ** (cls + 1) <= k:
                        cls += 1
                    surv = (row[o_r + cls] + 0.5 ** (k - 1.0)) / (row[o_r] + 1.0)
                    # beyond the longest class seen, a run goes on as a memoryless (geometric)
                    # one that reaches that class as often as this key's runs did
                    top = cls
                    while top > 0 and row[o_r + top] < 1.0:
                        top -= 1
                    if 0 < top < cls:
                        ext = (row[o_r + top] / (row[o_r] + 1.0)) ** (k / 2.0 ** top)
                        if ext > surv:
                            surv = ext
                    rf = (math.log(p_rep) + math.log(surv)) / math.log(q)
                    if rf > r:
                        r = rf
                        model = _FLAT
                if model == _FLAT and r >= 1.0 and learnt:
                    run_hot = 1.0

                if model == _FLAT:
                    bo, lo, hi = xl, np.nan, np.nan
                else:
                    j = model - 1
                    half = zsj[j] * _SD * (ej[j] if ej[j] > floor else floor)
                    bo, lo, hi = fj[j], fj[j] - half, fj[j] + half
                if cnt > 0.0:  # the expected value and range on the reading's own scale
                    bo = _from_count_scale(bo)
                    lo = _from_count_scale(lo)
                    hi = _from_count_scale(hi)
                base_out[i] = bo
                lo_out[i] = lo
                hi_out[i] = hi
                model_out[i] = model

                # -- learning: errors clip at their model's boundary; each tail learns the
                # readings its model is calm on (SPOT)
                a = 1.0 / n if 1.0 / n > 1.0 / mem else 1.0 / mem
                for j in range(ns):
                    e = abs(xv - fj[j])
                    lim = zsj[j] * _SD * ej[j]
                    if learnt and ej[j] > floor and e > lim:
                        e = lim
                    row[o_e + j] = ej[j] + a * (e - ej[j])
                    af = 1.0 / (n + 1.0) if n + 1.0 < hs[j] else 1.0 / hs[j]
                    row[o_f + j] += af * (xv - fj[j])
                if daily:
                    e = abs(xv - fj[ns])
                    lim = zsj[ns] * _SD * de
                    if learnt and models == nm and de > floor and e > lim:
                        e = lim
                    dn += 1.0
                    de += (1.0 / dn if dn < mem else 1.0 / mem) * (e - de)
                seen = row[b + DAY_BINS] + 1.0
                row[b + DAY_BINS] = seen
                ad = 1.0 / (PROFILE_DAYS * per_visit)
                row[b] += (1.0 / seen if 1.0 / seen > ad else ad) * (xv - row[b])
                if n >= _FIRST_LEARNT:
                    g = 1.0 / (n + 50.0) if n + 50.0 < mem else 1.0 / mem
                    for j in range(models):
                        z = zj[j]
                        if learnt and z >= zsj[j]:
                            continue
                        u = row[o_u + j]
                        if u <= 0.0:
                            u = z
                        elif z > u:
                            grown = u * math.exp(g * up)
                            u = grown if grown < z else z
                        else:
                            u *= math.exp(-g)
                        row[o_u + j] = u
                        if z > u:
                            y = z - u
                            ne = row[o_ne + j] + 1.0
                            row[o_ne + j] = ne
                            ae = 1.0 / ne if 1.0 / ne > 1.0 / mem else 1.0 / mem
                            row[o_m1 + j] += ae * (y - row[o_m1 + j])
                            row[o_m2 + j] += ae * (y * y - row[o_m2 + j])
                # runs: a repeat counts once per reading outside a run; a finished run is learnt
                # in its length classes unless it was flagged
                starts *= keep
                trials *= keep
                for j in range(nr):
                    row[o_r + j] *= keep
                if rep:
                    if run == 0.0:
                        starts += 1.0
                        trials += 1.0
                    run += 1.0
                else:
                    if run > 0.0 and run_hot == 0.0:
                        for j in range(nr):
                            if 2.0 ** j <= run:
                                row[o_r + j] += 1.0
                    if run == 0.0:
                        trials += 1.0
                    run = 0.0
                    run_hot = 0.0
                xl = xv
                n += 1.0

            # score and episode flag: a hot reading after ``cooldown`` non-hot ones; no score
            # before the warm-up is learnt (the status rules read scores too)
            rr = r * r
            sc = rr / (1.0 + rr) if n_out[i] >= warm else 0.0
            scores[i] = sc
            if sc >= thr:
                prev = since0 + m if last_hot < 0 else float(m - last_hot - 1)
                flags[i] = prev >= cooldown and n_out[i] >= warm
                last_hot = m
            m += 1

        if m:
            row[1], row[2], row[3] = n, xl, tl
            row[4] = float(m - 1 - last_hot) if last_hot >= 0 else min(since0 + m, _SINCE_MAX)
            row[5] = cnt if k_ct > 0.0 else row[5]
            row[6], row[7], row[8], row[9], row[10] = dt, run, run_hot, starts, trials
            row[11], row[12] = de, dn
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
