"""A small Mixture-of-Experts model's decode and train step: rayhf against Hugging Face's
experts implementations on one device, and rayhf with its experts split over 1, 2 and 4
emulated devices.

    python benchmarks/moe_model.py [--reps 5] [--layers 4] [--no-write]
    python benchmarks/moe_model.py --device cuda [--commit HASH]    # bf16, also a ~1B shape

A Qwen3-MoE (hidden 256, 4 layers, 16 experts of width 128, 4 a token, 8 heads, vocabulary
4,096), fp32, one torch thread a process.

- **One device.** Decode: greedy, 16 prompts of 16 tokens, 32 new tokens each (EOS masked, so
  every row runs them all), rayhf's native engine (eager, and its step compiled) against
  transformers' ``generate``
  with its experts ``grouped_mm`` (its default) and ``eager`` (a loop over the experts a batch
  hits), KV cache in both. Train step: forward, backward and AdamW on 8 sequences of 128 tokens,
  rayhf's engine against the same step of each Hugging Face model. Tokens/s: new tokens for
  decode, sequence tokens for the train step; each figure the median of ``--reps`` rounds, the
  implementations taking turns within a round.
- **ep = 1, 2, 4.** The same calls as gloo processes, one per emulated device, at dp = 2 and 4
  with ep = 1 (every replica holds every expert) and ep = dp (each holds 1/dp of them, tokens
  exchanged at every MoE layer); the batch split over the replicas. This machine has 2 cores,
  so the 4-process rows share them two to a core: read those against each other, not against
  the 2-process rows.
- **Routing replay on the same samples.** bf16: a frozen copy generates (sampled, the experts of
  every token recorded), then a trained copy (fp32 master weights under bf16 autocast) scores
  the same sequences routed by its own router and replaying the generator's: the share of
  (token, MoE layer) pairs whose router chose another expert set, and the mean |log-prob|
  difference from the generator's per response token, each way.

With ``--device cuda`` (``benchmarks/gpu.py``'s ``moe_model`` part): bf16, the one-device rows
and the replay check for this shape and a ~1B one (hidden 1024, 12 layers, 48 experts of width
512, 8 a token), no emulated layouts; written to ``moe_model_gpu``.

Writes docs/benchmarks/moe_model.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import git_commit, hf_decode, median_seconds, write_results

VOCAB, PROMPTS, PROMPT_LEN, NEW, ROWS, SEQ = 4096, 16, 16, 32, 8, 128
LAYOUTS = ((2, 1), (2, 2), (4, 1), (4, 4))  # (dp, ep)
# (hidden, layers, heads, kv heads, experts, width, top-k): the small shape, and a ~1B one
SHAPES = {"small": (256, 4, 8, 4, 16, 128, 4), "1b": (1024, 12, 16, 4, 48, 512, 8)}


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def _model(layers: int, experts: str = "grouped_mm", shape: str = "small") -> Any:
    from rayhf.models.files import quiet_transformers
    from rayhf.models.hf import ModelInit, build_model, hf_config

    quiet_transformers()
    hidden, n_layers, heads, kv, n_experts, width, top_k = SHAPES[shape]
    init = ModelInit(
        family="qwen3_moe", hidden_size=hidden, n_layers=layers if shape == "small" else n_layers,
        n_heads=heads, n_kv_heads=kv,
        config={"num_experts": n_experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": width, "norm_topk_prob": True},
    )  # fmt: skip
    model = build_model(hf_config(init, VOCAB, 0, 2, 1), value_head=False).eval()
    model.set_attn_implementation("sdpa")  # Hugging Face's fastest attention on a CPU
    model.config._experts_implementation = experts
    for layer in model.model.layers:
        layer.mlp.experts.config = model.config
    return model


def _data() -> tuple[torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=gen)
    prompts = torch.randint(3, VOCAB, (PROMPTS, PROMPT_LEN), generator=gen).tolist()
    return ids, prompts


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()


def _hf_step(model: Any, ids: torch.Tensor, autocast: bool = False) -> Callable[[], None]:
    """A plain Hugging Face AdamW step (under bf16 autocast over fp32 weights on a GPU, as
    rayhf's trained copies compute there)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        _loss(logits.float(), ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def one_device(
    layers: int, reps: int, device: str = "cpu", shape: str = "small"
) -> dict[str, dict[str, float]]:
    """Seconds of each implementation's decode and train step on one device (bf16 on a GPU;
    one thread on a CPU)."""
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.build import standalone_engine
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.parallel.decode import DecodeEngine, DecodeOptions
    from rayhf.sampling import DecodeRules, GenerationConfig

    gpu = device == "cuda"
    precision = "bf16" if gpu else "fp32"
    if not gpu:
        torch.set_num_threads(1)
    ids, prompts = _data()
    ids = ids.to(device)
    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    kw: dict[str, Any] = {"device": device, "precision": precision}
    frozen = standalone_engine(_model(layers, shape=shape), _Tok(), False, None, **kw)
    trained = standalone_engine(
        _model(layers, shape=shape), _Tok(), False, OptimizerConfig(lr=1e-5), **kw
    )
    mask, batch = torch.ones_like(ids), PackedBatch(list(range(ROWS)))

    def rayhf_step() -> None:
        trained.train([batch], lambda _: (_loss(trained.forward(ids, mask), ids), {}))

    dtype = torch.bfloat16 if gpu else torch.float32  # a frozen copy's; training: fp32 + autocast
    hf = {
        impl: _model(layers, impl, shape).to(device=device, dtype=dtype)
        for impl in ("grouped_mm", "eager")
    }
    assert frozen.model is not None
    compiled = DecodeEngine(frozen.model.pipe, DecodeOptions(compile=True))
    rules = DecodeRules.of(greedy, _Tok.eos_token_id, _Tok.pad_token_id)
    decode = median_seconds(
        {
            "rayhf": lambda: frozen.generate(prompts, greedy, 0),
            "rayhf_compiled": lambda: compiled.generate(prompts, rules, 0),
        }
        | {f"hf_{k}": hf_decode(m, prompts, NEW) for k, m in hf.items()},
        reps,
    )
    train_hf = {impl: _model(layers, impl, shape).to(device) for impl in ("grouped_mm", "eager")}
    train = median_seconds(
        {"rayhf": rayhf_step} | {f"hf_{k}": _hf_step(m, ids, gpu) for k, m in train_hf.items()},
        reps,
    )
    return {"decode": decode, "train": train}


def replay_check(device: str = "cpu", shape: str = "small", layers: int = 4) -> dict[str, float]:
    """Routing replay on the same samples, bf16: the generator's experts against a trained
    copy's own router and replayed, and each way's log-prob difference from the generator's."""
    from rayhf.algorithms.lm import padded_routes
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.build import standalone_engine
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.sampling import GenerationConfig

    _, prompts = _data()
    kw: dict[str, Any] = {"device": device, "precision": "bf16"}
    gen = standalone_engine(_model(layers, shape=shape), _Tok(), False, None, **kw)
    opt = OptimizerConfig(lr=1e-5)
    trainer = standalone_engine(_model(layers, shape=shape), _Tok(), False, opt, **kw)
    sampled = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, expert_routes=True)
    out = gen.generate(prompts, sampled, 0)
    seqs = [p + t for p, t in zip(prompts, out.tokens, strict=True)]
    batch = PackedBatch(list(range(len(seqs))), extras={"expert_routes": out.routes})
    ids = torch.tensor(seqs, device=device)  # every row the same length (min_new_tokens)
    mask = torch.ones_like(ids)
    targets = torch.full_like(ids, -1)
    targets[:, PROMPT_LEN - 1 : -1] = ids[:, PROMPT_LEN:]  # each response token, where predicted
    routes = padded_routes(batch, ids.shape[1])
    assert routes is not None and trainer.model is not None
    behaviour = torch.tensor(out.logprobs, device=device)
    module = trainer.model.module
    res: dict[str, float] = {}
    module.train(True)
    for name, replay in (("own", False), ("replayed", True)):
        with torch.enable_grad():  # (the route checks are kept in training forwards)
            scored = trainer.score(ids, mask, targets, 1.0, routes, replay)
        logp = scored[:, PROMPT_LEN - 1 : -1, 0].detach().float()
        checks = module.take_route_checks()
        res["routes_differ_own"] = checks["routes_differ_own"]
        res[f"mismatch_{name}"] = float((logp - behaviour).abs().mean())
        res[f"differ_{name}"] = checks["routes_differ"]
    module.train(False)
    return res


def _layout_worker(rank: int, layout: tuple[int, int], args: tuple, out: str) -> None:
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.build import standalone_engine
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.parallel.groups import build_groups, join_store, leave_spawned
    from rayhf.sampling import GenerationConfig

    address, layers, reps = args
    dp, ep = layout
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=dp)
    groups = build_groups(dp, 1, 1, rank, ep=ep)
    ids, prompts = _data()
    r = groups.coords.dp_rank
    ids, prompts = ids[r * ROWS // dp : (r + 1) * ROWS // dp], prompts[r::dp]
    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    frozen = standalone_engine(_model(layers), _Tok(), False, None, groups)
    trained = standalone_engine(_model(layers), _Tok(), False, OptimizerConfig(lr=1e-5), groups)
    mask, batch = torch.ones_like(ids), PackedBatch(list(range(len(ids))))

    def step() -> None:
        trained.train([batch], lambda _: (_loss(trained.forward(ids, mask), ids), {}))

    # every rank times the same rounds (the calls are collective); rank 0 reports
    seconds = median_seconds(
        {"decode": lambda: frozen.generate(prompts, greedy, 0), "train": step}, reps
    )
    assert frozen.model is not None
    seconds["bytes"] = float(frozen.model.local_bytes())
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    leave_spawned()


def on_layout(layout: tuple[int, int], layers: int, reps: int, tmp: Path) -> dict[str, float]:
    from rayhf.parallel.groups import host_store

    _store, address = host_store()  # open here while the ranks meet through it
    out = tmp / f"dp{layout[0]}ep{layout[1]}.json"
    mp.spawn(_layout_worker, args=(layout, (address, layers, reps), str(out)), nprocs=layout[0])
    return json.loads(out.read_text())


def _tokens_per_s(kind: str, seconds: float) -> float:
    return (PROMPTS * NEW if kind == "decode" else ROWS * SEQ) / seconds


def _one_device_table(one: dict[str, dict[str, float]]) -> tuple[list[str], dict[str, float]]:
    lines = [
        "| call | rayhf tokens/s | HF grouped_mm | HF eager | rayhf over HF's fastest |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    ratios = {}
    for kind, ours in (("decode", "rayhf"), ("decode", "rayhf_compiled"), ("train", "rayhf")):
        t = {k: _tokens_per_s(kind, s) for k, s in one[kind].items()}
        best = max(t["hf_grouped_mm"], t["hf_eager"])
        ratios[ours if kind == "decode" else kind] = t[ours] / best
        name = f"{kind}{', compiled' if ours.endswith('compiled') else ''}"
        lines.append(
            f"| {name} | {t[ours]:,.0f} | {t['hf_grouped_mm']:,.0f} | {t['hf_eager']:,.0f} |"
            f" {t[ours] / best:.2f}x |"
        )
    return lines, ratios


def report(res: dict, commit: str) -> str:
    gpu = res["device"] == "cuda"
    where = "one GPU, bf16" if gpu else "2 CPU cores, one torch thread a process, fp32"
    lines = [
        "# A Mixture-of-Experts model: decode, train step and routing replay",
        "",
        f"`python benchmarks/moe_model.py --reps {res['reps']}"
        f"{' --device cuda' if gpu else ''}` at {commit} ({where}). Qwen3-MoE shapes (hidden, "
        "layers, heads, kv heads, experts, width, top-k): "
        + "; ".join(f"{k} {SHAPES[k]}" for k in res["shapes"])
        + f" ({res['layers']} layers for small). Decode: greedy, {PROMPTS} prompts x "
        f"{PROMPT_LEN} tokens, {NEW} new tokens each; train step: forward, backward and AdamW on "
        f"{ROWS} x {SEQ} tokens. Medians of {res['reps']} rounds.",
    ]
    ratios: dict[str, dict[str, float]] = {}
    for shape in res["shapes"]:
        table, ratios[shape] = _one_device_table(res["one_device"][shape])
        lines += ["", f"## One device, against Hugging Face: {shape}", "", *table]
    if res.get("layouts"):
        lines += [
            "",
            "## Experts split over emulated devices (small)",
            "",
            "| layout | processes | expert bytes a device | decode tokens/s | train tokens/s |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in res["layouts"].items():
            lines.append(
                f"| {name} | {name.split('ep')[0][2:]} | {r['bytes'] / 2**20:.1f} MiB | "
                f"{_tokens_per_s('decode', r['decode']):,.0f} | "
                f"{_tokens_per_s('train', r['train']):,.0f} |"
            )
    lines += [
        "",
        "## Routing replay on the same samples (bf16)",
        "",
        "| shape | experts differ (router's own) | log-prob mismatch, own routes | replayed |",
        "| --- | ---: | ---: | ---: |",
    ]
    for shape, r in res["replay"].items():
        lines.append(
            f"| {shape} | {r['routes_differ_own']:.2%} | {r['mismatch_own']:.2e} | "
            f"{r['mismatch_replayed']:.2e} |"
        )
    small = ratios[res["shapes"][0]]
    lines += [
        "",
        "## Reading it",
        "",
        f"- Decode ({res['shapes'][0]}): rayhf {small['rayhf']:.2f}x Hugging Face's fastest "
        f"experts implementation eager, {small['rayhf_compiled']:.2f}x with its step compiled "
        "(`engines.<call>.compile: true`; the first call compiles), against a goal of 1.5x; the "
        f"train step {small['train']:.2f}x (goal: no slower).",
        "- Routing replay: a trained copy scoring the generator's samples, its router's own "
        "choice against the generator's recorded experts; replayed, every token goes where it "
        "went when sampled (the differing share is 0 then), and the log-prob mismatch left is "
        "the rest of the forward's rounding.",
    ]
    if res.get("layouts"):
        lay = res["layouts"]
        split = {dp: lay[f"dp{dp}ep{dp}"] for dp in (2, 4)}
        whole = {dp: lay[f"dp{dp}ep1"] for dp in (2, 4)}
        lines.append(
            "- Splitting the experts costs their exchanges: at dp 2, ep 2 decodes "
            f"{whole[2]['decode'] / split[2]['decode']:.2f}x and trains "
            f"{whole[2]['train'] / split[2]['train']:.2f}x as fast as ep 1 (each holding every "
            f"expert), at dp 4 {whole[4]['decode'] / split[4]['decode']:.2f}x and "
            f"{whole[4]['train'] / split[4]['train']:.2f}x. On gloo between processes of one "
            "machine every exchange is a host round trip, and a decode step exchanges a handful "
            "of rows per layer; what ep buys is the memory (the bytes column) a model too large "
            "for one device needs."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--commit", default=None, help="the commit measured (no .git there)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    gpu = args.device == "cuda"
    shapes = ["small", "1b"] if gpu else ["small"]
    res: dict[str, Any] = {
        "reps": args.reps, "layers": args.layers, "device": args.device, "shapes": shapes,
        "one_device": {s: one_device(args.layers, args.reps, args.device, s) for s in shapes},
        "replay": {s: replay_check(args.device, s, args.layers) for s in shapes},
    }  # fmt: skip
    if not gpu:
        with tempfile.TemporaryDirectory() as tmp:
            res["layouts"] = {
                f"dp{dp}ep{ep}": on_layout((dp, ep), args.layers, args.reps, Path(tmp))
                for dp, ep in LAYOUTS
            }
    commit = args.commit or git_commit()
    text = report(res, commit)
    print(text)
    if not args.no_write:
        write_results("moe_model_gpu" if gpu else "moe_model", text, res, commit)


if __name__ == "__main__":
    main()
