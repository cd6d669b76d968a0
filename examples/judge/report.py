"""The judge example's figures, read from the run directories its stages wrote: the judge's
scores of held-out answers and of degenerate ones beside the true reward, then the GRPO run's
true task reward (``batch/task_scores``) beside the judge's (``task_reward``).

python examples/judge/report.py [runs/judge]
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from rayhf.metrics.rise import rise
from rayhf.metrics.tracker import read_metrics
from rayhf.runtime.checkpoint import latest_checkpoint

GRPO_CONFIG = Path(__file__).parent / "grpo.yaml"
WINDOW = 10  # steps averaged at each end, as docs/benchmarks/algorithms_demo.md does


def last_checkpoint(run_dir: Path, role: str) -> Path:
    found = latest_checkpoint(run_dir)
    assert found is not None, f"{run_dir} holds no checkpoint"
    return found / role


Scorer = Callable[[list[str], list[str]], list[float | None]]


def load_judge(judge: Path) -> Scorer:
    """The judge's verdicts of (prompts, answers), read as the run reads them (grpo.yaml's
    ``judge:``, greedy); the model is loaded once."""
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayhf.algorithms.judge import JudgeConfig, parse_verdict, render_prompt
    from rayhf.sampling import GenerationConfig, generate

    cfg = JudgeConfig(**yaml.safe_load(GRPO_CONFIG.read_text())["judge"])
    assert cfg.template is not None, f"{GRPO_CONFIG}: judge.template"
    tok = AutoTokenizer.from_pretrained(judge, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(judge, local_files_only=True)
    gen = GenerationConfig(greedy=True, max_new_tokens=cfg.max_new_tokens)

    def scores(prompts: list[str], answers: list[str]) -> list[float | None]:
        texts = [
            render_prompt(cfg.template, p, a, {}) for p, a in zip(prompts, answers, strict=True)
        ]
        asks = [[tok.bos_token_id, *tok.encode(t, add_special_tokens=False)] for t in texts]
        out = generate(model, asks, gen, tok.eos_token_id, tok.pad_token_id, 0)
        return [
            parse_verdict(t, cfg) for t in tok.batch_decode(out.tokens, skip_special_tokens=True)
        ]

    return scores


def agreement(name: str, judge: Scorer, prompts: list[str], answers: list[str]) -> None:
    """How the judge's scores of ``answers`` agree with what it was taught and the reward."""
    from rayhf.tasks.demo import reward
    from rayhf.tasks.echo_judge import places_right

    got = judge(prompts, answers)
    read = [i for i, g in enumerate(got) if g is not None]
    judged = [got[i] for i in read]
    print(f"judge on {len(prompts)} held-out {name}: {len(read)} verdicts read")
    taught = [places_right(p, a) for p, a in zip(prompts, answers, strict=True)]
    for against, values in (("taught", taught), ("true", reward(prompts, answers))):
        ref = [values[i] for i in read]
        err = statistics.mean(abs(g - t) for g, t in zip(judged, ref, strict=True))
        corr = statistics.correlation(judged, ref)
        print(f"  mean |judge - {against}| {err:.3f}, correlation {corr:.3f}")


def judge_figures(path: Path, policy: Path, n: int = 512) -> None:
    from rayhf.tasks.demo import echo, make_prompts, policy_answers, reward
    from rayhf.tasks.echo_judge import DEGENERATE, judged_answer, places_right

    judge = load_judge(path)
    prompts = [r["prompt"] for r in make_prompts(n, seed=20_011)]  # no training or eval prompt
    rng = random.Random("report")
    agreement("synthetic answers", judge, prompts, [judged_answer(p, rng) for p in prompts])
    sampled = [a for (a,) in policy_answers(policy, prompts, seed=20_011)]
    agreement("answers of the GRPO start policy", judge, prompts, sampled)
    print("| answer | judge's score | taught score | true reward |\n| --- | ---: | ---: | ---: |")
    kinds = {"the echo": echo, **DEGENERATE}
    for name, make in kinds.items():
        texts = [make(p) for p in prompts[:64]]
        scores = judge(prompts[:64], texts)
        judged = statistics.mean(0.0 if s is None else s for s in scores)
        pairs = zip(prompts[:64], texts, strict=True)
        taught = statistics.mean(places_right(p, t) for p, t in pairs)
        true_mean = statistics.mean(reward(prompts[:64], texts))
        print(f"| {name} | {judged:.3f} | {taught:.3f} | {true_mean:.3f} |")


def main(root: Path) -> None:
    sft = read_metrics(root / "sft")
    nll = [m["eval/nll"] for m in sft if "eval/nll" in m]
    print(f"judge SFT held-out nll: {nll[0]:.3f} -> {nll[-1]:.3f}")
    judge_figures(last_checkpoint(root / "sft", "actor"), last_checkpoint(root / "policy", "actor"))
    grpo = read_metrics(root / "grpo")
    true = [m["batch/task_scores"] for m in grpo if "batch/task_scores" in m]
    judged = [m["task_reward"] for m in grpo if "task_reward" in m]
    missed = [m["batch/verdict_unparsable"] for m in grpo if "batch/verdict_unparsable" in m]
    steps = f"first / last {WINDOW} of {len(true)} steps"
    print(f"GRPO true task reward, {steps}: {rise(true, WINDOW)}")
    print(f"GRPO judge's reward, same steps: {rise(judged, WINDOW)}")
    print(f"unparsable verdicts: {statistics.mean(missed):.4f} of all, {max(missed):.4f} at most")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/judge"))
