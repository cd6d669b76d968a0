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


def llama_trainer(groups: Any, vocab: int, **shape: int) -> Any:
    """One rank's engine (``standalone_engine``, AdamW at lr 1e-5, fp32) over a seeded Llama of
    ``shape`` (``ModelInit`` fields: hidden_size, n_layers, n_heads, ...) and ``vocab`` tokens,
    on ``groups``."""
    from rayhf.checks.common import Tok
    from rayhf.engines.build import standalone_engine
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.models.hf import build_model, hf_config
    from rayhf.models.init import ModelInit

    hf = build_model(hf_config(ModelInit(family="llama", **shape), vocab, 0, 1, 2), False, seed=0)
    return standalone_engine(hf, Tok(), False, OptimizerConfig(lr=1e-5), groups)


def next_token_step(engine: Any, lengths: list[int], vocab: int, gen: Any) -> Callable[[], None]:
    """One optimizer step of ``engine`` on random rows of ``lengths`` tokens (ids drawn by the
    torch generator ``gen``), the loss the mean next-token log-prob through ``score``, as a
    train call's ``TorchTrainer.train`` runs it."""
    import torch

    from rayhf.data.batch import PackedBatch

    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=gen)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    targets = torch.where(mask[:, 1:].bool(), ids[:, 1:], -1)
    targets = torch.cat([targets, torch.full((len(lengths), 1), -1)], dim=1)
    rows = PackedBatch(list(range(len(lengths))))

    def loss_fn(_: PackedBatch) -> tuple[Any, dict[str, float]]:
        scored = engine.score(ids, mask, targets)[..., 0]
        return -scored.sum() / (targets >= 0).sum(), {}

    return lambda: engine.train([rows], loss_fn)
