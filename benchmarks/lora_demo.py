"""LoRA ranks 1 and 8 against full fine-tuning on the demo task, each at its own tuned rate.

    python benchmarks/lora_demo.py [--sft-steps 100] [--steps 120] [--seeds 1 2 3] [--window 10]
        [--hidden 64] [--layers 2] [--ways NAME ...]

GRPO on "echo the digits" (examples/grpo_tiny.yaml: Llama, hidden 64, 2 layers; 16 prompts x 4
samples a step) from the policy that ``--sft-steps`` of examples/sft_tiny.yaml make, as RL starts
from an instruct model: LoRA on a frozen randomly initialised base does not learn this task (at
902f89a every rank stayed at the starting reward). Every learning rate of each way's grid runs on
every seed, and each way is reported at the rate whose mean over the seeds of the final reward (the
mean task reward over the last ``--window`` steps) is highest. LoRA adapts every linear layer of
the decoder layers at alpha 32 for both ranks, as "LoRA without regret" does, so that one rate
suits both ranks; a fourth way trains the LM head in full beside rank-8 adapters (``lora.trains:
[lm_head]``, PEFT's ``modules_to_save``), because with the head frozen both ranks level off after
about 25 steps (at 24343ad's 120-step run) while full fine-tuning keeps rising, and a head trained
in full lifts that level on this tiny model; a fifth adapts the head with rank-8 adapters as well
(``lora.targets`` naming ``lm_head`` beside the decoder's linear layers, as PEFT's
``target_modules`` may; nothing trains in full); a sixth trains every linear layer of the decoder
in full and freezes the rest as LoRA does (the embeddings, the norms, the head; a rank-1 adapter
of ``q_proj`` beside it, as a LoRA config needs one), to tell what the adapters' rank costs from
what the frozen modules cost. A grid whose best rate is at its edge grows past that edge, one step
of the 1-2-5 ladder at a time, until it is not (at most 3 steps). Reported: each rate's final
reward (mean over seeds), the chosen rate's per seed, the trained parameters and seconds per
step; the curves (the chosen rates, mean over the seeds) in docs/benchmarks/lora_demo.png.
``--hidden`` and ``--layers`` give the policy (SFT and GRPO alike) another width and depth, to
see whether what freezing costs shrinks when the decoder has more to adapt; the page is then
``lora_demo_h<hidden>_l<layers>`` (and ``_sft<steps>`` after it, for another ``--sft-steps``).
Writes docs/benchmarks/lora_demo.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
from _common import described, git_commit, write_results

import rayhf
from rayhf.runtime.cluster import connect

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_tiny.yaml"
SFT = REPO / "examples" / "sft_tiny.yaml"
QUIET = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}
ALPHA = 32.0
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WAYS: dict[str, tuple[dict, tuple[float, ...]]] = {  # overrides, learning-rate grid
    "full fine-tuning": ({}, (5e-4, 1e-3, 2e-3)),
    # to 20x full fine-tuning's best rate: "LoRA without regret" finds LoRA's about 10x
    "LoRA rank 8": ({"models.actor.lora.rank": 8, "models.actor.lora.alpha": ALPHA},
                    (1e-3, 2e-3, 5e-3, 1e-2, 2e-2)),
    "LoRA rank 1": ({"models.actor.lora.rank": 1, "models.actor.lora.alpha": ALPHA},
                    (1e-3, 2e-3, 5e-3, 1e-2, 2e-2)),
    "LoRA rank 8, head in full": ({"models.actor.lora.rank": 8, "models.actor.lora.alpha": ALPHA,
                                   "models.actor.lora.trains": ["lm_head"]},
                                  (1e-3, 2e-3, 5e-3)),
    # the head adapted too (PEFT's target_modules naming "lm_head"), where "head in full" trains it
    "LoRA rank 8, head adapted": ({"models.actor.lora.rank": 8, "models.actor.lora.alpha": ALPHA,
                                   "models.actor.lora.targets": [*LINEAR, "lm_head"]},
                                  (5e-4, 1e-3, 2e-3, 5e-3)),
    # no adapter to speak of: what full fine-tuning does with the head, norms and embeddings frozen
    "linear layers in full, the rest frozen": ({"models.actor.lora.rank": 1,
                                                "models.actor.lora.targets": ["q_proj"],
                                                "models.actor.lora.trains": list(LINEAR)},
                                               (5e-4, 1e-3, 2e-3)),
}  # fmt: skip
WARMUP = 2  # steps left out of the time per step
SFT_STEPS = 100  # the starting policy's; another count names the page after it


def shape(hidden: int, layers: int) -> dict:
    """The policy's width and depth as overrides of both examples' ``models.actor.init``."""
    return {"models.actor.init.hidden_size": hidden, "models.actor.init.n_layers": layers}


def sft_base(tmp: str, steps: int, sized: dict) -> str:
    """Run examples/sft_tiny.yaml for ``steps`` and return its last checkpoint's actor."""
    cfg = rayhf.load_config(SFT).with_overrides(
        {
            **QUIET,
            **sized,
            "dataset.path": f"{tmp}/sft.parquet",
            "dataset.eval_path": f"{tmp}/sft_eval.parquet",
            "run_dir": f"{tmp}/sft",
            "steps": steps,
            "save_every": steps,
            "eval_every": steps,
        }
    )
    rayhf.run(cfg)
    return f"{tmp}/sft/checkpoints/step_{steps:06d}/actor"


def one_run(tmp: str, base: str, way: str, lr: float, seed: int, steps: int) -> list[dict]:
    overrides = WAYS[way][0]
    cfg = rayhf.load_config(EXAMPLE).with_overrides(
        {
            **QUIET,
            **overrides,
            "models.actor.init": None,
            "models.actor.path": base,
            "models.actor.optimizer.lr": lr,
            "dataset.path": f"{tmp}/echo.parquet",
            "run_dir": f"{tmp}/{way.replace(' ', '_')}_{lr}_{seed}",
            "seed": seed,
            "steps": steps,
            "save_every": 0,
        }
    )
    return rayhf.run(cfg).metrics


def final(rows: list[dict], window: int) -> float:
    return statistics.fmean(r["task_reward"] for r in rows[-window:])


def seconds_per_step(rows: list[dict]) -> float:
    return statistics.fmean(r["step_seconds"] for r in rows if r["step"] > WARMUP)


def trained_params(way: str, sized: dict) -> int:
    """The actor's trained parameters: every one, or its adapters'."""
    from rayhf.models.hf import hf_config
    from rayhf.models.lora import lora_of
    from rayhf.models.sharding import param_shards
    from rayhf.models.spec import model_spec
    from rayhf.tasks.demo import build_tokenizer  # the example's alphabet

    role = rayhf.load_config(EXAMPLE).with_overrides({**sized, **WAYS[way][0]}).models["actor"]
    tok = build_tokenizer()
    assert role.init is not None
    ids = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    spec = model_spec(hf_config(role.init, len(tok), *ids), value_head=False)
    if role.lora is not None:
        spec = dataclasses.replace(spec, lora=lora_of(role.lora, spec, "lora"))
    return sum(p.numel for p in param_shards(spec) if p.trained)


def chosen_rate(grid: dict[float, list[float]]) -> float:
    """The rate whose final reward, averaged over the seeds, is highest."""
    return max(grid, key=lambda lr: statistics.fmean(grid[lr]))


EXTEND = 3  # rates a grid may grow by past each edge


def beyond_edge(grid: dict[float, list[float]], start: tuple[float, ...]) -> list[float]:
    """The next rate past the edge of ``grid`` (sorted) where its best rate is, on the 1-2-5
    ladder; none where the best is inside, or the grid has grown by ``EXTEND`` past ``start``."""
    best, rates = chosen_rate(grid), list(grid)
    if best not in (rates[0], rates[-1]) or len(rates) >= len(start) + EXTEND:
        return []
    exponent = math.floor(math.log10(best) + 1e-9)
    ladder = [m * 10.0**e for e in (exponent - 1, exponent, exponent + 1) for m in (1, 2, 5)]
    i = min(range(len(ladder)), key=lambda j: abs(ladder[j] - best))
    step = ladder[i - 1] if best == rates[0] else ladder[i + 1]
    return [float(f"{step:.3g}")]


def report(res: dict, commit: str, args: str) -> str:
    w, seeds = res["window"], res["seeds"]
    sized = "" if res["name"] == "lora_demo" else " (the policy: hidden {}, {} layers)"
    lines = [
        "# LoRA ranks 1 and 8 against full fine-tuning on the demo task"
        + sized.format(*res["shape"]),
        "",
        f"`python benchmarks/lora_demo.py{args}` on this machine (2 CPU cores), commit {commit}. "
        + described(__doc__),
        "",
        f"The SFT policy's reward, the mean over the first step of every run: {res['start']:.3f}.",
        "",
        f"| training | trained parameters | final reward at each rate (mean of seeds) | chosen "
        f"rate | final reward, seeds {', '.join(map(str, seeds))} (mean) | s/step |",
        "| --- | ---: | --- | ---: | --- | ---: |",
    ]
    for name, r in res["ways"].items():
        grid = ", ".join(f"{lr:g}: {statistics.fmean(v):.3f}" for lr, v in r["grid"].items())
        each = ", ".join(f"{v:.3f}" for v in r["grid"][r["lr"]])
        lines.append(
            f"| {name} | {r['trained']:,} | {grid} | {r['lr']:g} | {each} "
            f"(**{statistics.fmean(r['grid'][r['lr']]):.3f}**) | {r['step_seconds']:.2f} |"
        )
    means = {n: statistics.fmean(r["grid"][r["lr"]]) for n, r in res["ways"].items()}
    full = means["full fine-tuning"]
    lines += [
        "",
        f"Final reward: the mean task reward over the last {w} of {res['steps']} steps. Against "
        "full fine-tuning's: "
        + "; ".join(f"{n} {m - full:+.3f}" for n, m in means.items() if n != "full fine-tuning")
        + ". The goal for rank 8 is to come within 0.05.",
        "",
        f"![reward per step, the chosen rates, mean over the seeds]({res['name']}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res["ways"].items():
        curves = r["curves"]
        mean = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
        smooth = [statistics.fmean(mean[max(0, i - 4) : i + 1]) for i in range(len(mean))]
        ax.plot(range(1, len(mean) + 1), smooth, label=f"{name} (lr {r['lr']:g})")
    ax.set_xlabel("GRPO step (from the SFT policy)")
    ax.set_ylabel("task reward (5-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS))
    args = ap.parse_args()
    commit = git_commit()
    sized = shape(args.hidden, args.layers)
    name = "lora_demo" if (args.hidden, args.layers) == (64, 2) else "lora_demo_h{}_l{}"
    res: dict = {"steps": args.steps, "seeds": args.seeds, "window": args.window, "ways": {}}
    res |= {"sft_steps": args.sft_steps, "shape": [args.hidden, args.layers]}
    res["name"] = name.format(args.hidden, args.layers)
    if args.sft_steps != SFT_STEPS:
        res["name"] += f"_sft{args.sft_steps}"
    firsts: list[float] = []
    started = connect(rayhf.load_config(EXAMPLE).cluster)  # one Ray for every run
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = sft_base(tmp, args.sft_steps, sized)
            for way in args.ways:
                began = time.perf_counter()
                runs: dict[float, list[list[dict]]] = {}
                rates = list(WAYS[way][1])
                while rates:  # the grid, then a step past whichever edge the best rate is at
                    for lr in rates:
                        runs[lr] = [one_run(tmp, base, way, lr, s, args.steps) for s in args.seeds]
                    grid = {lr: [final(r, args.window) for r in runs[lr]] for lr in sorted(runs)}
                    rates = beyond_edge(grid, WAYS[way][1])
                firsts += [rows[0]["task_reward"] for each in runs.values() for rows in each]
                lr = chosen_rate(grid)
                res["ways"][way] = {
                    "grid": grid,
                    "lr": lr,
                    "curves": [[r["task_reward"] for r in rows] for rows in runs[lr]],
                    "step_seconds": statistics.fmean(seconds_per_step(r) for r in runs[lr]),
                    "trained": trained_params(way, sized),
                    "run_seconds": time.perf_counter() - began,
                }
                print(way, {k: v for k, v in res["ways"][way].items() if k != "curves"})
    finally:
        if started:
            ray.shutdown()
    res["start"] = statistics.fmean(firsts)
    text = report(res, commit, "".join(f" {a}" for a in sys.argv[1:]))
    print(text)
    write_results(res["name"], text, res, commit)
    plot(res, REPO / "docs" / "benchmarks" / f"{res['name']}.png")


if __name__ == "__main__":
    main()
