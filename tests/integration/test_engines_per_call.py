"""Each call runs on the engine its own ``engines:`` entry names: in ReMax, the sampled
``actor_gen`` on vLLM and the greedy ``actor_greedy_gen`` of the same role on the native
generator (the trace records the backend every call ran on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import needs_vllm
from trace_support import assert_trace_is_priced

import rayhf
from rayhf.metrics.trace import TRACE_FILE, read_trace
from rayhf.runtime.assets import prepare_run

REPO = Path(__file__).resolve().parents[2]


def _call_engines(run_dir: Path) -> dict[str, set[str]]:
    """Call name -> the engines the trace shows it ran on."""
    out: dict[str, set[str]] = {}
    for event in read_trace(run_dir / TRACE_FILE):
        if event.get("cat") == "call":
            out.setdefault(event["name"], set()).add(event["args"]["engine"])
    return out


@needs_vllm
@pytest.mark.ray
def test_remax_runs_each_generate_call_on_its_own_engine(ray_cluster, tmp_path):
    from conftest import tiny_overrides

    ov = tiny_overrides(tmp_path / "run", steps=2, save_every=0)
    ov.update({
        "engines": {"actor_gen": {"engine": "vllm"}},
        "models.actor.init.n_heads": 2, "models.actor.init.n_kv_heads": 1,  # vLLM: head_dim 32
    })  # fmt: skip
    cfg = rayhf.load_config(REPO / "examples" / "remax_tiny.yaml").with_overrides(ov)
    result = rayhf.run(cfg)
    engines = _call_engines(result.run_dir)
    assert engines["actor_gen"] == {"vllm"}
    assert engines["actor_greedy_gen"] == {"native"}, "only actor_gen asked for vLLM"
    assert engines["actor_train"] == {"torch"} and engines["ref_inf"] == {"torch"}
    assert engines["rew_inf"] == {"function"}
    trained = [m for m in result.metrics if m["step"] > 0]
    assert trained and all("greedy_reward" in m for m in trained)
    # the units the planner prices are those run, with vLLM's own layout copy
    assert_trace_is_priced(cfg, prepare_run(cfg, result.run_dir))
