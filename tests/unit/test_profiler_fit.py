"""The profiler's overhead fit ignores batches slowed down by other processes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from slipstream.agent.engine.profiler import fit_overhead, monotone_envelope  # noqa: E402


def test_fit_recovers_the_line_despite_slowed_outliers():
    sequences = [1, 2, 4, 6, 8, 10, 12, 16, 20, 24] * 2
    residuals = [0.8 + 0.3 * n for n in sequences]
    residuals[3] += 40.0  # two batches hit by interference
    residuals[15] += 25.0
    fixed, per_sequence = fit_overhead(sequences, residuals)
    assert fixed == pytest.approx(0.8, abs=0.05)
    assert per_sequence == pytest.approx(0.3, abs=0.01)


def test_fit_never_goes_negative():
    assert fit_overhead([1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0]) == (3.5, 0.0)
    fixed, per_sequence = fit_overhead([1, 2, 3, 4], [0.5, 1.5, 2.5, 3.5])
    assert fixed == 0.0 and per_sequence > 0


def test_monotone_envelope_clips_points_above_a_larger_shape():
    linear = np.array([[1, 0.01], [2, 40.0], [8, 0.02], [2048, 0.3], [1024, 11.0]])
    clipped = monotone_envelope(linear)
    assert dict(zip(clipped[:, 0], clipped[:, 1])) == {1: 0.01, 2: 0.02, 8: 0.02, 1024: 0.3,
                                                      2048: 0.3}
    grid = np.array([[0, 32, 0.03], [0, 64, 5.0], [512, 32, 0.2], [512, 64, 0.4]])
    clipped = monotone_envelope(grid)
    assert clipped[1, 2] == 0.4  # (0, 64) may cost no more than (512, 64)
    assert np.array_equal(clipped[[0, 2, 3], 2], grid[[0, 2, 3], 2])  # honest points kept
