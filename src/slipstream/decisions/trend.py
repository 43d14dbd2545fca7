"""The autoscaler's forecast (``decide_scale``, spec.autoscaling.forecastSeconds): a clear
trend in the replica's summed prefill load, or none. Pure arithmetic on (time, value) points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The forecast (spec.autoscaling.forecastSeconds): a least-squares line through the replica's
# prefill load (summed over the reporting instances: the prefill seconds arriving per second,
# whatever the count) over forecastWindowSeconds. It counts only when it has this many points
# and its slope stands this many standard errors clear of zero. The points come from
# overlapping load windows (30 s windows every 15 s), so they are correlated and the usual
# t of 2 would fire on noise: 4 keeps a flat, noisy load from ever looking like a ramp.
MIN_TREND_POINTS = 6
TREND_T = 4.0
# A line through a step or a spike (flat, then a jump, then flat) has a clear slope too, and
# extrapolating it sizes for a rise that has already ended: a trend counts only when the
# older and the newer half of the window each rise (or each fall) on their own, at no less
# than this share of the whole window's slope. A step shows one flat half for a whole
# half-window; a ramp shows two rising halves. On a ramp that bends over (the top of a day)
# the slope extrapolated is damped towards the newer half's (fit_trend).
MIN_HALF_SLOPE_SHARE = 0.25


@dataclass(frozen=True)
class Trend:
    """A clear trend in the replica's summed prefill load (instance-units of prefill work)."""

    level: float  # the fitted value now
    slope_per_s: float

    def at(self, seconds_ahead: float) -> float:
        return max(0.0, self.level + self.slope_per_s * seconds_ahead)


def _line(points: tuple[tuple[float, float], ...]) -> tuple[float, float, float, float] | None:
    """Least squares: (slope, mean time, mean value, standard error of the slope)."""
    count = len(points)
    mean_t = sum(t for t, _ in points) / count
    mean_v = sum(v for _, v in points) / count
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if sxx <= 0.0:
        return None
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / sxx
    residual = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in points)
    standard_error = math.sqrt(residual / max(1, count - 2) / sxx)
    return slope, mean_t, mean_v, standard_error


def fit_trend(points: tuple[tuple[float, float], ...], now_s: float) -> Trend | None:
    """The least-squares line through ``points``, if its slope is clear of the noise
    (``TREND_T`` standard errors, at least ``MIN_TREND_POINTS`` points) and both halves of
    the window go the same way (``MIN_HALF_SLOPE_SHARE``: a step or a spike is not a trend);
    else None. When the newer half moves more slowly than the whole window, the slope
    extrapolated is damped half-way towards the newer half's (a rise that slows down, as at
    the top of a day, is not carried on at its old pace)."""
    if len(points) < MIN_TREND_POINTS:
        return None
    whole = _line(points)
    if whole is None:
        return None
    slope, mean_t, mean_v, standard_error = whole
    if slope == 0.0 or abs(slope) <= TREND_T * standard_error:
        return None
    half = len(points) // 2
    older, recent = _line(points[:half]), _line(points[len(points) - half:])
    if older is None or recent is None \
            or min(older[0] / slope, recent[0] / slope) < MIN_HALF_SLOPE_SHARE:
        return None
    newer = recent[0]
    level = mean_v + slope * (now_s - mean_t)
    if abs(newer) < abs(slope):
        # Slowing down: carry on at the mean of the two (the newer half alone, over half the
        # points, is too noisy to extrapolate by itself: on a straight ramp it comes out low
        # about half the time).
        slope = (slope + newer) / 2.0
    return Trend(level=level, slope_per_s=slope)
