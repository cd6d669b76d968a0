"""Checkpoints: one directory per step, written under a temporary name and renamed when whole.

``checkpoints/step_000010/`` holds each trainable role's model in Hugging Face format (a
language model under ``{role}/`` loads with ``AutoModelForCausalLM``), ``optim/{role}.rank{r}.pt``
(each rank's optimizer shard and interface state), ``state.json`` (step, dataset cursor) and
``manifest.json`` (every other file's size and SHA-256). A directory without ``state.json``, or
with a ``.tmp`` name, is never read: a run killed mid-save resumes from the previous checkpoint.
One whose files do not match its manifest (truncated, corrupted) is skipped, in one line, for
the previous one (``usable_checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
_CHUNK = 8 * 2**20
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
    (tmp / MANIFEST_FILE).write_text(json.dumps({"files": manifest(tmp)}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def manifest(ckpt: Path) -> dict[str, dict[str, Any]]:
    """Relative path -> {size, sha256} of every file but the manifest (hashed on threads:
    hashlib releases the GIL, so large checkpoints hash at the disk's pace)."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        sums = list(pool.map(_sha256, files))
    return {
        str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": h}
        for p, h in zip(files, sums, strict=True)
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def damage(ckpt: Path) -> str | None:
    """What is wrong with a checkpoint's files against its manifest; None if they match (or it
    predates manifests)."""
    path = ckpt / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        expected = json.loads(path.read_text())["files"]
    except (ValueError, KeyError):
        return f"{MANIFEST_FILE} is unreadable"
    for rel, want in sorted(expected.items()):
        p = ckpt / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["size"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['size']}"
    for rel, want in sorted(expected.items()):
        if _sha256(ckpt / rel) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def usable_checkpoint(run_dir: Path, report: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; each damaged newer one
    is skipped with one line to ``report``."""
    ckpts = list_checkpoints(run_dir)
    for i in range(len(ckpts) - 1, -1, -1):
        problem = damage(ckpts[i])
        if problem is None:
            return ckpts[i]
        instead = f"using {ckpts[i - 1].name}" if i else "no earlier checkpoint: starting over"
        report(f"checkpoint {ckpts[i].name} is damaged ({problem}); {instead}")
    return None
