"""Measuring a model for the planner's profiled cost model (the execution side of profiling).

model config -> at depth 1 and 2 layers (a hybrid's: one and two periods of its layer kinds), a
one-rank engine (``standalone_engine``) times its
forward, train step and generation over the planner's grids (fastest of ``REPEATS``)
-> ``rayhf.planner.profile.fit_profile`` -> cached as JSON per (shape, threads, torch)
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rayhf.data.batch import PackedBatch
from rayhf.engines.build import standalone_engine
from rayhf.engines.call import CallEngine
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.models.families import FAMILIES
from rayhf.models.hf import build_model
from rayhf.models.spec import ModelSpec, model_spec
from rayhf.planner.profile import (
    GEN_GRID,
    GPU_GEN_GRID,
    GPU_GRID,
    GRID,
    OPS,
    ModelProfile,
    Timing,
    fit_profile,
    profile_key,
)
from rayhf.sampling import GenerationConfig

REPEATS = 3  # the fastest of these is kept (the others carry noise from the rest of the machine)


def profile_cache() -> Path:
    """Where measured model profiles are kept (``RAYHF_CACHE_DIR`` overrides)."""
    root = os.environ.get("RAYHF_CACHE_DIR") or Path.home() / ".cache" / "rayhf"
    return Path(root) / "profiles"


def profile_model(
    config: Any, value_head: bool, threads: int, cache: Path | None = None, device: str = "cpu"
) -> ModelProfile:
    """The fitted profile of ``config``'s model shape (from ``cache`` when it is there), timed
    on ``device``: ``cpu`` with ``threads`` threads, or ``cuda`` (GPU 0, bf16 as a run's
    ``precision: auto`` gives there, over ``GPU_GRID``)."""
    spec = model_spec(config, value_head)
    cuda = device == "cuda"
    key = profile_key(
        spec, threads, torch.__version__, torch.cuda.get_device_name(0) if cuda else "cpu"
    )
    path = cache / f"{key}.json" if cache is not None else None
    if path is not None and path.exists():
        return ModelProfile.from_json(path.read_text())
    if not cuda:
        torch.set_num_threads(threads)
    grid, gen_grid = (GPU_GRID, GPU_GEN_GRID) if cuda else (GRID, GEN_GRID)
    timings: dict[str, list[Timing]] = {op: [] for op in OPS}
    period = _period(config)
    for depth in (period, 2 * period):
        engine = _engine(_with_depth(config, depth), value_head, device)
        for op in OPS:
            if op == "generate" and value_head:
                continue
            points = gen_grid if op == "generate" else grid
            _time_op(engine, op, points[0], spec.vocab_size)  # warm-up
            for pt in points:
                timings[op].append((depth, pt, _time_op(engine, op, pt, spec.vocab_size)))
    prof = fit_profile(key, threads, timings)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.to_json())
    return prof


def profiles_for(
    configs: dict[str, tuple[Any, bool]], threads: int, device: str = "cpu"
) -> tuple[dict[str, ModelSpec], dict[ModelSpec, ModelProfile]]:
    """Every role's spec and its shape's profile (cached); ``configs``: role -> (Hugging Face
    config, value head)."""
    specs, profiles = {}, {}
    for role, (config, value_head) in configs.items():
        specs[role] = model_spec(config, value_head)
        key = dataclasses.replace(specs[role], n_layers=0)
        profiles[key] = profile_model(config, value_head, threads, profile_cache(), device)
    return specs, profiles


def gpu_profiles(
    configs: dict[str, tuple[Any, bool]],
) -> tuple[dict[str, ModelSpec], dict[ModelSpec, ModelProfile], str] | None:
    """``profiles_for`` on this machine's first GPU, in a process of its own (the driver keeps
    no CUDA context for the run), with the GPU's name; None where the driver sees no GPU (a
    Ray cluster whose GPUs are on other nodes)."""
    if not torch.cuda.is_available():
        return None
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_profiles_on_gpu, (configs,))


def _profiles_on_gpu(configs: dict[str, tuple[Any, bool]]):
    specs, profiles = profiles_for(configs, 0, "cuda")
    return specs, profiles, torch.cuda.get_device_name(0)


def _period(config: Any) -> int:
    """How many layers a profile's depth step spans: 1, or for a hybrid (DeltaNet layers beside
    attention, which cost differently) the period of its ``layer_types``, so that one "layer"
    of the fit is the mean of its kinds in the proportion the model has them."""
    types = getattr(config, "layer_types", None)
    if FAMILIES[config.model_type].delta_net is None or not types:
        return 1
    n = len(types)
    return next(p for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n)))


def _with_depth(config: Any, depth: int) -> Any:
    """``config`` with ``depth`` layers; a per-layer list (``layer_types``: Qwen2's, Gemma's)
    gets ``depth`` entries, its pattern repeated, as Hugging Face checks the two agree."""
    fields = config.to_dict()
    fields[FAMILIES[config.model_type].config_names.n_layers] = depth
    if fields.get("layer_types") is not None:
        period, types = _period(config), fields["layer_types"]
        types = types[:period] if period > 1 else types
        fields["layer_types"] = [types[i % len(types)] for i in range(depth)]
    return type(config).from_dict(fields)


def _engine(config: Any, value_head: bool, device: str = "cpu") -> CallEngine:
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    model = build_model(config, value_head)
    precision = "bf16" if device == "cuda" else "fp32"
    return standalone_engine(
        model, tokenizer, value_head, OptimizerConfig(lr=1e-5), device=device, precision=precision
    )


def _best_of(fn: Callable[[], object], cuda: bool) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def _time_op(engine: CallEngine, op: str, point: tuple[int, ...], vocab: int) -> float:
    cuda = engine.model is not None and engine.model.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    if op == "generate":
        b, p, g = point
        ids_list = torch.randint(2, vocab, (b, p), generator=gen).tolist()
        cfg = GenerationConfig(max_new_tokens=g, min_new_tokens=g)
        return _best_of(lambda: engine.generate(ids_list, cfg, seed=0), cuda)
    b, s = point
    ids = torch.randint(2, vocab, (b, s), generator=gen)
    mask = torch.ones_like(ids)
    if op == "forward":
        return _best_of(lambda: torch.no_grad()(engine.forward)(ids, mask), cuda)

    targets = torch.roll(ids, -1, dims=1)  # every position scored, as a train call's responses

    def loss_fn(_mb):  # what a train call computes: values, or log-probs and entropies
        if engine.value_head:
            return engine.forward(ids, mask).pow(2).mean(), {}
        return engine.score(ids, mask, targets).mean(), {}

    batch = PackedBatch(list(range(b)))
    return _best_of(lambda: engine.train([batch], loss_fn), cuda)
