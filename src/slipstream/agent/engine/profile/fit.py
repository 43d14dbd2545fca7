"""Robust fits for the profiler: measured times on a shared machine, where other processes
only ever add time.

    profiler grid points --lower_envelope()--> tables that grow with every key
    calibration residuals --fit_overhead()--> a + b * sequences (host overhead)
                          --fit_overhead_with_prefill()--> + c * prefill tokens (runner's)

Pure numpy, so the fits are unit-tested without torch.
"""

from __future__ import annotations

import numpy as np


def fit_overhead(sequences: list[int], residuals_ms: list[float]) -> tuple[float, float]:
    """Fit ``residual = fixed + per_sequence * sequences``, both kept >= 0.

    Least absolute deviations (iteratively reweighted least squares): a batch slowed down by
    another process is an outlier that only ever adds time, and must not drag the line up.
    """
    x = np.asarray(sequences, dtype=float)
    y = np.asarray(residuals_ms, dtype=float)
    design = np.column_stack([np.ones_like(x), x])
    weights = np.ones_like(y)
    for _ in range(30):
        root = np.sqrt(weights)
        (fixed, per_sequence), *_ = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)
        weights = 1.0 / np.maximum(np.abs(y - fixed - per_sequence * x), 1e-3)
    if per_sequence < 0:
        return max(0.0, float(np.median(y))), 0.0
    if fixed < 0:
        return 0.0, max(0.0, float(np.median(y / np.maximum(x, 1.0))))
    return float(fixed), float(per_sequence)


def fit_overhead_with_prefill(sequences: list[int], prefill_tokens: list[int],
                              residuals_ms: list[float]) -> tuple[float, float, float]:
    """Fit ``residual = fixed + per_sequence * sequences + per_token * prefill_tokens`` by
    least absolute deviations, all three >= 0. Without the prefill term, steps with long
    chunks, whose residual grows with their tokens, tilt the per-sequence slope: a batch of
    decodes is then charged for prefill work it does not do. Where a term would come out
    negative, or the prefill tokens do not vary, it is the two-term fit with ``per_token`` 0."""
    x = np.asarray(sequences, dtype=float)
    tokens = np.asarray(prefill_tokens, dtype=float)
    y = np.asarray(residuals_ms, dtype=float)
    if np.ptp(tokens) > 0:
        fixed, per_sequence, per_token = _least_absolute(
            np.column_stack([np.ones_like(x), x, tokens]), y)
        if min(fixed, per_sequence, per_token) >= 0:
            return float(fixed), float(per_sequence), float(per_token)
    return (*fit_overhead(sequences, residuals_ms), 0.0)


def _least_absolute(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Iteratively reweighted least squares towards the least absolute deviations."""
    weights = np.ones_like(y)
    for _ in range(30):
        root = np.sqrt(weights)
        coefficients, *_ = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)
        weights = 1.0 / np.maximum(np.abs(y - design @ coefficients), 1e-3)
    return coefficients


def lower_envelope(rows: np.ndarray) -> np.ndarray:
    """Make measured times non-decreasing in every key by taking, at each grid point, the
    fastest time at any point with keys at least as large.

    Op time only grows with tokens (and KV), so a point slower than a larger one was slowed
    down by another process: on a shared machine a whole burst of repeats can be, and the
    predictor's running maximum would carry that spike to every larger point.
    """
    rows = np.array(rows, dtype=np.float64)
    if rows.shape[1] == 2:
        order = np.argsort(rows[:, 0])
        rows[order, 1] = np.minimum.accumulate(rows[order, 1][::-1])[::-1]
        return rows
    xs, ys = np.unique(rows[:, 0]), np.unique(rows[:, 1])
    grid = np.full((len(xs), len(ys)), np.inf)
    i, j = np.searchsorted(xs, rows[:, 0]), np.searchsorted(ys, rows[:, 1])
    grid[i, j] = rows[:, 2]
    grid = np.minimum.accumulate(grid[::-1, :], axis=0)[::-1, :]
    grid = np.minimum.accumulate(grid[:, ::-1], axis=1)[:, ::-1]
    rows[:, 2] = grid[i, j]
    return rows
