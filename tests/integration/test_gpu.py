"""The CUDA paths on a real GPU (marked ``gpu``; skipped where torch sees none, as in CI).

Run on a lent GPU machine with ``source scripts/gpu_env.sh install; pytest -m gpu
tests/integration/test_gpu.py``. One GPU: NCCL groups are groups of one (NCCL refuses two ranks
on one GPU), and role groups colocated on it move weights over gloo through host memory.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from parity_support import TOLERANCES

import rayhf
from rayhf.checks.parity import CASES
from rayhf.parallel.groups import host_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(900),
]

REPO = Path(__file__).resolve().parents[2]


def test_every_family_matches_hugging_face_on_cuda_in_fp32_and_bf16(tmp_path):
    """The sharded model (NCCL group of one) against Hugging Face's on the GPU: logits, critic
    values, gradients, one AdamW step and greedy generation, in fp32 and bf16."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "rayhf.checks.parity", str(out), "--world", "1"]
    subprocess.run([*cmd, "--device", "cuda"], check=True, timeout=900)
    rows = json.loads(out.read_text())
    assert {(r["family"], r["precision"]) for r in rows} == {
        (f, p) for f in CASES for p in TOLERANCES
    }
    for r in rows:  # the CPU harness's bounds, on CUDA kernels
        tol = TOLERANCES[r["precision"]]
        assert r["device"] == "cuda:0"
        assert r["logits"] <= tol.logits and r["values"] <= tol.values, r
        assert r["scores"] <= tol.logits, r
        assert r["grads"] <= tol.grads and r["step_off"] <= tol.step_off, r
        assert r["generate"] >= tol.same_tokens, r
        assert r["moved"] > 0, "the step changed no weight"


def _cuda_generator(hf, **numerics):
    from rayhf.checks.common import Tok
    from rayhf.engines.native import NativeGenerator
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.precision import Numerics

    model = RankModel.from_hf(hf, Tok(), False, device="cuda", numerics=Numerics(**numerics))
    return NativeGenerator(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma2"])
def test_the_captured_decode_step_matches_hugging_face_and_follows_weight_moves(family):
    """fp32 on the GPU, the step replayed from CUDA graphs: greedy tokens as Hugging Face's
    ``generate``, sampled tokens and log-probs as the whole-model sampler's for the same seed;
    new weights copied in place are used by the same graphs, new storage is captured again."""
    from rayhf.checks.common import EOS, PAD, tiny_model
    from rayhf.sampling import GenerationConfig
    from rayhf.sampling import generate as reference

    shape = dict(CASES[family].shape)
    hf = tiny_model(family, shape, seed=3).cuda()
    with torch.no_grad():  # large weights: trajectories differ from token to token
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    gen = _cuda_generator(hf)
    assert gen.engine.options.capture
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11], [3, 4, 5], [12, 13]]
    greedy = GenerationConfig(max_new_tokens=12, greedy=True)
    out = gen.generate(prompts, greedy, 0)
    for prompt, tokens in zip(prompts, out.tokens, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            eos_token_id=EOS, pad_token_id=PAD,
        )  # fmt: skip
        assert tokens == ref[0, len(prompt) :].tolist()[: len(tokens)]
    assert gen.engine.graphs, "the steps ran from captured graphs"
    sampled = GenerationConfig(max_new_tokens=12, temperature=1.3, top_k=8, min_new_tokens=2)
    got, want = gen.generate(prompts, sampled, 5), reference(hf, prompts, sampled, EOS, PAD, 5)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    graphs = dict(gen.engine.graphs)
    other = tiny_model(family, shape, seed=4).cuda()
    gen.model.load_full_state(other.state_dict())  # a move into the same storage
    moved = gen.generate(prompts, greedy, 0)
    assert moved.tokens == reference(other, prompts, greedy, EOS, PAD, 0).tokens
    assert all(gen.engine.graphs.get(k) is g for k, g in graphs.items() if k in gen.engine.graphs)
    gen.model.release()  # a copy's weights dropped, then refilled: new storage
    gen.model.load_full_state(hf.state_dict())
    assert gen.generate(prompts, greedy, 0).tokens == out.tokens


def test_a_trained_actor_generates_with_its_trainer_s_log_probs_in_bf16():
    """fp32 master weights under bf16 autocast (a trained role on the GPU): the captured
    step's log-probs against a full forward of the same model over prompt + response."""
    from rayhf.checks.common import PAD, tiny_model
    from rayhf.sampling import GenerationConfig

    hf = tiny_model("qwen2", {"n_heads": 4, "n_kv_heads": 2}, seed=2)
    gen = _cuda_generator(hf, precision="bf16", master=True)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]] * 4
    out = gen.generate(prompts, GenerationConfig(max_new_tokens=24, min_new_tokens=24), 1)
    rows = [p + t for p, t in zip(prompts, out.tokens, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], device="cuda")
    mask = (torch.arange(width, device="cuda")[None] < torch.tensor([len(r) for r in rows],
            device="cuda")[:, None]).long()  # fmt: skip
    with torch.no_grad():
        logits = gen.model.forward(ids, mask).float().log_softmax(-1)
    gaps = []
    for i, (p, t) in enumerate(zip(prompts, out.tokens, strict=True)):
        start = len(p) - 1
        full = logits[i, start : start + len(t)].gather(-1, torch.tensor(t, device="cuda")[:, None])
        gaps += (full.squeeze(-1).cpu() - torch.tensor(out.logprobs[i])).abs().tolist()
    mean = sum(gaps) / len(gaps)
    print(f"generator-trainer log-prob mismatch: mean {mean:.2e}, max {max(gaps):.2e}")
    assert mean < 2e-2 and max(gaps) < 0.25


def _staged_pair(rank: int, address: str, errors) -> None:
    from rayhf.parallel.groups import join_store
    from rayhf.realloc.transport import TransferGroup

    torch.cuda.set_device(0)  # both ranks on the one GPU
    try:
        group = TransferGroup(join_store(address), rank, 2, "cuda", shared_devices=True)
        for dtype in (torch.float32, torch.bfloat16):
            want = torch.arange(3 * 2**20, device="cuda").to(dtype) / 7
            if rank == 0:
                group.isend(want, 1, 0).wait()
            else:
                got = torch.zeros_like(want)
                group.irecv(got, 0, 0).wait()
                assert got.is_cuda and torch.equal(got, want), f"{dtype} slice changed on the way"
    except Exception as e:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}: {e!r}")


def test_role_groups_on_one_gpu_move_weights_through_host_memory():
    """Two processes on the same GPU: NCCL would refuse them; the staged gloo group moves fp32
    and bf16 GPU tensors bit-exactly."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    _store, address = host_store()  # open here while the ranks meet through it
    procs = [ctx.Process(target=_staged_pair, args=(r, address, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0, 0]


def test_relayed_reallocation_of_gpu_tensors_is_bit_exact_on_every_rank(tmp_path):
    """The reallocation harness with every model on the GPU: 8 processes share it, so the
    transfer group stages each message through host memory, relays forwarding what they got;
    every destination rank's shards and gathered model equal the source's bit for bit, through
    pinned buffers over gloo, through the senders' shared-memory segments, and through their
    segments on the GPU opened by CUDA IPC handle (``rayhf.realloc.cuda_ipc``)."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "rayhf.checks.reallocation", str(out), "--pairs", "16"]
    subprocess.run([*cmd, "--device", "cuda"], check=True, timeout=600)
    rows = json.loads(out.read_text())
    assert len(rows) == 32 and {r["device"] for r in rows} == {"cuda"}
    assert any(r["relayed"] for r in rows) and any(r["flat"] for r in rows)
    through_shm = [r for r in rows if r["transport"] == "shm"]  # every third pair
    assert len(through_shm) == 11 and all(r["shm_messages"] > 0 for r in through_shm)
    through_ipc = [r for r in rows if r["transport"] == "ipc"]  # all 8 ranks on one GPU
    assert len(through_ipc) == 10
    assert all(r["ipc_messages"] > 0 and r["shm_messages"] == 0 for r in through_ipc)
    assert any(r["relayed"] for r in through_ipc)
    for r in rows:
        pair = f"{r['src']} -> {r['dst']} (flat source: {r['flat']}, {r['transport']})"
        assert r["bit_exact"] and r["gathered_exact"], pair
        assert r["ranks_checked"] == r["dst"][1] * r["dst"][2] * r["dst"][3], pair


@pytest.mark.parametrize("executor", ["plain", "compiled", "plain+ipc"])
def test_ppo_on_one_gpu(tmp_path, executor):
    """`rayhf run` with cluster.device=cuda: every role on the one GPU in bf16 (auto), the
    reference initialised by a move from the actor, the plain (overlapped steps) or compiled
    executor, moves through /dev/shm or CUDA IPC; the actor trains and every metric is
    finite."""
    run = tmp_path / "run"
    extra = ["save_every=3", f"driver.executor={executor.split('+')[0]}"]  # later ones win
    if executor == "compiled":
        extra.append("driver.overlap_steps=false")
    if executor.endswith("+ipc"):
        extra.append("driver.same_host_transport=ipc")
    proc = _run_on_gpu(run, tmp_path / "data.parquet", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    for stats in history:
        numbers = [v for v in stats.values() if isinstance(v, float)]
        assert numbers and all(math.isfinite(v) for v in numbers), stats
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(run / "init" / "actor").state_dict()
    final = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000003" / "actor")
    trained = final.state_dict()
    assert {t.dtype for t in trained.values()} == {torch.float32}, "fp32 master weights saved"
    assert not all(torch.equal(init[k], trained[k]) for k in init), "the actor did not train"


def test_ppo_a_step_ahead_on_one_gpu(tmp_path):
    """`rayhf run` at max_staleness 1 on the GPU: steps 2 and 4 sample on the policy one version
    behind (a checkpoint at step 2 drains the pipeline), the decoupled loss's importance weights
    and the generator-trainer log-prob mismatch are finite, and the mismatch at staleness 0 (bf16
    generator against the trainer's autocast) is below that of every stale step."""
    run = tmp_path / "run"
    proc = _run_on_gpu(run, tmp_path / "data.parquet", "steps=4", "save_every=2",
                       "algorithm.max_staleness=1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("async/staleness", "async/policy_version", "logprob_mismatch", "is_weight_mean",
            "is_weight_max", "clip_frac")  # fmt: skip
    for r in rows:
        print({"step": r["step"], **{k: round(r[k], 6) for k in keys}})
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["async/policy_version"] for r in rows] == [0.0, 0.0, 2.0, 2.0]
    assert all(math.isfinite(r[k]) for r in rows for k in keys)
    fresh, stale = (rows[0], rows[2]), (rows[1], rows[3])
    assert max(r["logprob_mismatch"] for r in fresh) < min(r["logprob_mismatch"] for r in stale)
    assert all(r["is_weight_mean"] > 0 for r in rows)


def _run_on_gpu(run: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    words = [
        "examples/ppo_tiny.yaml", f"run_dir={run}", f"dataset.path={data}",
        "steps=3", "batch_size=8", "save_every=1", "generation.max_new_tokens=8",
        "cluster.device=cuda", "cluster.n_devices=1", "metrics.console=false",
        "metrics.plot=false", "metrics.ray_metrics=false", *extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "rayhf", "run", *words],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_dead_actor_on_a_gpu_is_recovered_to_the_uninterrupted_weights(tmp_path):
    """The actor's rank SIGKILLs itself in step 2 on the GPU; the run recovers from step 1's
    checkpoint by itself and ends with the weights of a run that was never interrupted."""
    from safetensors.torch import load_file

    data = tmp_path / "data.parquet"
    plain = _run_on_gpu(tmp_path / "plain", data)
    assert plain.returncode == 0, plain.stderr[-3000:]
    fault = "fault_tolerance.inject={site: call, step: 2, role: actor}"
    healed = _run_on_gpu(tmp_path / "healed", data, fault)
    assert healed.returncode == 0, healed.stderr[-3000:]
    assert healed.stderr.count("rayhf: recovering (1 of 3)") == 1, healed.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "healed" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]
    final = "checkpoints/step_000003/actor/model.safetensors"
    a, b = load_file(tmp_path / "plain" / final), load_file(tmp_path / "healed" / final)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    worst = max(((a[k] - b[k]).abs().max().item() for k in differ), default=0.0)
    print(f"{len(differ)} of {len(a)} tensors differ after the recovery (largest {worst:.3g})")
    assert not differ


def test_models_are_timed_on_the_gpu_for_plan_auto(tmp_path, monkeypatch):
    """``plan: auto`` on cuda: the roles' shapes timed on the GPU in a process of their own
    (cached under the GPU's name), then searched for two GPUs with the GPU's datasheet."""
    from rayhf.checks.common import tiny_model
    from rayhf.planner.auto import RunDevices, StepBatch, plan_for_run, run_cost, workloads
    from rayhf.planner.cluster import ClusterConfig
    from rayhf.planner.problem import Problem
    from rayhf.runtime.profiling import gpu_profiles

    monkeypatch.setenv("RAYHF_CACHE_DIR", str(tmp_path))
    actor = tiny_model("llama", {"n_heads": 4}).config
    critic = tiny_model("llama", {"n_heads": 4}, value_head=True).config
    configs = {"actor": (actor, False), "ref": (actor, False), "critic": (critic, True),
               "reward": (critic, True)}  # fmt: skip
    measured = gpu_profiles(configs)
    assert measured is not None
    specs, profiles, name = measured
    assert name == torch.cuda.get_device_name(0) and len(profiles) == 2
    for prof in profiles.values():
        assert sum(prof.train.base) + sum(prof.train.layer) > 0, "the train step was timed"
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2
    graph = rayhf.load_graph(REPO / "graphs" / "ppo.yaml")
    works = workloads(graph, StepBatch(64, 24, 128, 4))
    cluster = ClusterConfig(n_devices=2, device="cuda")
    cost = run_cost(RunDevices(cluster, name), profiles)  # None: a kind with no datasheet entry
    if cost is not None:
        plan = plan_for_run(Problem(graph, specs, works, cost))
        assert plan.estimates["auto"] <= plan.estimates["colocated"]
