"""DeepSpeed ZeRO as a real training engine in role groups of 2 actors: ZeRO-1, 2 and 3 train
like the torch engine, resume from their own checkpoints, and a ZeRO-3 group's flat slices move
bit for bit into a tensor-parallel layout."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from conftest import PPO_CALLS, REPO, needs_deepspeed
from trace_support import assert_trace_is_priced
from transformers import AutoModelForCausalLM

import rayhf
from rayhf.errors import RayhfError


def _sft(tmp_path, name: str, **extra):
    """examples/sft_tiny.yaml for 3 steps, the train call data-parallel over 2 actors."""
    ov = {
        "run_dir": str(tmp_path / name),
        "steps": 3,
        "batch_size": 8,
        "eval_every": 0,
        "save_every": 1,
        "dataset.path": str(tmp_path / "data" / "sft.parquet"),
        "dataset.eval_path": str(tmp_path / "data" / "sft_eval.parquet"),
        "metrics.console": False,
        "metrics.ray_metrics": False,
        "metrics.plot": False,
        "plan": {"actor_train": {"dp": 2}},
        **extra,
    }
    return rayhf.load_config(REPO / "examples" / "sft_tiny.yaml").with_overrides(ov)


def _weights(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()


@needs_deepspeed
@pytest.mark.ray
def test_zero_stages_train_as_the_torch_engine_does_and_resume(ray_cluster, tmp_path):
    from rayhf.runtime.trainer import run

    torch_run = run(_sft(tmp_path, "torch"))
    ref = _weights(torch_run.policy_checkpoint)
    assert len(torch_run.metrics) == 3
    for stage, offload in ((1, False), (2, False), (2, True), (3, False)):
        engines = {"actor_train": {"engine": "deepspeed", "zero_stage": stage, "offload": offload}}
        result = run(_sft(tmp_path, f"zero{stage}{'_offload' if offload else ''}", engines=engines))
        for mine, theirs in zip(result.metrics, torch_run.metrics, strict=True):
            assert mine["nll"] == pytest.approx(theirs["nll"], abs=1e-5), (stage, mine["step"])
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        got = _weights(result.policy_checkpoint)  # ZeRO-3: gathered from both ranks' slices
        assert max(float((got[k] - ref[k]).abs().max()) for k in ref) < 1e-5, stage
    # ZeRO-3's optimizer state comes back from DeepSpeed's own checkpoint: step 3 again from
    # step 2 gives step 3's loss (a fresh Adam would not)
    again = tmp_path / "zero3_again"
    shutil.copytree(tmp_path / "zero3", again)
    shutil.rmtree(again / "checkpoints" / "step_000003")
    assert (again / "checkpoints" / "step_000002" / "optim" / "actor" / "deepspeed").is_dir()
    resumed = run(resume=again)
    assert resumed.info["start_step"] == 2.0
    assert resumed.metrics[-1]["nll"] == pytest.approx(result.metrics[-1]["nll"], abs=1e-6)
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3]


@needs_deepspeed
@pytest.mark.ray
def test_lora_adapters_train_on_zero1_and_2_as_on_the_torch_engine(ray_cluster, tmp_path):
    """The frozen weights stay where they are, DeepSpeed's optimizer holds the adapters alone,
    and they step as the torch engine steps them."""
    from rayhf.runtime.trainer import run

    lora = {"models.actor.lora.rank": 4}
    torch_run = run(_sft(tmp_path, "lora_torch", **lora))
    init = _weights(torch_run.run_dir / "init" / "actor")
    ref = _adapter(torch_run.policy_checkpoint)
    for stage in (1, 2):
        engines = {"actor_train": {"engine": "deepspeed", "zero_stage": stage}}
        result = run(_sft(tmp_path, f"lora_zero{stage}", engines=engines, **lora))
        for mine, theirs in zip(result.metrics, torch_run.metrics, strict=True):
            assert mine["nll"] == pytest.approx(theirs["nll"], abs=1e-5), (stage, mine["step"])
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        got = _adapter(result.policy_checkpoint)
        assert got.keys() == ref.keys() and len(got) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
        assert max(float((got[k] - ref[k]).abs().max()) for k in ref) < 1e-5, stage
        assert any(float(got[k].abs().max()) > 0 for k in got if ".lora_B." in k)  # trained
        base = _weights(result.policy_checkpoint)
        assert all(torch.equal(base[k], init[k]) for k in init), stage  # frozen


def _adapter(checkpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rayhf.models.files import ADAPTER_DIR
    from rayhf.models.lora import ADAPTER_FILE

    return load_file(str(checkpoint / ADAPTER_DIR / ADAPTER_FILE))


@needs_deepspeed
@pytest.mark.ray
def test_zero3_slices_move_bit_exactly_into_a_tp2_layout(ray_cluster, tiny_config):
    import ray

    from rayhf.runtime.assets import prepare_run
    from rayhf.runtime.session import Session
    from rayhf.runtime.trainer import RunLoop

    cfg = tiny_config(
        steps=1,
        engines={"actor_train": {"engine": "deepspeed", "zero_stage": 3}},
        plan={"actor_train": {"mesh": [0, 1], "dp": 2}, "actor_gen": {"mesh": [2, 3], "tp": 2},
              "ref_inf": {"mesh": [0, 1], "dp": 2}, "rew_inf": {"mesh": [0, 1], "dp": 2},
              "critic_inf": {"mesh": [0, 1], "dp": 2}, "critic_train": {"mesh": [0, 1], "dp": 2}},
        **{"cluster.n_devices": 4},
    )  # fmt: skip
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        home, ref = session.groups["actor"], session.groups["ref"]
        (gen,) = [g for g in session.copies.values() if g.role == "actor"]
        assert home.flat and not gen.flat and gen.layout.tp == 2

        def whole(group):  # every rank calls (a collective); rank 0 holds the whole model
            return ray.get([a.get_weights.remote() for a in group.actors])[0]

        init = _weights(assets.model_dirs["actor"])
        first = whole(ref)  # ref's weights came by init_from: from the actor's flat slices
        assert all(torch.equal(first[k], init[k]) for k in init)
        RunLoop(cfg, assets, session).loop(0)  # one PPO step: ZeRO-3 trains the actor
        assert_trace_is_priced(cfg, assets)  # ZeRO-3 home, a tp2 generation copy
        session.mover.move(home, gen, assets.specs["actor"])
        src, dst = whole(home), whole(gen)
        assert not torch.equal(src["model.embed_tokens.weight"], init["model.embed_tokens.weight"])
        assert src.keys() == dst.keys()
        assert all(torch.equal(src[k], dst[k]) for k in src), "the move is bit-exact"
        sizes = [w.bytes for w in ray.get([a.weights_summary.remote() for a in home.actors])]
        whole_copy = ray.get(ref.actors[0].weights_summary.remote()).bytes
        assert max(sizes) < 0.6 * whole_copy, "each ZeRO-3 rank holds about half of the weights"


def test_asking_for_deepspeed_without_it_names_the_extra(tmp_path, tiny_config, monkeypatch):
    from rayhf.runtime.assets import prepare_run

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a)
    )
    cfg = tiny_config(plan="colocated", engines={"actor_train": {"engine": "deepspeed"}})
    needle = r"^engines.actor_train.engine: DeepSpeed is not installed: "
    with pytest.raises(RayhfError, match=needle + r"pip install 'rayhf\[deepspeed\]'$"):
        prepare_run(cfg, cfg.resolved_run_dir())
    monkeypatch.setattr(importlib.util, "find_spec", real)
    plan = {c: {"dp": 2} for c in PPO_CALLS} | {"actor_train": {"tp": 2}}
    tp = tiny_config(
        engines={"actor_train": {"engine": "deepspeed"}}, plan=plan, **{"cluster.n_devices": 2}
    )
    with pytest.raises(RayhfError, match=r"engines.actor_train.engine: DeepSpeed ZeRO shards"):
        prepare_run(tp, tp.resolved_run_dir())
    both = tiny_config(
        plan="colocated", engines={"actor_train": {"engine": "deepspeed"}},
        **{"models.actor.optimizer.zero1": True},
    )  # fmt: skip
    with pytest.raises(RayhfError, match=r"models.actor.optimizer.zero1: .* remove zero1"):
        prepare_run(both, both.resolved_run_dir())
    z3 = tiny_config(
        plan="colocated",
        engines={"critic_train": {"engine": "deepspeed", "zero_stage": 3}},
        **{"models.critic.init_from": "actor", "models.critic.init": None},
    )
    with pytest.raises(RayhfError, match=r"engines.critic_train.zero_stage: a ZeRO-3 role"):
        prepare_run(z3, z3.resolved_run_dir())
    shared = tiny_config(
        plan="colocated", engines={"actor_train": {"engine": "deepspeed", "zero_stage": 3}}
    )
    with pytest.raises(RayhfError, match=r"^plan.actor_gen: role 'actor' trains on ZeRO-3 "):
        prepare_run(shared, shared.resolved_run_dir())
    wrong = r"engines.actor_train.zero_stage: not a setting of engine 'torch': zero_stage is a"
    with pytest.raises(RayhfError, match=wrong + r" setting of engine 'deepspeed'$"):
        tiny_config(engines={"actor_train": {"engine": "torch", "zero_stage": 3}})


@needs_deepspeed
@pytest.mark.ray
def test_a_zero2_role_trains_from_the_weights_it_receives(ray_cluster, tiny_config):
    """init_from into a ZeRO-2 role: the received weights become DeepSpeed's master copy, so
    the first step moves them a little instead of restoring the random ones it was built with."""
    import ray

    from rayhf.runtime.assets import prepare_run
    from rayhf.runtime.session import Session
    from rayhf.runtime.trainer import RunLoop

    cfg = tiny_config(
        steps=1, plan="colocated",
        engines={"actor_train": {"engine": "deepspeed", "zero_stage": 2}},
        **{"models.ref.init_from": None, "models.ref.init": {"family": "llama", "hidden_size": 64,
           "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seed": 11},
           "models.actor.init_from": "ref", "models.actor.init": None},
    )  # fmt: skip
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        actor, ref = session.groups["actor"], session.groups["ref"]
        start = ray.get(ref.actors[0].get_weights.remote())
        got = ray.get(actor.actors[0].get_weights.remote())
        assert all(torch.equal(got[k], start[k]) for k in start)
        RunLoop(cfg, assets, session).loop(0)
        after = ray.get(actor.actors[0].get_weights.remote())  # a group of one rank
    moved = max(float((after[k] - start[k]).abs().max()) for k in start)
    assert 0 < moved < 0.05, "one small step away from the received weights"


@needs_deepspeed
@pytest.mark.ray
def test_zero3_trains_a_step_ahead_as_the_torch_engine_does(ray_cluster, tiny_config, tmp_path):
    """max_staleness 1 with the actor's train call in a ZeRO-3 group of 2 (recomputing the
    proximal log-probs over its slices): the same numbers as the torch engine. With 4 samples
    over 2 ranks some minibatches are empty; they do not dilute the stats (at staleness 0 every
    importance weight is 1)."""
    plan = {c: {"mesh": [0]} for c in PPO_CALLS}
    plan["actor_train"] = {"mesh": [1, 2], "dp": 2}

    def run(name: str, **engines: object) -> list[dict]:
        cfg = tiny_config(
            steps=2, save_every=0, plan=plan, engines=engines,
            **{"cluster.n_devices": 3, "algorithm.max_staleness": 1},
        )  # fmt: skip
        return rayhf.run(cfg.with_overrides({"run_dir": str(tmp_path / name)})).metrics

    torch_rows = run("torch")
    zero3_rows = run("zero3", actor_train={"engine": "deepspeed", "zero_stage": 3})
    assert [r["async/staleness"] for r in zero3_rows] == [0.0, 1.0]
    assert zero3_rows[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    for mine, theirs in zip(zero3_rows, torch_rows, strict=True):
        for key in ("policy_loss", "is_weight_mean", "is_weight_max", "logprob_mismatch"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
