"""The pipeline's learning figures, read from the run directories the stages wrote, and the
task score (the digit share the preference pairs were labelled by, `rayhf.tasks.demo.digit_share`)
of the SFT and the PPO policy on held-out prompts (no PPO prompt among them).

python examples/pipeline/report.py [runs/pipeline]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from rayhf.metrics.rise import rise
from rayhf.metrics.tracker import read_metrics
from rayhf.runtime.checkpoint import latest_checkpoint

WINDOW = 20  # steps averaged at each end: a step's batch of 32 answers is noisy


def last_with(metrics: list[dict], key: str) -> float:
    return [m[key] for m in metrics if key in m][-1]


def held_out_score(policy: Path, greedy: bool, n: int = 512) -> float:
    """Mean task score of ``policy``'s answers to ``n`` held-out prompts (the score of the text,
    as the PPO run logs it)."""
    from rayhf.tasks.demo import digit_share_reward, make_prompts, policy_answers

    prompts = [r["prompt"] for r in make_prompts(n, seed=10_007)]
    answers = [a[0] for a in policy_answers(policy, prompts, greedy=greedy)]
    return statistics.mean(digit_share_reward(prompts, answers))


def last_checkpoint(run_dir: Path, role: str) -> Path:
    found = latest_checkpoint(run_dir)
    assert found is not None, f"{run_dir} holds no checkpoint"
    return found / role


def main(root: Path) -> None:
    sft, rm, ppo = read_metrics(root / "sft"), read_metrics(root / "rm"), read_metrics(root / "ppo")
    nll = (sft[0]["eval/nll"], last_with(sft, "eval/nll"))
    print(f"SFT held-out response nll: {nll[0]:.3f} -> {nll[1]:.3f}")
    print(
        f"reward model held-out pairwise accuracy: {rm[0]['eval/accuracy']:.3f} -> "
        f"{last_with(rm, 'eval/accuracy'):.3f}"
    )
    true = [m["batch/task_scores"] for m in ppo if "batch/task_scores" in m]
    learned = [m["task_reward"] for m in ppo if "task_reward" in m]
    k, up = WINDOW, rise(true, WINDOW)
    print(
        f"PPO true task score (mean of first / last {k} of {len(true)} steps): "
        f"{up.first:.3f} -> {up.last:.3f} (gain {up.gain:+.3f}, {up.in_se:.1f} standard errors)"
    )
    print(
        f"PPO learned reward (same steps): {statistics.mean(learned[:k]):.3f} -> "
        f"{statistics.mean(learned[-k:]):.3f}"
    )
    sft_policy, ppo_policy = (
        last_checkpoint(root / "sft", "actor"),
        last_checkpoint(root / "ppo", "actor"),
    )
    for greedy in (False, True):
        how = "greedy" if greedy else "sampled"
        print(
            f"held-out task score, {how}: SFT {held_out_score(sft_policy, greedy):.3f} -> "
            f"PPO {held_out_score(ppo_policy, greedy):.3f}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/pipeline"))
