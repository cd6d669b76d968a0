"""The planner on LoRA roles (simulated): GRPO and PPO of Qwen2.5-7B and -32B shapes on one and
two nodes of 8 H100s, each trained in full and with rank-16 adapters.

    python benchmarks/planner_lora.py [--time-limit 20] [--quick]

For each setup and way of training, the search's plan (``rayhf plan --cluster``'s) is compared in
estimated iteration time with every baseline's (``rayhf.planner.baselines``; an infeasible,
over-memory plan never counts as the best). LoRA: ``models.<role>.lora: {rank: 16}`` on every
linear layer of the decoder layers (the actor's, and PPO's critic's, whose value head trains in
full), priced as rayhf's torch engine runs it: frozen weights stored as the trained ones (fp32)
without gradients or AdamW state, the backward computing no frozen weight's gradient, the gradient
all-reduce and AdamW over the adapters alone; the reference computed by the actor on its base
weights (no copy of its own, as a run does it); a move to a copy of a LoRA role carries its
adapters alone, the copy keeping its frozen weights on its devices all run, unless its devices
overflow: then the plan releases it and its moves carry the whole model (as a run does). A batch
of ``BATCH`` sequences (64 prompts x 8 samples for GRPO) of ``PROMPT`` prompt and ``GEN`` new
tokens, 4 minibatches, activation checkpointing in every train call. PPO's critic and reward
model are the actor's shape. Writes docs/benchmarks/planner_lora.{md,json}, every plan included.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import described, git_commit, write_results
from planner_scale import compare, speedup

from rayhf.graph import load_graph
from rayhf.models.lora import LoraConfig, with_lora
from rayhf.models.shapes import public_shape
from rayhf.planner.auto import adapter_calls, open_stages
from rayhf.planner.cost import AnalyticCost, Workload, max_shard_params, max_trained_params
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.problem import Problem

REPO = Path(__file__).resolve().parents[1]
BATCH, PROMPT, GEN, RANK = 512, 512, 1024, 16
BUDGET = 16384  # tokens a micro-batch of the train call alone (``train_memory``)
WAYS = ("full", "lora")
TRAINED = {"grpo": ("actor",), "ppo": ("actor", "critic")}


def setups(quick: bool) -> list[tuple[str, str, int]]:
    """(algorithm, policy shape, devices)."""
    out = [
        (algo, shape, devices)
        for shape, sizes in (("qwen2.5-7b", (8,)), ("qwen2.5-32b", (8, 16)))
        for algo in ("grpo", "ppo")
        for devices in sizes
    ]
    return out[:1] if quick else out


def problem(algo: str, shape: str, devices: int, way: str) -> Problem:
    graph = load_graph(REPO / "graphs" / f"{algo}.yaml")
    specs = {"actor": public_shape(shape), "ref": public_shape(shape)}
    if algo == "ppo":
        specs |= {"critic": public_shape(shape, True), "reward": public_shape(shape, True)}
    if way == "lora":  # the reference: the actor's calls on its base weights (base_sources)
        for role in TRAINED[algo]:
            specs[role] = with_lora(specs[role], LoraConfig(rank=RANK), f"models.{role}.lora")
        graph = graph.on_bases({"ref": "actor"})
        del specs["ref"]
    works = {
        c.name: Workload(c.kind, BATCH, PROMPT, GEN, 4 if c.kind == "train" else 1,
                         checkpointing=c.kind == "train")
        for c in graph.calls
    }  # fmt: skip
    cost = AnalyticCost(parse_cluster(f"{devices // 8}x8xH100"))
    prob = Problem(graph, specs, works, cost)
    return prob.with_works(open_stages(works, (), adapter_calls(prob)))  # as `rayhf plan` does


def _layout(v: dict | None, call: str) -> str:
    if v is None:
        return "-"
    lay = v["plan"][call]
    zero = f" ZeRO-{lay['zero']}" if lay.get("zero") else ""
    return f"{len(lay['mesh'])} dev, dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}{zero}"


def _cell(v: dict | None) -> str:
    return "-" if v is None else f"{v['seconds']:.1f}{'' if v['feasible'] else '*'}"


def _up(r: dict) -> float:
    return speedup(r) if r["best_baseline"] and r["search"]["feasible"] else float("nan")


def report(rows: list[dict], commit: str) -> str:
    names = [k for k, v in rows[0]["full"].items() if (v is None or isinstance(v, dict))]
    names = [k for k in names if k != "search"]
    lines = [
        "# The planner on LoRA roles (simulated, H100 datasheet figures)",
        "",
        f"`python benchmarks/planner_lora.py` at {commit}. " + described(__doc__),
        "",
        "Seconds per iteration; `*` = does not fit memory, `-` = the baseline's rules give no "
        "plan. Every plan, with its stages, is in `planner_lora.json`.",
        "",
        "| algorithm | policy | GPUs | training | "
        + " | ".join(names)
        + " | search | best baseline | speed-up |",
        "| --- | --- | ---: | --- | "
        + " | ".join("---:" for _ in names)
        + " | ---: | --- | ---: |",
    ]
    ups: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in rows:
        for way in WAYS:
            x = r[way]
            up = _up(x)
            ups[way].append(up)
            cells = " | ".join(_cell(x.get(k)) for k in [*names, "search"])
            lines.append(
                f"| {r['algo']} | {r['shape']} | {r['devices']} | {way} | {cells} | "
                f"{x['best_baseline'] or 'none'} | " + ("-" if up != up else f"{up:.2f}x") + " |"
            )
    lines.append("")
    for way in WAYS:
        finite = [u for u in ups[way] if u == u]
        if finite:
            lines.append(
                f"- {way}: the search over the best feasible baseline, geometric mean "
                f"{statistics.geometric_mean(finite):.2f}x, median "
                f"{statistics.median(finite):.2f}x, worst {min(finite):.2f}x, best "
                f"{max(finite):.2f}x over {len(finite)} setups"
                + (f" ({len(rows) - len(finite)} with none feasible)." if len(finite) < len(rows)
                   else ".")
            )  # fmt: skip
    lines += [
        "",
        "What LoRA changes in the searched plan (devices, dp, tp, pp, ZeRO stage), and the "
        "search's time with LoRA over its time in full:",
        "",
        "| algorithm | policy | GPUs | call | full | LoRA |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for r in rows:
        for call in r["full"]["search"]["plan"]:
            a, b = (_layout(r[w]["search"], call) for w in WAYS)
            lines.append(
                f"| {r['algo']} | {r['shape']} | {r['devices']} | {call} | {a} | "
                + (f"**{b}**" if a != b else "same")
                + " |"
            )
    lines += [
        "",
        "| algorithm | policy | GPUs | search, full | search, LoRA | LoRA's speed-up |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        f, lo = r["full"]["search"], r["lora"]["search"]
        up = f["seconds"] / lo["seconds"] if f["feasible"] and lo["feasible"] else float("nan")
        lines.append(
            f"| {r['algo']} | {r['shape']} | {r['devices']} | {_cell(f)} | {_cell(lo)} | "
            + ("-" if up != up else f"{up:.2f}x")
            + " |"
        )
    return "\n".join(lines) + "\n"


def train_memory(shape: str, devices: int, tp: int) -> dict:
    """The actor's train call priced on ``devices`` at ``tp`` (dp the rest), micro-batches of
    ``BUDGET`` tokens, in full and with adapters: peak bytes per device and seconds; and the
    bytes of the whole model and of its adapters in bf16 (what a move carries)."""
    from rayhf.parallel.layout import Layout

    cost = AnalyticCost(parse_cluster(f"{devices // 8}x8xH100"))
    work = Workload("train", BATCH, PROMPT, GEN, 4, checkpointing=True, token_budget=BUDGET)
    full = public_shape(shape)
    lora = with_lora(full, LoraConfig(rank=RANK), "models.actor.lora")
    out: dict = {"shape": shape, "devices": devices}
    lay = Layout(tuple(range(devices)), devices // tp, tp)
    priced = {w: cost.call(s, lay, work) for w, s in (("full", full), ("lora", lora))}
    out["layout"] = f"dp{lay.dp} tp{lay.tp}"
    for way, c in priced.items():
        out[way] = {"memory": c.memory, "seconds": c.seconds}
    out["model_bytes"] = 2 * max_shard_params(full, 1, 1)
    out["adapter_bytes"] = 2 * max_trained_params(lora, 1, 1)
    return out


def memory_lines(rows: list[dict]) -> list[str]:
    lines = [
        "",
        f"The actor's train call alone, priced on every device, micro-batches of {BUDGET:,} "
        f"tokens, rank {RANK}; and the weights a move carries in bf16:",
        "",
        "| policy | GPUs | layout | peak, full | peak, LoRA | smaller by | step, full | step, "
        "LoRA | model | adapters | fewer bytes |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        f, lo = r["full"], r["lora"]
        lines.append(
            f"| {r['shape']} | {r['devices']} | {r['layout']} | {f['memory'] / 1e9:.0f} GB | "
            f"{lo['memory'] / 1e9:.0f} GB | {f['memory'] / lo['memory']:.2f}x | "
            f"{f['seconds']:.1f} s | {lo['seconds']:.1f} s | {r['model_bytes'] / 1e9:.1f} GB | "
            f"{r['adapter_bytes'] / 1e6:.0f} MB | {r['model_bytes'] / r['adapter_bytes']:.0f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="the first setup only")
    args = parser.parse_args()
    rows = []
    for algo, shape, devices in setups(args.quick):
        row: dict = {"algo": algo, "shape": shape, "devices": devices}
        for way in WAYS:
            row[way] = compare(problem(algo, shape, devices, way), args.time_limit)
            print(algo, shape, devices, way, row[way]["best_baseline"],
                  row[way]["search"]["seconds"], flush=True)  # fmt: skip
        rows.append(row)
    memory = [train_memory("qwen2.5-7b", 8, 1), train_memory("qwen2.5-32b", 8, 4)]
    commit = git_commit()
    text = report(rows, commit) + "\n".join(memory_lines(memory)) + "\n"
    print(text)
    write_results("planner_lora", text, {"rows": rows, "train_memory": memory}, commit)


if __name__ == "__main__":
    main()
