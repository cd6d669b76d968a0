"""The rise of a metric over a run (``rayhf.metrics.rise``), on hand-computed windows."""

from __future__ import annotations

import math

import pytest

from rayhf.metrics.rise import rise


def test_the_rise_is_last_minus_first_over_the_standard_error_of_the_difference():
    # first window 0, 1 (mean 0.5, variance 0.5), last 2, 4 (mean 3, variance 2)
    up = rise([0.0, 1.0, 9.0, 2.0, 4.0], k=2)
    assert (up.first, up.last, up.gain) == (0.5, 3.0, 2.5)
    assert up.se == pytest.approx(math.sqrt(0.5 / 2 + 2 / 2))
    assert up.in_se == pytest.approx(2.5 / math.sqrt(1.25))
    assert str(up) == "0.500 -> 3.000 (+2.500, 2.2 standard errors)"


def test_windows_that_do_not_vary():
    assert rise([1.0, 1.0, 1.0, 1.0], k=2).in_se == 0.0
    assert rise([0.0, 0.0, 1.0, 1.0], k=2).in_se == math.inf
