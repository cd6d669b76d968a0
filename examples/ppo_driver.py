"""A driver script on rayhf's Python API, the way Ray users submit jobs.

    python examples/ppo_driver.py steps=5
    ray job submit --working-dir . -- python examples/ppo_driver.py cluster.address=auto

Loads the tiny PPO config, changes fields in code, prints the plan, runs, and reports the
metrics and the checkpoint paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import rayhf

EXAMPLE = Path(__file__).with_name("ppo_tiny.yaml")


def main(overrides: list[str]) -> int:
    cfg = rayhf.load_config(EXAMPLE, overrides)
    cfg = cfg.with_overrides({"name": f"{cfg.name}_driver", "metrics.console": False})
    plan = rayhf.make_plan(cfg)
    print(rayhf.format_plan(plan, rayhf.load_graph(cfg.graph_path())))
    result = rayhf.run(cfg)
    first, last = result.metrics[0], result.metrics[-1]
    print(f"steps: {len(result.metrics)}")
    print(f"task reward: {first['task_reward']:.3f} -> {last['task_reward']:.3f}")
    print(f"checkpoints: {[str(p) for p in result.checkpoints]}")
    print(f"{result.policy} (Hugging Face format): {result.policy_checkpoint}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except rayhf.RayhfError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
