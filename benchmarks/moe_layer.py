"""One Mixture-of-Experts layer: rayhf's experts (one grouped GEMM over every expert's tokens)
against Hugging Face's own implementations of the same layer, on the same weights and tokens.

    python benchmarks/moe_layer.py [--repeats 7] [--seconds 0.3] [--no-write]
    python benchmarks/moe_layer.py --device cuda [--commit HASH]    # bf16, a GPU's shape

A Qwen3-MoE sparse block (hidden 256, 16 experts of width 128, 4 a token; one torch thread):
its router and experts as rayhf runs them (``rayhf.parallel.moe``: routing, then the tokens
sorted by expert through ``F.grouped_mm``) against transformers' ``Qwen3MoeSparseMoeBlock``
with its experts ``eager`` (a loop over the experts a batch hits) and ``grouped_mm`` (its
default). Forward without gradients at 1 and 16 tokens (a decode step's rows) and 2,048 (a
prefill); forward and backward at 2,048 (a train step's micro-batch). Each figure is the
median over ``--repeats`` rounds of the mean time of as many calls as fit ``--seconds``, the
implementations taking turns within a round. ep > 1: ``benchmarks/moe_model.py``.

With ``--device cuda`` (``benchmarks/gpu.py`` runs it as its ``moe_layer`` part): bf16, the shape
of a Qwen3-30B-A3B layer (hidden 2048, 128 experts of width 768, 8 a token), at 1, 64 and 4,096
tokens, written to ``moe_layer_gpu``.

Writes docs/benchmarks/moe_layer.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import write_results

from rayhf.models.families import FAMILIES
from rayhf.models.spec import MoESpec
from rayhf.parallel import moe

# (hidden, experts, top-k, expert width) and (pass, tokens) per device: a small layer on CPUs,
# Qwen3-30B-A3B's on a GPU
SHAPES = {"cpu": (256, 16, 4, 128), "cuda": (2048, 128, 8, 768)}
CASES = {
    "cpu": (("forward", 1), ("forward", 16), ("forward", 2048), ("train", 2048)),
    "cuda": (("forward", 1), ("forward", 64), ("forward", 4096), ("train", 4096)),
}
IMPLEMENTATIONS = ("rayhf", "hf_grouped_mm", "hf_eager")


def _blocks(device: str) -> dict[str, torch.nn.Module]:
    """Hugging Face's block with each experts implementation, the same weights in both (bf16
    on a GPU)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hidden, experts, top_k, width = SHAPES[device]
    out = {}
    for impl in ("grouped_mm", "eager"):
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=width, norm_topk_prob=True,
        )  # fmt: skip
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        block = Qwen3MoeSparseMoeBlock(cfg)
        block.experts.config = cfg
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        out[impl] = block.to(device=device, dtype=dtype)
    return out


def _calls(n: int, train: bool, device: str = "cpu") -> dict[str, Callable[[], None]]:
    blocks = _blocks(device)
    ref = blocks["grouped_mm"]
    hidden, experts, top_k, width = SHAPES[device]
    spec = MoESpec(experts, top_k, width, renormalize=True)
    traits = FAMILIES["qwen3_moe"].moe
    assert traits is not None
    x = torch.randn(1, n, hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=ref.gate.weight.dtype).requires_grad_(train)

    def ours() -> torch.Tensor:
        h = x[0]
        weights, ids, _ = moe.route(F.linear(h, ref.gate.weight), spec, traits)
        gate_up, down = ref.experts.gate_up_proj, ref.experts.down_proj
        return moe.experts(h, weights, ids, gate_up, down, moe.glu(F.silu))

    def hf(block: torch.nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: block(x)[0]

    fns = {
        "rayhf": ours,
        "hf_grouped_mm": hf(blocks["grouped_mm"]),
        "hf_eager": hf(blocks["eager"]),
    }
    tol = 1e-5 if x.dtype == torch.float32 else 3e-2  # bf16: a few roundings of the largest
    with torch.no_grad():
        want = fns["hf_eager"]()
        for name, f in fns.items():  # the same numbers first
            assert (f() - want).abs().max() <= tol * want.abs().max(), name

    def run(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def forward() -> None:
            with torch.no_grad():
                f()

        def step() -> None:
            f().pow(2).mean().backward()

        return step if train else forward

    return {name: run(f) for name, f in fns.items()}


def _time(f: Callable[[], None], seconds: float) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    f()
    sync()
    began, n = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        f()
        sync()
        n += 1
    return (time.perf_counter() - began) / n


def measure(repeats: int, seconds: float, device: str = "cpu") -> list[dict]:
    rows = []
    for kind, n in CASES[device]:
        calls = _calls(n, kind == "train", device)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, f in calls.items():
                times[name].append(_time(f, seconds))
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"kind": kind, "tokens": n, "ms": {k: v * 1e3 for k, v in med.items()}})
    return rows


def report(rows: list[dict], device: str = "cpu") -> str:
    hidden, experts, top_k, width = SHAPES[device]
    where = (
        "one torch thread on this machine's CPU, fp32"
        if device == "cpu"
        else f"bf16 on {torch.cuda.get_device_name(0)}"
    )
    command = "" if device == "cpu" else " --device cuda"
    lines = [
        "# One MoE layer: rayhf's experts against Hugging Face's",
        "",
        f"`python benchmarks/moe_layer.py{command}`: a Qwen3-MoE sparse block (hidden {hidden}, "
        f"{experts} experts of width {width}, {top_k} a token), {where}, the same weights and "
        "tokens for each. Milliseconds a call (median of rounds); the ratio is Hugging Face's "
        "time over rayhf's (above 1: rayhf is faster).",
        "",
        "| pass | tokens | rayhf | HF grouped_mm (default) | HF eager | vs grouped_mm | vs eager |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {'forward + backward' if r['kind'] == 'train' else 'forward'} | {r['tokens']} "
            f"| {ms['rayhf']:.3f} | {ms['hf_grouped_mm']:.3f} | {ms['hf_eager']:.3f} "
            f"| {ms['hf_grouped_mm'] / ms['rayhf']:.2f}x | {ms['hf_eager'] / ms['rayhf']:.2f}x |"
        )
    ratios = [r["ms"]["hf_grouped_mm"] / r["ms"]["rayhf"] for r in rows]
    losses = [
        f"{r['kind']} at {r['tokens']} tokens against {name} "
        f"({r['ms'][name] / r['ms']['rayhf']:.2f}x)"
        for r in rows
        for name in ("hf_grouped_mm", "hf_eager")
        if r["ms"][name] < 0.97 * r["ms"]["rayhf"]
    ]
    if losses:
        lines += [
            "",
            "Where rayhf loses by more than 3%: " + "; ".join(losses) + ". torch's CPU grouped "
            "GEMM is slower than one matrix product per expert once each expert has hundreds of "
            "tokens; Hugging Face's eager loop runs those.",
        ]
    lines += [
        "",
        f"Against Hugging Face's default (grouped_mm): geometric mean "
        f"{statistics.geometric_mean(ratios):.2f}x, lowest {min(ratios):.2f}x. The issue's goal "
        "(1.5x for decode, no slower for a train step) is for the layer in the whole decode "
        "step and on a GPU as well; this page is the layer alone on a CPU. The whole model's "
        "decode and train step, and ep = 2 and 4 on emulated devices: moe_model.md.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--device", default="cpu", choices=sorted(SHAPES))
    parser.add_argument("--commit", default=None, help="the commit measured (no .git there)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = measure(args.repeats, args.seconds, args.device)
    text = report(rows, args.device)
    print(text)
    if not args.no_write:
        page = "moe_layer" if args.device == "cpu" else "moe_layer_gpu"
        write_results(page, text, {"rows": rows, "device": args.device}, args.commit)


if __name__ == "__main__":
    main()
