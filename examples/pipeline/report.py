"""The pipeline's learning figures, read from the run directories the stages wrote.

python examples/pipeline/report.py [runs/pipeline]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def last_with(metrics: list[dict], key: str) -> float:
    return [m[key] for m in metrics if key in m][-1]


def main(root: Path) -> None:
    sft, rm, ppo = rows(root / "sft"), rows(root / "rm"), rows(root / "ppo")
    nll = (sft[0]["eval/nll"], last_with(sft, "eval/nll"))
    print(f"SFT held-out response nll: {nll[0]:.3f} -> {nll[1]:.3f}")
    print(
        f"reward model held-out pairwise accuracy: {rm[0]['eval/accuracy']:.3f} -> "
        f"{last_with(rm, 'eval/accuracy'):.3f}"
    )
    true = [m["batch/task_scores"] for m in ppo if "batch/task_scores" in m]
    first, last = true[:5], true[-5:]
    se = (statistics.variance(first) / 5 + statistics.variance(last) / 5) ** 0.5
    gain = statistics.mean(last) - statistics.mean(first)
    print(
        f"PPO true task score (mean of first / last 5 steps): {statistics.mean(first):.3f} -> "
        f"{statistics.mean(last):.3f} (gain {gain:+.3f}, {gain / se:.1f} standard errors)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/pipeline"))
