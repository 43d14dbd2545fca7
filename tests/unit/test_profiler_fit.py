"""The profiler's overhead fit ignores batches slowed down by other processes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from slipstream.agent.engine.profiler import fit_overhead  # noqa: E402


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
