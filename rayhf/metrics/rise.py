"""How far a metric rose over a run: the mean of its last window of steps minus that of its
first, in standard errors of that difference (the two windows taken as independent samples).
Every learning claim in ``docs/`` and the example tests reads it so."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Rise:
    first: float  # mean over the first window
    last: float  # mean over the last window
    se: float  # standard error of last - first

    @property
    def gain(self) -> float:
        return self.last - self.first

    @property
    def in_se(self) -> float:
        """The gain in standard errors (infinite for a gain over windows that do not vary)."""
        if self.se == 0:
            return 0.0 if self.gain == 0 else math.copysign(math.inf, self.gain)
        return self.gain / self.se

    def __str__(self) -> str:
        return (
            f"{self.first:.3f} -> {self.last:.3f} "
            f"({self.gain:+.3f}, {self.in_se:.1f} standard errors)"
        )


def rise(values: list[float], k: int = 10) -> Rise:
    """The rise from the first ``k`` values to the last ``k`` (at least 2 each)."""
    first, last = values[:k], values[-k:]
    se = math.sqrt(statistics.variance(first) / k + statistics.variance(last) / k)
    return Rise(statistics.mean(first), statistics.mean(last), se)
