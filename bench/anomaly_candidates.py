"""A comparison candidate for ``bench/anomaly_quality.py``: forecast-error tests with published
parameters (not the product's detector, which is ``gold.anomaly``).

Each reading is compared with a forecast (an EWMA over the likelihood's ten-reading scale); the
error, in units of the key's mean absolute error, is judged by two tests with one tail
probability ``q = min(1e-5, false_alarms_per_day x interval / 86,400 s)``:

- **point**: the error's tail probability by peaks over threshold, as SPOT (Siffer et al., KDD
  2017): a generalised Pareto fitted by moments to the excesses over the 98% point, started from
  the Gaussian's tail; a reading beyond the boundary teaches the boundary (winsorised).
- **likelihood**: Numenta's anomaly likelihood (Ahmad et al., Neurocomputing 2017; nupic's
  defaults: learning period 288, estimation samples 100, historic window 8640, averaging
  window 10, red threshold 1e-5, floors 0.03 / 0.0003), two-sided, over a raw score: ``erf``
  of the error (``raw="erf"``: uniform under Gaussian errors; designed before any NAB score was
  seen) or the point test's own score (``raw="point"``: ~0 while the forecast holds, as HTM's
  raw score; a revision made after seeing the first variant's NAB score, so its score on the
  development series is optimistic).

One flag per run of readings at or above the boundary (nupic's filter). Why it is not the
product's detector, and its figures: docs/anomaly.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numba
import numpy as np

_NORMAL = NormalDist()


@dataclass(frozen=True)
class ForecastTestsConfig:
    point: bool = True
    likelihood: bool = True
    raw: str = "erf"  # "erf" or "point" (see the module docstring)
    tail_probability: float = 1e-5
    false_alarms_per_day: float = 0.1
    learning_period: int = 288
    estimation_samples: int = 100
    historic_window: int = 8640
    averaging_window: int = 10
    tail_level: float = 0.98

    def params(self) -> tuple[float, ...]:
        u = _NORMAL.inv_cdf(0.5 + self.tail_level / 2.0)
        return tuple(float(v) for v in (
            0.5, self.learning_period + self.estimation_samples, self.learning_period,
            self.estimation_samples, self.historic_window, 2.0 / (self.averaging_window + 1.0),
            self.false_alarms_per_day / 86400.0, self.tail_probability, u, 1.0 - self.tail_level,
            (1.0 - self.tail_level) * self.learning_period, float(self.point),
            float(self.likelihood), 1.0 if self.raw == "point" else 0.0))

    def initial_rows(self, lanes: int) -> np.ndarray:
        u = _NORMAL.inv_cdf(0.5 + self.tail_level / 2.0)
        lam = math.exp(-u * u / 2.0) / math.sqrt(2.0 * math.pi) / (1.0 - _NORMAL.cdf(u))
        row = np.zeros(15 + self.averaging_window)
        row[0] = 5.0
        row[4] = math.nan
        row[6:10] = (1.0 - self.tail_level, lam - u, 1.0 - u * lam + u * u,
                     (1.0 - self.tail_level) * self.learning_period)
        return np.tile(row, (lanes, 1))


def flags_lanes(values: np.ndarray, times: np.ndarray, offsets: np.ndarray,
                config: ForecastTestsConfig) -> np.ndarray:
    """Flags of every lane (``[offsets[j], offsets[j + 1])``, each in time order)."""
    offs = np.ascontiguousarray(offsets, dtype=np.int64)
    states = config.initial_rows(offs.size - 1)
    return _kernel(np.ascontiguousarray(values, dtype=np.float64),
                   np.ascontiguousarray(times, dtype=np.float64), offs, states,
                   config.averaging_window, config.params())


_SQRT_HALF_PI = math.sqrt(math.pi / 2.0)  # mean absolute deviation x this = sd, for a Gaussian


@numba.njit(cache=True)
def _gpd_sf(y, m1, m2):
    """P(excess > y) of the generalised Pareto with mean ``m1`` and second moment ``m2``
    (method of moments; shape clipped to [-0.5, 0.45], where those moments exist)."""
    v = m2 - m1 * m1
    r = m1 * m1 / v if v > 0.0 else 1.0
    xi = min(max(0.5 * (1.0 - r), -0.5), 0.45)
    sigma = 0.5 * m1 * (1.0 + r)
    if sigma <= 0.0:
        return 0.0 if y > 0.0 else 1.0
    if abs(xi) < 1e-9:
        return math.exp(-y / sigma)
    base = 1.0 + xi * y / sigma
    return 0.0 if base <= 0.0 else base ** (-1.0 / xi)


@numba.njit(cache=True)
def _gpd_isf(p, m1, m2):
    """The excess ``y`` with ``_gpd_sf(y) == p`` (0 < p <= 1)."""
    v = m2 - m1 * m1
    r = m1 * m1 / v if v > 0.0 else 1.0
    xi = min(max(0.5 * (1.0 - r), -0.5), 0.45)
    sigma = 0.5 * m1 * (1.0 + r)
    if abs(xi) < 1e-9:
        return -sigma * math.log(p)
    return sigma / xi * (p ** (-xi) - 1.0)


@numba.njit(cache=True)
def _kernel(xs, ts, offs, states, w, p):
    """The per-reading recursion and run flags of every lane (``states[lane]`` updated in
    place)."""
    (thr, warm, learn, est, hist, a_lev, q_per_s, q_max, u, p_ref, exc_prior, on_pt, on_lk,
     raw_point) = p
    flags = np.zeros(xs.size, dtype=np.bool_)
    o_r = 15  # the raw scores follow the 15 scalars
    for lane in range(offs.size - 1):
        row = states[lane]
        n, lev, mae, t_last, dt = row[1], row[2], row[3], row[4], row[5]
        p_u, m1, m2, exc_n = row[6], row[7], row[8], row[9]
        ring_n, lik_n, lik_m, lik_v, hot = row[10], row[11], row[12], row[13], row[14]
        for i in range(offs[lane], offs[lane + 1]):
            xv = xs[i]
            tv = ts[i]
            if np.isnan(xv) or np.isnan(tv):
                continue
            if n == 0.0:
                lev = xv
                t_last = tv
                n = 1.0
                continue
            gap = tv - t_last
            if gap > 0.0:
                dt = gap if dt <= 0.0 else dt + (gap - dt) / min(n, learn)
            t_last = tv
            q = min(max(q_per_s * (dt if dt > 0.0 else 1.0), 1e-300), q_max)
            e = xv - lev
            s = mae * _SQRT_HALF_PI
            floor = 1e-6 * (1.0 + abs(lev))
            s = s if s > floor else floor
            z = abs(e) / s
            # point test: peaks over threshold, the excess fitted by a generalised Pareto
            p_err = min(p_u * _gpd_sf(z - u, m1, m2) if z > u else math.erfc(z / math.sqrt(2.0)),
                        1.0)
            p_pt = p_err if on_pt > 0.0 else 1.0
            # likelihood: the raw score averaged over the window, against its learnt statistics
            if raw_point > 0.0:  # the point test's own score: ~0 while the forecast holds
                l_pt = math.log(p_err) / math.log(q_max) if p_err > 0.0 else 1e300
                raw = l_pt / (1.0 + l_pt) if l_pt > 0.0 else 0.0
            else:  # erf(|z| / sqrt 2): uniform on [0, 1) while the errors are Gaussian
                raw = math.erf(z / math.sqrt(2.0))
            row[o_r + np.int64(ring_n) % w] = raw
            ring_n += 1.0
            filled = min(ring_n, w)
            avg = 0.0
            for j in range(np.int64(filled)):
                avg += row[o_r + j]
            avg /= filled
            p_lk = 1.0
            if lik_n >= est and on_lk > 0.0:
                mu = lik_m if lik_m > 0.03 else 0.03
                var = lik_v if lik_v > 0.0003 else 0.0003
                p_lk = 0.5 * math.erfc(abs(avg - mu) / math.sqrt(2.0 * var))
            pv = p_pt if p_pt < p_lk else p_lk
            lq = math.log(q)
            ll = math.log(pv) / lq if pv > 0.0 else 1e300
            ll = ll if ll > 0.0 else 0.0
            sc = ll / (1.0 + ll)
            flags[i] = sc >= thr and hot == 0.0 and n >= warm
            hot = 1.0 if sc >= thr else 0.0
            # learning, after judging
            p_u_before = p_u
            if n >= learn:
                p_u += ((1.0 if z > u else 0.0) - p_u) / (n - learn + 1.0 + exc_prior / p_ref)
                if z > u:  # a reading beyond the boundary teaches the boundary (winsorised)
                    zq = u + _gpd_isf(q / p_u_before, m1, m2) if q < p_u_before else u
                    exc_n += 1.0
                    y = z - u if z < zq else zq - u
                    m1 += (y - m1) / exc_n
                    m2 += (y * y - m2) / exc_n
                lik_n += 1.0
                c = lik_n if lik_n < hist else hist
                d = avg - lik_m
                lik_m += d / c
                lik_v += (d * (avg - lik_m) - lik_v) / c
            clip = u * s if n >= learn else abs(e)  # the first learning period learns unclipped
            ec = e if e < clip else clip
            ec = ec if ec > -clip else -clip
            lev += a_lev * ec
            mae += (abs(ec) - mae) / (n if n < learn else learn)
            n += 1.0
        row[1], row[2], row[3], row[4], row[5] = n, lev, mae, t_last, dt
        row[6], row[7], row[8], row[9] = p_u, m1, m2, exc_n
        row[10], row[11], row[12], row[13], row[14] = ring_n, lik_n, lik_m, lik_v, hot
    return flags

