"""The profiler's fits ignore measurements slowed down by other processes."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.agent.engine.profile.fit import (fit_overhead, fit_overhead_with_prefill,
                                                 lower_envelope)


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


def test_prefill_tokens_get_their_own_term_and_leave_the_per_sequence_slope_alone():
    # Decode steps cost 1.4 + 0.05 per sequence; steps with a prefill chunk also 0.005 ms per
    # prefill token, and those come in larger batches: the two-term fit tilts its slope.
    sequences = [1, 2, 4, 8, 12, 16, 24, 32] + [4, 8, 12, 16, 20, 24, 28, 32]
    tokens = [0] * 8 + [100, 300, 200, 500, 400, 700, 600, 800]
    residuals = [1.4 + 0.05 * n + 0.005 * p for n, p in zip(sequences, tokens)]
    residuals[5] += 30.0  # one step slowed by another process
    fixed, per_sequence, per_token = fit_overhead_with_prefill(sequences, tokens, residuals)
    assert fixed == pytest.approx(1.4, abs=0.05)
    assert per_sequence == pytest.approx(0.05, abs=0.005)
    assert per_token == pytest.approx(0.005, abs=0.0005)
    assert fit_overhead(sequences, residuals)[1] > 0.06
    # No prefill tokens to tell apart: the two-term fit.
    assert fit_overhead_with_prefill([1, 2, 3], [0, 0, 0], [1.0, 2.0, 3.0]) == \
        (*fit_overhead([1, 2, 3], [1.0, 2.0, 3.0]), 0.0)


def test_lower_envelope_drops_a_slowed_grid_point_of_a_linear_op():
    # 2 tokens was measured during a burst of interference: 12 ms instead of ~0.01 ms.
    rows = np.array([(1, 0.007), (2, 12.0), (4, 0.009), (8, 0.011), (16, 0.02)])
    ms = lower_envelope(rows)[:, 1]
    assert ms.tolist() == pytest.approx([0.007, 0.009, 0.009, 0.011, 0.02])


def test_lower_envelope_keeps_a_growing_table_and_its_row_order():
    rows = np.array([(16, 0.4), (1, 0.1), (4, 0.2)])
    assert np.array_equal(lower_envelope(rows), rows)


def test_lower_envelope_on_a_two_key_grid_uses_every_larger_point():
    kv, chunks = (0, 256, 512), (32, 64)
    rows = np.array([(k, c, 1.0 + k / 256 + c / 32) for k in kv for c in chunks])
    rows[1, 2] = 50.0  # (0, 64) slowed down; (256, 64) = 4.0 bounds it
    rows[4, 2] = 40.0  # (512, 32) slowed down; (512, 64) = 5.0 bounds it
    envelope = lower_envelope(rows)
    assert envelope[1, 2] == pytest.approx(4.0)
    assert envelope[4, 2] == pytest.approx(5.0)
    untouched = [0, 2, 3, 5]
    assert np.array_equal(envelope[untouched], rows[untouched])
