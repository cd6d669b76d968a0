"""Train-step and decode throughput of a ~50M-parameter Llama under every layout of <= 2 devices.

    python benchmarks/parallel_layouts.py [--layers 12] [--reps 3]

Each layout runs as gloo processes with one thread each (one emulated device = one core here);
the reference is the same model as a plain single-process Hugging Face model (1 thread, and 2
threads: the same cores a 2-device layout gets). Train step: forward + backward + AdamW on
8 sequences x 128 tokens (a dp replica gets its share). Decode: greedy, 8 prompts of 16 tokens,
32 new tokens each, KV cache. Writes docs/benchmarks/parallel_layouts.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import write_results

VOCAB, ROWS, SEQ, PROMPT, NEW = 8192, 8, 128, 16, 32


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def _model(layers: int):
    from rayhf.models.files import quiet_transformers
    from rayhf.models.hf import ModelInit, build_model, hf_config

    quiet_transformers()
    init = ModelInit(family="llama", hidden_size=512, n_layers=layers, n_heads=8, seed=0)
    return build_model(hf_config(init, VOCAB, 0, 2, 1), value_head=False).eval()


def _data():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=gen)
    prompts = torch.randint(3, VOCAB, (ROWS, PROMPT), generator=gen).tolist()
    return ids, prompts


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()


def _timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reference(layers: int, threads: int, reps: int) -> dict:
    from rayhf.sampling import GenerationConfig, generate

    torch.set_num_threads(threads)
    model, (ids, prompts) = _model(layers), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train() -> None:
        opt.zero_grad()
        _loss(model(input_ids=ids).logits, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    return {
        "train_s": _timed(train, reps),
        "decode_s": _timed(lambda: generate(model, prompts, greedy, 1, 0), reps),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _layout_worker(rank: int, layout: tuple[int, int, int], args: tuple, out: str) -> None:
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.build import standalone_engine
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.parallel.groups import build_groups, join_store, leave_spawned
    from rayhf.sampling import GenerationConfig

    address, layers, reps = args
    dp, tp, pp = layout
    world = dp * tp * pp
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=world)
    groups = build_groups(dp, tp, pp, rank)
    ids, prompts = _data()
    share = slice(groups.coords.dp_rank * ROWS // dp, (groups.coords.dp_rank + 1) * ROWS // dp)
    ids, prompts = ids[share], prompts[share]
    mask = torch.ones_like(ids)
    optim = OptimizerConfig(lr=1e-5)
    engine = standalone_engine(_model(layers), _Tok(), False, optim, groups, n_microbatches=2)
    batch = PackedBatch(list(range(len(prompts))))

    def train() -> None:
        engine.train([batch], lambda _: (_loss(engine.forward(ids, mask), ids), {}))

    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    result = {
        "train_s": _timed(train, reps),
        "decode_s": _timed(lambda: engine.generate(prompts, greedy, 0), reps),
        "bytes": engine.model.local_bytes(),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    leave_spawned()


def _run_layout(layout: tuple[int, int, int], layers: int, reps: int, tmp: Path) -> dict:
    from rayhf.parallel.groups import host_store

    _store, address = host_store()  # open here while the ranks meet through it
    out = tmp / f"layout_{'_'.join(map(str, layout))}.json"
    world = layout[0] * layout[1] * layout[2]
    mp.spawn(_layout_worker, args=(layout, (address, layers, reps), str(out)), nprocs=world)
    return json.loads(out.read_text())


def report(res: dict) -> str:
    tokens, decoded = ROWS * SEQ, ROWS * NEW
    lines = [
        f"# dp x tp x pp throughput, {res['params'] / 1e6:.1f}M-parameter Llama "
        f"({res['layers']} layers, hidden 512, vocab {VOCAB})",
        "",
        f"Command: `python benchmarks/parallel_layouts.py --layers {res['layers']} "
        f"--reps {res['reps']}` on {os.cpu_count()} CPU cores; one thread per device.",
        "",
        "| layout | devices | train step s | train tokens/s | decode tokens/s | param MB/device |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in res["rows"].items():
        mb = r.get("bytes", 4 * res["params"]) / 2**20
        lines.append(
            f"| {name} | {r['devices']} | {r['train_s']:.2f} | {tokens / r['train_s']:.0f} | "
            f"{decoded / r['decode_s']:.0f} | {mb:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "rayhf_bench_layouts"
    tmp.mkdir(exist_ok=True)
    rows: dict[str, dict] = {}
    ref1 = _reference(args.layers, 1, args.reps)
    rows["Hugging Face, 1 process, 1 thread"] = {**ref1, "devices": 1}
    rows["Hugging Face, 1 process, 2 threads"] = {
        **_reference(args.layers, 2, args.reps),
        "devices": 2,
    }
    for layout in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]:
        dp, tp, pp = layout
        rows[f"rayhf dp{dp} tp{tp} pp{pp}"] = {
            **_run_layout(layout, args.layers, args.reps, tmp),
            "devices": dp * tp * pp,
        }
    res = {"params": ref1["params"], "layers": args.layers, "reps": args.reps, "rows": rows}
    text = report(res)
    print(text)
    write_results("parallel_layouts", text, res)


if __name__ == "__main__":
    main()
