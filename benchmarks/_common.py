"""What the benchmark scripts share (run from ``benchmarks/``, which is on their path)."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The short hash of the checkout's HEAD: the commit a result was measured on."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()


def described(doc: str | None) -> str:
    """A script's docstring as its page describes it: the paragraphs after the usage line, on
    one line, up to the sentence naming the files it writes."""
    return " ".join((doc or "").split("\n\n", 2)[2].split()).split(" Writes ")[0]


def write_results(
    name: str, text: str, data: object, commit: str | None = None, indent: int | None = 2
) -> None:
    """``docs/benchmarks/<name>.md`` (``text``, ending with the commit it was measured on unless
    it names it already) and ``<name>.json`` (``data``; a dict gets a ``commit`` key)."""
    commit = commit or git_commit()
    out = REPO / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    if commit not in text:
        text = text.rstrip("\n") + f"\n\nMeasured on commit {commit}.\n"
    (out / f"{name}.md").write_text(text)
    if isinstance(data, dict):
        data = {**data, "commit": commit}
    (out / f"{name}.json").write_text(json.dumps(data, indent=indent) + "\n")


def median_seconds(fns: Mapping[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Each call's median seconds over ``reps`` rounds after a warm-up of each; a round times
    every call once, so a slow spell of the machine falls on all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            began = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - began)
    return {k: statistics.median(v) for k, v in times.items()}


def hf_decode(model: Any, prompts: list[list[int]], new: int) -> Callable[[], None]:
    """Hugging Face ``generate`` on ``model``: greedy, exactly ``new`` tokens after each of the
    equal-length ``prompts`` (the reference a benchmark's decode is timed against)."""
    import torch  # only the scripts that time a model load torch

    ids = torch.tensor(prompts, device=model.device)

    def decode() -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0)  # fmt: skip

    return decode


def spawned(fn: Callable[..., None], nprocs: int, *args: Any) -> list[Any]:
    """Each of ``nprocs`` spawned ranks' result, in rank order: ``fn(rank, address, out,
    *args)`` runs in each (one thread; ``address``: a torch.distributed store hosted here) and
    puts its result in ``out[rank]``."""
    import os

    import torch.multiprocessing as mp

    from rayhf.parallel.groups import host_store

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _store, address = host_store()  # open here while the ranks meet through it
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(fn, args=(address, out, *args), nprocs=nprocs, join=True)
        return [out[r] for r in range(nprocs)]
