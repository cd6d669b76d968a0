"""rayhf on one GPU: a PPO run of a Qwen2-0.5B-shaped model, its generator against Hugging Face
``generate``, and its train step against a plain Hugging Face step.

    source scripts/gpu_env.sh install   # on a bare GPU machine: Ray, pydantic, ...
    python benchmarks/gpu.py [--steps 4] [--batch 64] [--new-tokens 256] [--commit HASH]
        [--skip PART ...] [--page NAME]

Under 10 minutes a call, the 1.5B parts and the weight-move transports go in a second one:
``--skip ppo_1.5b planner_1.5b transports colocated_move moe_layer moe_model hybrid_model``, then
``--skip-ppo --skip generation train_step logprob_memory planner_0.5b hf_static --page
gpu_1.5b``.

The model has Qwen2-0.5B's shape (24 layers, 896 wide, 14 query and 2 key/value heads, MLP 4864,
tied embedding, vocabulary padded to 151,936 rows) and random weights; prompts are the demo task's
(``rayhf.tasks.demo``, under 24 tokens) and every response is exactly ``--new-tokens`` long
(``min_new_tokens``), so each step does the same work. All in bf16 as ``precision: auto`` gives
on a GPU: trained copies keep fp32 master weights and AdamW moments and compute under autocast,
frozen copies store bf16.

- PPO (``examples/ppo_tiny.yaml`` with this model as actor and critic, the reference initialised
  from the actor, 4 minibatches, all roles on the one GPU): seconds per step, tokens/s, the peak
  GPU memory in use (``nvidia-smi``, every role actor's CUDA context included), and the model FLOP
  utilisation of the train calls (6 x matmul parameters + attention, per token, over bf16 peak).
- Generation: rayhf's native generator (a bf16 copy) and Hugging Face ``generate`` (bf16, SDPA
  attention, its KV cache) on the same model and prompts, tokens/s.
- Train step: one AdamW step of rayhf's torch trainer (its loss from the sliced scoring head,
  as a train call computes it) and of a plain Hugging Face forward/backward/AdamW step (fp32
  weights under bf16 autocast, SDPA) on the same batch.
- Log-prob path memory: ``benchmarks/train_step.py``'s, on the GPU.
- ``plan: auto``'s prediction: each PPO call priced from the models timed on this GPU (as a
  cuda run times them) against its measured mean, for this shape and Qwen2.5-1.5B's (a PPO run
  of that shape first).
- One Mixture-of-Experts layer (``moe_layer``): ``benchmarks/moe_layer.py --device cuda``, its
  own page.
- Mixture-of-Experts models (``moe_model``): ``benchmarks/moe_model.py --device cuda``, the small
  and a ~1B-total Qwen3-MoE: decode (eager and compiled) and train step against Hugging Face's,
  and routing replay on the same samples in bf16; its own page (``moe_model_gpu``).
- A hybrid model (``hybrid_model``): ``benchmarks/hybrid_model.py --device cuda``, a ~0.8B
  Qwen3.5-shaped model's prefill, decode and train step against Hugging Face's at 512, 2k and
  8k tokens, with flash-linear-attention's kernel (``fla-core``, carried as a wheel) and
  without; its own page (``hybrid_model_gpu``).
- Weight-move transports between processes on the one GPU: the PPO run with the reference's
  first move and any later ones through /dev/shm and through CUDA IPC (``transports``), and
  ``benchmarks/gpu_colocated_move.py``'s bytes/s of each (``colocated_move``, its own page).

Writes docs/benchmarks/gpu.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import train_step as train_bench
from _common import git_commit, write_results
from train_step import matmul_params, train_flops_per_token

import rayhf
from rayhf.models.hf import ModelInit, build_model, hf_config

REPO = Path(__file__).resolve().parents[1]
QWEN2_05B = {"family": "qwen2", "hidden_size": 896, "n_layers": 24, "n_heads": 14,
             "n_kv_heads": 2, "intermediate_size": 4864, "tied": True, "max_positions": 1024,
             "config": {"vocab_size": 151936}}  # fmt: skip
QWEN25_15B = {"family": "qwen2", "hidden_size": 1536, "n_layers": 28, "n_heads": 12,
              "n_kv_heads": 2, "intermediate_size": 8960, "tied": True, "max_positions": 1024,
              "config": {"vocab_size": 151936}}  # fmt: skip
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s
TIMED = 5  # timed repetitions of each micro-benchmark, after one warm-up
HF_TIMED = 3  # of Hugging Face's generate, a call 5-10x slower


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


class GpuMemory:
    """The most GPU memory in use, sampled by ``nvidia-smi`` every 100 ms while it runs."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMemory:
        query = ["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "100"]
        cmd = ["nvidia-smi", *query]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.peak_mib = max(self.peak_mib, int(line))

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait()


def ppo_config(tmp: str, steps: int, batch: int, new_tokens: int, shape: dict) -> Any:
    """The PPO run's config: ``shape`` as actor and critic, every role on the one GPU."""
    return rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(
        {
            "run_dir": f"{tmp}/run",
            "dataset.path": f"{tmp}/data.parquet",
            "steps": steps,
            "batch_size": batch,
            "save_every": 0,
            "generation.max_new_tokens": new_tokens,
            "generation.min_new_tokens": new_tokens,
            "models.actor.init": shape,
            "models.actor.optimizer": {"lr": 1e-6},
            "models.critic.init": {**shape, "seed": 7},
            "models.critic.optimizer": {"lr": 1e-6},
            # inference and train forwards over at most 16 full rows at a time
            "engines": {
                call: {"engine": "torch", "max_tokens_per_microbatch": 16 * 24 + 16 * new_tokens}
                for call in ("ref_inf", "critic_inf", "actor_train", "critic_train")
            },
            "cluster.device": "cuda",
            "cluster.n_devices": 1,
            "metrics.console": False,
            "metrics.plot": False,
            "metrics.ray_metrics": False,
        }
    )


def ppo(
    steps: int,
    warmup: int,
    batch: int,
    new_tokens: int,
    shape: dict = QWEN2_05B,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ppo_config(tmp, steps + warmup, batch, new_tokens, shape)
        cfg = cfg.with_overrides(overrides or {})
        start = time.perf_counter()
        with GpuMemory() as memory:
            result = rayhf.run(cfg)
        wall = time.perf_counter() - start
        from transformers import AutoModelForCausalLM

        actor = AutoModelForCausalLM.from_pretrained(result.run_dir / "init" / "actor")
    rows = result.metrics[warmup:]
    keys = [k for k in rows[0] if k.startswith("seconds/")] + ["step_seconds", "tokens_per_s"]
    mean = {k: statistics.mean(r[k] for r in rows) for k in keys}
    tokens = mean["tokens_per_s"] * mean["step_seconds"]  # prompt + response tokens per step
    seq = tokens / batch
    flops = train_flops_per_token(actor, seq) * tokens  # the critic is the same shape, less head
    head = 6 * actor.config.vocab_size * actor.config.hidden_size
    critic_flops = (train_flops_per_token(actor, seq) - head) * tokens
    peak = peak_flops()
    mfu = {
        "actor_train": flops / mean["seconds/actor_train"] / peak if peak else None,
        "critic_train": critic_flops / mean["seconds/critic_train"] / peak if peak else None,
    }
    return {
        "params": sum(p.numel() for p in actor.parameters()),
        "steps": len(rows),
        "warmup": warmup,
        "wall_seconds": wall,
        "mean": mean,
        "median_step_seconds": statistics.median(r["step_seconds"] for r in rows),
        "tokens_per_step": tokens,
        "gen_tokens_per_s": batch * new_tokens / mean["step_seconds"],
        "peak_gpu_mib": memory.peak_mib,
        "train_mfu": mfu,
        "reward": [r.get("task_reward") for r in result.metrics],
        "logprob_mismatch": [r.get("logprob_mismatch") for r in result.metrics],
        "init_realloc_seconds": result.info.get("init_realloc_seconds"),
        "init_realloc_bytes": result.info.get("init_realloc_bytes"),
        "realloc_seconds": statistics.mean(r.get("realloc_seconds", 0.0) for r in rows),
    }


def transports(steps: int, warmup: int, batch: int, new_tokens: int) -> dict[str, Any]:
    """The PPO run with weight moves through /dev/shm, then through CUDA IPC."""
    out = {}
    for transport in ("shm", "ipc"):
        r = ppo(
            steps,
            warmup,
            batch,
            new_tokens,
            overrides={"driver.same_host_transport": transport},
        )
        keep = (
            "median_step_seconds",
            "init_realloc_seconds",
            "init_realloc_bytes",
            "realloc_seconds",
        )
        out[transport] = {"step_seconds": r["mean"]["step_seconds"], **{k: r[k] for k in keep}}
    return out


def transport_lines(t: dict[str, Any]) -> list[str]:
    lines = [
        "## Weight moves between role groups on the one GPU: /dev/shm against CUDA IPC",
        "",
        "The Qwen2-0.5B-shape PPO run, once per `driver.same_host_transport`. The reference's "
        "first move (the actor's weights, fp32 to the reference's bf16) is between processes on "
        "the GPU; later moves are 0 where the one-GPU plan moves nothing. Bytes/s of each on "
        "larger moves: "
        "[gpu_colocated_move.md](gpu_colocated_move.md).",
        "",
        "| transport | step s (mean; median) | first move s | first move GB/s | moves a step s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in t.items():
        seconds, size = r["init_realloc_seconds"], r["init_realloc_bytes"]
        rate = f"{size / seconds / 1e9:.2f}" if seconds and size else "-"
        first = f"{seconds:.3f}" if seconds else "-"
        lines.append(
            f"| {name} | {r['step_seconds']:.2f}; {r['median_step_seconds']:.2f} | {first} | "
            f"{rate} | {r['realloc_seconds']:.3f} |"
        )
    return lines


def colocated_move(commit: str) -> dict[str, Any]:
    """``benchmarks/gpu_colocated_move.py`` (its own processes and page), read back."""
    import json

    here = Path(__file__).resolve().parent
    cmd = ["python", str(here / "gpu_colocated_move.py"), "--commit", commit]
    subprocess.run(cmd, check=True, timeout=420, cwd=here)
    page = json.loads((REPO / "docs" / "benchmarks" / "gpu_colocated_move.json").read_text())
    return page.get("results", page)


def moe_model(commit: str) -> dict[str, Any]:
    """``benchmarks/moe_model.py --device cuda`` (its own page, ``moe_model_gpu``), read back."""
    import json

    here = Path(__file__).resolve().parent
    cmd = ["python", str(here / "moe_model.py"), "--device", "cuda", "--commit", commit]
    subprocess.run(cmd, check=True, timeout=420, cwd=here)
    return json.loads((REPO / "docs" / "benchmarks" / "moe_model_gpu.json").read_text())


def hybrid_model(commit: str) -> dict[str, Any]:
    """``benchmarks/hybrid_model.py --device cuda`` (a ~0.8B Qwen3.5-shaped hybrid: prefill,
    decode and train step against Hugging Face's, with flash-linear-attention's kernel and
    without; its own page, ``hybrid_model_gpu``), read back."""
    import json

    here = Path(__file__).resolve().parent
    cmd = ["python", str(here / "hybrid_model.py"), "--device", "cuda", "--commit", commit]
    subprocess.run(cmd, check=True, timeout=420, cwd=here)
    return json.loads((REPO / "docs" / "benchmarks" / "hybrid_model_gpu.json").read_text())


def moe_layer(commit: str) -> dict[str, Any]:
    """``benchmarks/moe_layer.py --device cuda`` (a Qwen3-30B-A3B layer in bf16, rayhf's experts
    against Hugging Face's; its own page, ``moe_layer_gpu``), read back."""
    import json

    here = Path(__file__).resolve().parent
    cmd = ["python", str(here / "moe_layer.py"), "--device", "cuda", "--commit", commit]
    subprocess.run(cmd, check=True, timeout=300, cwd=here)
    return json.loads((REPO / "docs" / "benchmarks" / "moe_layer_gpu.json").read_text())


def planner_check(
    batch: int, new_tokens: int, measured: dict[str, float], shape: dict = QWEN2_05B
) -> dict[str, Any]:
    """What ``plan: auto`` predicts for each call of the PPO run against what it took: the
    roles' shapes timed on this GPU as a cuda run times them (``gpu_profiles``), priced on
    the one-GPU plan the run used (``measured``: the run's mean ``seconds/<call>``)."""
    from rayhf.planner.auto import GPU_CALL_OVERHEAD
    from rayhf.planner.hardware import gpu_cluster
    from rayhf.planner.plan import colocated_plan
    from rayhf.planner.profile import ProfiledCost
    from rayhf.runtime.assets import model_configs
    from rayhf.runtime.planning import planner_workloads
    from rayhf.runtime.profiling import gpu_profiles

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ppo_config(tmp, 1, batch, new_tokens, shape)
        configs = {r: (c, cfg.models[r].value_head) for r, c in model_configs(cfg).items()}
    graph = rayhf.load_graph(cfg.graph_path())
    timed = gpu_profiles(configs)
    assert timed is not None, "no GPU visible"
    specs, profiles, name = timed
    gpus = gpu_cluster(1, name)
    assert gpus is not None, f"{name}: no datasheet entry"
    cost = ProfiledCost(gpus, profiles, GPU_CALL_OVERHEAD)
    works = planner_workloads(cfg, graph, None)
    layout = colocated_plan(graph, 1).layouts
    rows = {}
    for call in graph.calls:
        if call.role in specs and f"seconds/{call.name}" in measured:
            predicted = cost.call(specs[call.role], layout[call.name], works[call.name]).seconds
            rows[call.name] = (predicted, measured[f"seconds/{call.name}"])
    return {"device": name, "calls": rows}


def planner_lines(name: str, p: dict[str, Any]) -> list[str]:
    lines = [
        f"## plan: auto's prediction against the PPO run ({name})",
        "",
        "Each call priced from the models timed on this GPU (`gpu_profiles`), against its mean",
        "measured seconds in the PPO run above (goal: within 25%).",
        "",
        "| call | predicted s | measured s | predicted / measured |",
        "| --- | ---: | ---: | ---: |",
    ]
    for call, (pred, meas) in p["calls"].items():
        lines.append(f"| {call} | {pred:.3f} | {meas:.3f} | {pred / meas:.2f} |")
    worst = max((abs(pr / me - 1) for pr, me in p["calls"].values()), default=float("nan"))
    return [*lines, "", f"Largest error: {worst:.0%}."]


def _timed(fn, check=None, repeat: int = TIMED) -> list[float]:
    out = fn()  # warm-up (kernels chosen, caches sized)
    if check is not None:
        check(out)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _model(tok) -> Any:
    init = ModelInit(**QWEN2_05B)
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = build_model(config, value_head=False, seed=0)
    model.config._attn_implementation = "sdpa"  # Hugging Face's default on GPUs
    return model


HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # datasheet bandwidth


def _prompts(tok: Any, batch: int, group: int = 1) -> list[list[int]]:
    """``batch`` prompts of 8-23 demo-alphabet tokens; ``group`` > 1: batch / group distinct
    prompts, each repeated ``group`` times (a GRPO-shaped call)."""
    gen = torch.Generator().manual_seed(0)
    distinct = [torch.randint(4, len(tok), (int(n),), generator=gen).tolist()
                for n in torch.randint(8, 24, (batch // group,), generator=gen)]  # fmt: skip
    return [p for p in distinct for _ in range(group)]


def memory_floor(model: Any, rows: int, prompt: float, new_tokens: int) -> float | None:
    """Tokens/s if a decode step cost only its bytes over the datasheet HBM bandwidth: every
    matmul weight in bf16 once, the filled keys and values read once (the mean over the call)
    and the step's new ones written."""
    name = torch.cuda.get_device_name(0)
    bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    if bw is None:
        return None
    c = model.config
    kv_token = (
        2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * (c.hidden_size // c.num_attention_heads)
        * 2
    )
    step = 2 * matmul_params(model) + rows * kv_token * (prompt + new_tokens / 2 + 1)
    return rows / (step / bw)


def _native(tok: Any, precision: str, master: bool, cuda_graphs: bool = True) -> Any:
    """A rank's model of this shape on the GPU with the native generator (``master``: fp32
    weights under autocast, as a trained actor generates)."""
    from rayhf.engines.config import NativeEngineConfig
    from rayhf.engines.native import NativeGenerator
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.precision import Numerics

    model = RankModel.from_hf(
        _model(tok), tok, False, device="cuda", numerics=Numerics(precision, master=master)
    )
    return NativeGenerator(model, NativeEngineConfig(cuda_graphs=cuda_graphs))


def generation(batch: int, new_tokens: int) -> dict[str, Any]:
    from rayhf.models.tokenizer import build_char_tokenizer
    from rayhf.sampling import GenerationConfig
    from rayhf.tasks.demo import ALPHABET

    tok = build_char_tokenizer(ALPHABET)
    prompts = _prompts(tok, batch)
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    n = batch * new_tokens
    out: dict[str, Any] = {"batch": batch, "new_tokens": new_tokens, "rows": {}}

    def check(res: Any) -> None:
        assert all(len(t) == new_tokens for t in res.tokens), "every row runs to the cap"

    cases = {  # name -> (precision, fp32 master weights, CUDA graphs, prompts)
        "native (bf16 weights)": ("bf16", False, True, prompts),
        "native (fp32 master, bf16 autocast: a trained actor)": ("bf16", True, True, prompts),
        "native without CUDA graphs (bf16 weights)": ("bf16", False, False, prompts),
        "native, GRPO-shaped (8 prompts x 8 samples)": ("bf16", False, True,
                                                        _prompts(tok, batch, 8)),
    }  # fmt: skip
    for name, (precision, master, graphs, rows) in cases.items():
        gen = _native(tok, precision, master, graphs)
        start = time.perf_counter()
        check(gen.generate(rows, cfg, 0))  # allocates, captures
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        times = _timed(lambda g=gen, r=rows: g.generate(r, cfg, 0), check)
        row = {"seconds": times, "first_call_seconds": first,
               "graphs": len(gen.engine.graphs)}  # fmt: skip
        if name.startswith("native (bf16"):
            row.update(_refresh_costs(gen, prompts, cfg, statistics.median(times)))
        out["rows"][name] = row
        del gen
        torch.cuda.empty_cache()
    out["rows"][HF_DYNAMIC] = {"seconds": _hf_generate(_model(tok), tok, prompts, new_tokens)}
    torch.cuda.empty_cache()
    for row in out["rows"].values():
        row["tokens_per_s"] = n / statistics.median(row["seconds"])
    prompt = statistics.mean(len(p) for p in prompts)
    out["floor_tokens_per_s"] = memory_floor(_model(tok), batch, prompt, new_tokens)
    return out


HF_DYNAMIC = "Hugging Face generate (SDPA, dynamic cache)"
HF_STATIC = "Hugging Face generate (static cache + torch.compile)"


def hf_static(g: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's static cache with its compiled decode, a row added to ``g`` (measured
    last: compiling takes minutes, and the other parts are written first)."""
    from rayhf.models.tokenizer import build_char_tokenizer
    from rayhf.tasks.demo import ALPHABET

    tok = build_char_tokenizer(ALPHABET)
    batch, new_tokens = g["batch"], g["new_tokens"]
    start = time.perf_counter()
    seconds = _hf_generate(_model(tok), tok, _prompts(tok, batch), new_tokens, static=True)
    row = {"seconds": seconds, "tokens_per_s": batch * new_tokens / statistics.median(seconds),
           "with_compile_seconds": time.perf_counter() - start}  # fmt: skip
    g["rows"][HF_STATIC] = row
    return row


def _refresh_costs(gen: Any, prompts: Any, cfg: Any, steady: float) -> dict[str, float]:
    """A call after the weights change in place (a train step, a move into the same storage:
    the graphs replay as they are) and after they get new storage (released and refilled: the
    engine captures again)."""
    model = gen.model
    full = model.full_state()

    def call() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        gen.generate(prompts, cfg, 1)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    model.load_full_state(full)
    in_place = call()
    model.release()
    model.load_full_state(full)
    new_storage = call()
    return {"after_update_in_place_seconds": in_place, "after_new_storage_seconds": new_storage,
            "recapture_seconds": new_storage - steady}  # fmt: skip


def _hf_generate(
    model: Any, tok: Any, prompts: list[list[int]], new_tokens: int, static: bool = False
) -> list[float]:
    """Hugging Face ``generate`` (bf16, SDPA); ``static``: its static KV cache, with which
    ``generate`` compiles the decode forward itself (its ``CompileConfig``: ``mode=
    "reduce-overhead"``, i.e. CUDA graphs), Hugging Face's fast path."""
    hf = model.to(device="cuda", dtype=torch.bfloat16).eval()
    extra: dict[str, Any] = {}
    if static:
        extra["cache_implementation"] = "static"
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left-padded, as generate wants
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.cuda(), mask.cuda()

    def hf_generate() -> torch.Tensor:
        with torch.no_grad():
            return hf.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **extra,
            )  # fmt: skip

    def check(out: torch.Tensor) -> None:
        assert out.shape[1] == width + new_tokens, "every row runs to the cap"

    return _timed(hf_generate, check, HF_TIMED)


def generation_table(g: dict[str, Any]) -> list[str]:
    """The generation rows (median of the timed calls), each against Hugging Face's best, and
    the memory floor; then what capturing and refreshing the weights cost."""
    rows = g["rows"]
    hf_best = max(r["tokens_per_s"] for k, r in rows.items() if k.startswith("Hugging Face"))
    floor = g.get("floor_tokens_per_s")
    lines = [
        "| generator | median seconds | tokens/s | vs HF's best | of the memory floor |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        share = f"{r['tokens_per_s'] / floor:.0%}" if floor else "n/a"
        lines.append(
            f"| {name} | {statistics.median(r['seconds']):.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / hf_best:.2f}x | {share} |"
        )
    lines.append("")
    if floor:
        lines.append(
            f"Memory floor: {floor:.0f} tokens/s (every bf16 matmul weight and the filled keys "
            "and values read once per step at the datasheet HBM bandwidth)."
        )
    if HF_STATIC in rows:
        lines.append(
            f"Hugging Face's static cache: {rows[HF_STATIC]['with_compile_seconds']:.0f} s for "
            "its first calls and compiling."
        )
    for name, r in rows.items():
        if "recapture_seconds" in r:
            lines.append(
                f"{name}: first call {r['first_call_seconds']:.2f} s ({r['graphs']} graphs "
                f"captured); a call after an update in place "
                f"{r['after_update_in_place_seconds']:.2f} s (the graphs replay); after new "
                f"storage {r['after_new_storage_seconds']:.2f} s (recapturing costs "
                f"{r['recapture_seconds']:.2f} s)."
            )
    return lines


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def ppo_lines(res: dict[str, Any]) -> list[str]:
    p = res["ppo"]
    m = p["mean"]
    lines = [
        f"## PPO, all four roles on the one GPU ({p['steps']} steps after {p['warmup']} warm-up)",
        "",
        f"{res['batch']} prompts x {res['new_tokens']} new tokens a step, 4 minibatches; "
        "actor and critic of this shape, the reference from the actor, the demo task's reward.",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| seconds per step (mean; median) | {m['step_seconds']:.2f}; "
        f"{p['median_step_seconds']:.2f} |",
        f"| tokens/s (prompt + response) | {m['tokens_per_s']:.0f} |",
        f"| generated tokens/s | {p['gen_tokens_per_s']:.0f} |",
        f"| peak GPU memory in use (nvidia-smi) | {p['peak_gpu_mib'] / 1024:.1f} GiB |",
        f"| train-call MFU: actor; critic | {_pct(p['train_mfu']['actor_train'])}; "
        f"{_pct(p['train_mfu']['critic_train'])} |",
        "| generator-trainer log-prob mismatch per step (nats a token) | "
        + ", ".join(f"{x:.6f}" for x in p["logprob_mismatch"] if x is not None)
        + " |",
    ]
    for k, v in m.items():
        if k.startswith("seconds/"):
            call = k.removeprefix("seconds/")
            lines.append(f"| {call} seconds (compute in the actor) | {v:.2f} |")
    return lines


def generation_lines(g: dict[str, Any]) -> list[str]:
    head = f"## Generation: {g['batch']} prompts x {g['new_tokens']} new tokens, bf16, sampled"
    return [head, "", *generation_table(g)]


def logprob_memory() -> dict[str, Any]:
    """``benchmarks/train_step.py``'s memory part on the GPU: the peak of the log-prob path
    through whole logits and through the sliced head, at a 151,936-entry vocabulary."""
    return train_bench.memory("cuda")


def train_lines(t: dict[str, Any]) -> list[str]:
    return [
        f"## One train step: {t['rows']} rows x {t['tokens'] // t['rows']} tokens, AdamW, bf16 "
        "autocast (`benchmarks/train_step.py`)",
        "",
        "| step | median seconds | MFU | peak allocated |",
        "| --- | ---: | ---: | ---: |",
        f"| rayhf torch trainer | {t['rayhf_s']:.3f} | {_pct(t.get('rayhf_mfu'))} | "
        f"{t['rayhf_peak_mib'] / 1024:.1f} GiB |",
        f"| plain Hugging Face (fused AdamW) | {t['hf_s']:.3f} | {_pct(t.get('hf_mfu'))} | "
        f"{t['hf_peak_mib'] / 1024:.1f} GiB |",
        "",
        f"rayhf's step over the plain step: {t['ratio'] - 1:+.1%}. Times are medians of "
        f"{TIMED} after two warm-ups.",
    ]


def report(res: dict[str, Any]) -> str:
    """The page, of whichever parts measured (a part that failed is named as missing)."""
    params = f"{res['params'] / 1e6:.0f}M parameters, " if "params" in res else ""
    lines = [
        f"# rayhf on one GPU ({res['device']})",
        "",
        f"Command: `python benchmarks/gpu.py --steps {res['steps']} --batch {res['batch']} "
        f"--new-tokens {res['new_tokens']}` after `source scripts/gpu_env.sh install`, on the lent "
        f"machine ({res['device']}, torch {res['torch']}); commit {res['commit']}. Model: "
        f"Qwen2-0.5B's shape, {params}random weights; bf16 "
        "(fp32 master weights under autocast where a role trains).",
    ]
    parts = {
        "ppo": lambda: ppo_lines(res),
        "generation": lambda: generation_lines(res["generation"]),
        "train_step": lambda: train_lines(res["train_step"]),
        "logprob_memory": lambda: train_bench.memory_lines(res["logprob_memory"]),
        "planner_0.5b": lambda: planner_lines("Qwen2-0.5B shape", res["planner_0.5b"]),
        "ppo_1.5b": lambda: [
            "## PPO, Qwen2.5-1.5B shape",
            *ppo_lines({**res, "ppo": res["ppo_1.5b"]})[1:],
        ],
        "planner_1.5b": lambda: planner_lines("Qwen2.5-1.5B shape", res["planner_1.5b"]),
        "transports": lambda: transport_lines(res["transports"]),
        "colocated_move": lambda: [
            "## Colocated weight moves: [gpu_colocated_move.md](gpu_colocated_move.md)"
        ],
        "moe_layer": lambda: [
            "## One Mixture-of-Experts layer: [moe_layer_gpu.md](moe_layer_gpu.md)"
        ],
        "moe_model": lambda: [
            "## Mixture-of-Experts models, routing replay: [moe_model_gpu.md](moe_model_gpu.md)"
        ],
        "hybrid_model": lambda: [
            "## A hybrid (Gated DeltaNet) model: [hybrid_model_gpu.md](hybrid_model_gpu.md)"
        ],
    }
    for name, lines_of in parts.items():
        if name == "generation" and "hf_static" in res["errors"]:
            lines += ["", f"Hugging Face's static cache did not run: {res['errors']['hf_static']}."]
        if name in res:
            lines += ["", *lines_of()]
        else:
            lines += ["", f"## {name}: did not complete ({res.get('errors', {}).get(name, '?')})"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--commit", default=None, help="the commit measured (no .git on the machine)")
    ap.add_argument("--skip-ppo", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], help="parts not to run (e.g. ppo_1.5b)")
    ap.add_argument("--page", default="gpu", help="docs/benchmarks/PAGE.{md,json} (a 2nd call)")
    ap.add_argument("--out", type=Path, default=None, help="also copy the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "steps": args.steps,
        "commit": args.commit or git_commit(),
        "errors": {},
    }
    parts = {
        "ppo": lambda: ppo(args.steps, args.warmup, args.batch, args.new_tokens),
        "generation": lambda: generation(args.batch, args.new_tokens),
        "train_step": lambda: train_bench.time_sizes("cuda", ["qwen2-0.5B"], TIMED)[0],
        "logprob_memory": logprob_memory,
        "planner_0.5b": lambda: planner_check(args.batch, args.new_tokens, res["ppo"]["mean"]),
        "ppo_1.5b": lambda: ppo(args.steps, args.warmup, args.batch, args.new_tokens, QWEN25_15B),
        "planner_1.5b": lambda: planner_check(
            args.batch, args.new_tokens, res["ppo_1.5b"]["mean"], QWEN25_15B
        ),
        "hf_static": lambda: hf_static(res["generation"]),
        "transports": lambda: transports(args.steps, args.warmup, args.batch, args.new_tokens),
        "colocated_move": lambda: colocated_move(res["commit"]),
        "moe_layer": lambda: moe_layer(res["commit"]),
        "moe_model": lambda: moe_model(res["commit"]),
        "hybrid_model": lambda: hybrid_model(res["commit"]),
    }
    for name, measure in parts.items():
        if (name == "ppo" and args.skip_ppo) or name in args.skip:
            res["errors"][name] = "not run in this call (--skip)"
            continue
        try:  # each part measures and is written at once, whatever the next one does
            res[name] = measure()
            if name == "ppo":
                res["params"] = res["ppo"]["params"]
            print(res[name], flush=True)
        except Exception as e:
            traceback.print_exc()
            res["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        torch.cuda.empty_cache()
        text = report(res)
        write_results(args.page, text, res, res["commit"])
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            for suffix in ("md", "json"):
                src = REPO / "docs" / "benchmarks" / f"{args.page}.{suffix}"
                (args.out / f"{args.page}.{suffix}").write_text(src.read_text())
    print(report(res))


if __name__ == "__main__":
    main()
