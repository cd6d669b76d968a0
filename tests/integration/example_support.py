"""What the example tests share: an example's SFT stage (Ray Train) then its RL stage, both in a
temporary directory on the session's cluster, and how far a reward rose."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import REPO

import rayhf
from rayhf.metrics.rise import rise
from rayhf.runtime.train_stage import run_train_stage
from rayhf.runtime.trainer import run

QUIET = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}


def sft_then_rl(
    address: str, tmp_path: Path, stages: tuple[str, str],
    build_tokenizer: Callable[[Path], Any], rl: dict[str, Any],
) -> list[dict[str, Any]]:  # fmt: skip
    """The SFT stage ``examples/<stages[0]>`` on a tokenizer ``build_tokenizer`` writes, then
    the RL stage ``examples/<stages[1]>`` from its policy; the RL stage's metrics."""
    build_tokenizer(tmp_path / "tokenizer")
    common = {"cluster.address": address, **QUIET}
    first = rayhf.load_config(REPO / "examples" / stages[0]).with_overrides(
        {
            **common,
            "run_dir": str(tmp_path / "sft"),
            "tokenizer.path": str(tmp_path / "tokenizer"),
            "dataset.path": str(tmp_path / "sft.parquet"),
        }
    )
    policy = run_train_stage(first).policy_checkpoint
    assert policy is not None and (policy / "tokenizer_config.json").is_file()
    second = rayhf.load_config(REPO / "examples" / stages[1]).with_overrides(
        {**common, "run_dir": str(tmp_path / "rl"), "models.actor.path": str(policy), **rl}
    )
    return run(second).metrics


def gain(rewards: list[float], n: int = 10) -> tuple[float, float, str]:
    """The mean of the last ``n`` minus that of the first ``n``, its standard error, and both
    means and the gain in standard errors as text for an assertion's message."""
    up = rise(rewards, n)
    return up.gain, up.se, f"{up.first:.3f} -> {up.last:.3f}: {up.in_se:.1f} SE"
