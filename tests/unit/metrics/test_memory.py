"""A call's peak memory on an emulated device (``rayhf.metrics.memory``): the process's peak
resident set since the reset, so a large tensor made after it shows, and one made before a
later reset does not."""

from __future__ import annotations

import torch

from rayhf.metrics.memory import peak_bytes, reset_peak

CPU = torch.device("cpu")


def test_the_peak_counts_what_was_held_since_the_reset():
    reset_peak(CPU)
    quiet = peak_bytes(CPU)
    big = torch.ones(64 * 2**20)  # 256 MiB, written so its pages are resident
    held = peak_bytes(CPU)
    del big
    reset_peak(CPU)
    after = peak_bytes(CPU)
    assert held >= quiet + 250 * 2**20
    assert after < held - 200 * 2**20, "the reset forgets the earlier peak"
