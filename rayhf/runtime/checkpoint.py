"""Checkpoints: one directory per step, written under a temporary name and renamed when whole.

``checkpoints/step_000010/`` holds each trainable role's model in Hugging Face format (a
language model under ``{role}/`` loads with ``AutoModelForCausalLM``), ``optim/{role}.rank{r}.pt``
(each rank's optimizer shard and interface state), and ``state.json`` (step, dataset cursor).
A directory without ``state.json``, or with a ``.tmp`` name, is never read: a run killed
mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def write_checkpoint(
    run_dir: Path, step: int, fill: Callable[[Path], None], state: dict[str, Any]
) -> Path:
    """``fill(tmp_dir)`` writes the files; then ``state.json``; then the atomic rename."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "optim").mkdir(parents=True)
    fill(tmp)
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())
