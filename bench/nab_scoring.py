"""NAB scoring (Numenta Anomaly Benchmark v1.1 rules) for binary detections.

A faithful, vectorised port of NAB's ``Sweeper.calcSweepScore`` / ``calcScoreByThreshold`` for
one fixed threshold (our detector emits flags, so a detection is a flagged reading):

- every reading gets a sweep score: inside a labelled window ``tpWeight * S(pos) / S(-1)`` with
  ``pos = -(right - i + 1) / width`` and the scaled sigmoid ``S(x) = 2*sigmoid(-5x) - 1``
  (earlier in the window = more reward); outside, ``fpWeight * S(x)`` with ``x`` the distance
  past the previous window in window widths (``x = 3``, i.e. the full penalty, before the first
  window), so false positives shortly after a window cost less;
- the first ``min(floor(0.15 n), 0.15 * 5000)`` readings are NAB's probationary period:
  detections there are ignored (and a window with no scorable reading is not scored);
- raw score = sum over windows of the best (i.e. earliest) detection's sweep score, or
  ``-fnWeight`` if the window has none, plus the sweep scores of all detections outside windows;
- normalisation: ``100 * (raw - null) / (perfect - null)`` with ``null = -fnWeight * windows``
  (never fires) and ``perfect = tpWeight * windows``; the corpus score normalises the sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: NAB application profiles (config/profiles.json); weights are magnitudes, signs come from S.
PROFILES: dict[str, dict[str, float]] = {
    "standard": {"tpWeight": 1.0, "fnWeight": 1.0, "fpWeight": 0.11},
    "reward_low_FP_rate": {"tpWeight": 1.0, "fnWeight": 1.0, "fpWeight": 0.22},
    "reward_low_FN_rate": {"tpWeight": 1.0, "fnWeight": 2.0, "fpWeight": 0.11},
}

PROBATION_PERCENT = 0.15


def scaled_sigmoid(x: np.ndarray) -> np.ndarray:
    """NAB's scaled sigmoid: 2*sigmoid(-5x) - 1, and -1 from x >= 3 on."""
    x = np.asarray(x, dtype=float)
    return np.where(x >= 3.0, -1.0, 2.0 / (1.0 + np.exp(5.0 * x)) - 1.0)


def probationary_length(n: int, percent: float = PROBATION_PERCENT) -> int:
    """NAB: min(floor(percent * n), percent * 5000) readings."""
    return int(min(math.floor(percent * n), percent * 5000))


@dataclass
class SeriesScore:
    raw: float
    null: float
    perfect: float
    windows: int  # scored windows
    detected: int  # windows with at least one scorable detection
    false_positives: int  # scorable detections outside windows
    detections: int  # scorable detections in total

    @property
    def normalized(self) -> float | None:
        """Per-series NAB score (null detector = 0, perfect = 100); None without windows."""
        if self.perfect == self.null:
            return None
        return 100.0 * (self.raw - self.null) / (self.perfect - self.null)


def window_indexes(times_ns: np.ndarray, windows: list[tuple[np.int64, np.int64]]
                   ) -> list[tuple[int, int]]:
    """[left, right] reading indexes of each window (first reading >= start, last <= end)."""
    out = []
    for start, end in windows:
        left = int(np.searchsorted(times_ns, start, side="left"))
        right = int(np.searchsorted(times_ns, end, side="right")) - 1
        if left <= right:
            out.append((left, right))
    return out


def sweep_scores(n: int, wins: list[tuple[int, int]], profile: dict[str, float]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-reading sweep score and window id (-1 outside windows), as NAB's calcSweepScore."""
    tp, fp = profile["tpWeight"], profile["fpWeight"]
    max_tp = float(scaled_sigmoid(np.array(-1.0)))
    idx = np.arange(n)
    score = np.empty(n)
    win_id = np.full(n, -1, dtype=np.int64)
    # Outside windows: distance past the previous window's right edge (3.0 before the first).
    pos_past = np.full(n, 3.0)
    for k, (left, right) in enumerate(wins):
        width = float(right - left + 1)
        nxt = wins[k + 1][0] if k + 1 < len(wins) else n
        after = idx[right + 1:nxt]
        if width > 1:
            pos_past[right + 1:nxt] = np.abs(right - after) / (width - 1.0)
        else:  # NAB would divide by zero; treat as far past
            pos_past[right + 1:nxt] = 3.0
    score[:] = fp * scaled_sigmoid(pos_past)
    for k, (left, right) in enumerate(wins):
        width = float(right - left + 1)
        i = idx[left:right + 1]
        pos = -(right - i + 1) / width
        score[left:right + 1] = tp * scaled_sigmoid(pos) / max_tp
        win_id[left:right + 1] = k
    return score, win_id


def score_series(times_ns: np.ndarray, flags: np.ndarray,
                 windows: list[tuple[np.int64, np.int64]],
                 profile: dict[str, float] | None = None,
                 probation_percent: float = PROBATION_PERCENT) -> SeriesScore:
    """NAB raw score of one series' binary detections (see module docstring)."""
    profile = profile or PROFILES["standard"]
    times_ns = np.asarray(times_ns, dtype=np.int64)
    flags = np.asarray(flags, dtype=bool)
    n = len(times_ns)
    if len(flags) != n:
        raise ValueError(f"{len(flags)} flags for {n} readings")
    wins = window_indexes(times_ns, windows)
    sweep, win_id = sweep_scores(n, wins, profile)
    scorable = np.arange(n) >= probationary_length(n, probation_percent)
    det = flags & scorable
    raw = 0.0
    n_scored = detected = 0
    for k in range(len(wins)):
        in_k = (win_id == k)
        if not (in_k & scorable).any():
            continue  # window entirely in the probationary period: not scored (as NAB)
        n_scored += 1
        hits = in_k & det
        if hits.any():
            detected += 1
            raw += max(float(sweep[hits].max()), -profile["fnWeight"])
        else:
            raw -= profile["fnWeight"]
    fp_mask = det & (win_id < 0)
    raw += float(sweep[fp_mask].sum())
    return SeriesScore(raw=raw, null=-profile["fnWeight"] * n_scored,
                       perfect=profile["tpWeight"] * n_scored, windows=n_scored,
                       detected=detected, false_positives=int(fp_mask.sum()),
                       detections=int(det.sum()))


def corpus_score(scores: list[SeriesScore]) -> float:
    """NAB's normalised corpus score: 100 * (sum raw - sum null) / (sum perfect - sum null)."""
    raw = sum(s.raw for s in scores)
    null = sum(s.null for s in scores)
    perfect = sum(s.perfect for s in scores)
    if perfect == null:
        raise ValueError("no scorable anomaly window in the corpus")
    return 100.0 * (raw - null) / (perfect - null)
