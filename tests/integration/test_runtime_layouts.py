"""PPO on Ray role groups whose roles run tensor- and pipeline-parallel layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import alive_actors
from trace_support import assert_trace_is_priced
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rayhf.metrics.trace import TRACE_FILE, read_trace
from rayhf.runtime.assets import prepare_run
from rayhf.runtime.session import Session
from rayhf.runtime.trainer import RunLoop

pytestmark = pytest.mark.ray

PLAN = {
    "actor_gen": {"tp": 2},
    "actor_train": {"tp": 2},
    "critic_inf": {"pp": 2, "n_microbatches": 2},
    "critic_train": {"pp": 2, "n_microbatches": 2},
    "ref_inf": {"dp": 2},
    "rew_inf": {"dp": 2},
}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_with_a_tp2_actor_and_a_pp2_critic(ray_cluster, tiny_config):
    import ray

    cfg = tiny_config(steps=2, plan=PLAN, **{"cluster.n_devices": 2})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        alive = alive_actors()
        assert {"actor.d0-1.dp1tp2pp1[0]", "actor.d0-1.dp1tp2pp1[1]"} <= alive
        assert {"critic.d0-1.dp1tp1pp2[0]", "critic.d0-1.dp1tp1pp2[1]"} <= alive
        actor, ref, critic = (session.groups[r] for r in ("actor", "ref", "critic"))
        # Each tp rank holds about half the actor; the dp ref ranks hold all of it.
        actor_bytes = [w.bytes for w in ray.get([a.weights_summary.remote() for a in actor.actors])]
        ref_bytes = ray.get(ref.actors[0].weights_summary.remote()).bytes
        assert max(actor_bytes) < 0.6 * ref_bytes
        # The ref was copied from the actor's gathered shards: the same whole model.
        gathered = ray.get([a.get_weights.remote() for a in actor.actors])[0]
        assert _same(gathered, ray.get(ref.replica(0)[0].get_weights.remote()))
        trainer = RunLoop(cfg, assets, session)
        trainer.loop(0)
        actor_after = ray.get([a.get_weights.remote() for a in actor.actors])[0]
        critic_after = ray.get([a.get_weights.remote() for a in critic.actors])[0]
    assert not _same(gathered, actor_after), "the tp=2 actor did not train"
    # The trace shows every call of every step, in graph order, with its role and layout.
    events = read_trace(Path(cfg.resolved_run_dir()) / TRACE_FILE)
    done = [e for e in events if e["pid"] == 0 and e["ph"] == "X" and e["args"]["phase"] == "train"]
    order = assets.graph.order
    assert [(e["args"]["step"], e["name"]) for e in done] == [(s, c) for s in (1, 2) for c in order]
    assert_trace_is_priced(cfg, assets)  # the units the planner prices, tp and pp included
    layouts = {e["name"]: e["args"]["layout"] for e in done}
    assert layouts["actor_gen"] == layouts["actor_train"] == "d0-1.dp1tp2pp1"
    assert layouts["critic_train"] == "d0-1.dp1tp1pp2" and layouts["ref_inf"] == "d0-1.dp2tp1pp1"
    assert {e["args"]["role"] for e in done} == {"actor", "critic", "ref", "reward"}
    # A call runs after the calls it reads from (a span joins all ranks, and each rank waits
    # only for its sources' head ranks and its own device, so spans of different ranks may
    # touch), the step's calls start in graph order, and step 2 starts after step 1's training.
    span = {(e["args"]["step"], e["name"]): (e["ts"], e["ts"] + e["dur"]) for e in done}
    for src, dst in assets.graph.edges:
        for step in (1, 2):
            (a0, a1), (b0, b1) = span[step, src], span[step, dst]
            assert a0 <= b0 and a1 <= b1, f"{dst} ran before {src}"
    starts = sorted(done, key=lambda e: e["ts"])
    assert [(e["args"]["step"], e["name"]) for e in starts] == [
        (s, c) for s in (1, 2) for c in order
    ]
    for role in ("actor", "critic"):  # on-policy: a role's step 2 starts after it trained
        calls = assets.graph.role_calls(role)
        trained = max(span[1, c][1] for c in calls if assets.graph.by_name[c].kind == "train")
        assert all(trained <= span[2, c][0] + 1 for c in calls), role
    # Ray's own task events are merged in: the actors' dag_call tasks under the calls' spans
    ray_tasks = [e for e in events if str(e["pid"]).startswith("ray") and "dag_call" in e["cat"]]
    assert len(ray_tasks) >= len(done), "every rank's dag_call task is in the trace"
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "critic.d0-1.dp1tp1pp2" in tracks
    ckpt = Path(cfg.resolved_run_dir()) / "checkpoints" / "step_000002"
    # Checkpoints hold the whole model in Hugging Face format, gathered from the shards.
    saved = AutoModelForCausalLM.from_pretrained(ckpt / "actor", local_files_only=True)
    assert _same(dict(saved.state_dict()), actor_after)
    saved_critic = AutoModelForSequenceClassification.from_pretrained(
        ckpt / "critic", local_files_only=True, num_labels=1
    )
    assert _same(dict(saved_critic.state_dict()), critic_after)
    init_critic = AutoModelForSequenceClassification.from_pretrained(
        Path(cfg.resolved_run_dir()) / "init" / "critic", local_files_only=True, num_labels=1
    )
    assert not _same(dict(init_critic.state_dict()), critic_after), "the pp=2 critic did not train"
    # Each rank saved its own optimizer shard.
    for role in ("actor", "critic"):
        shards = [torch.load(ckpt / "optim" / f"{role}.rank{r}.pt") for r in (0, 1)]
        sizes = [
            sum(s["exp_avg"].numel() for s in o["optimizer"]["state"].values()) for o in shards
        ]
        assert all(n > 0 for n in sizes), role


def test_actor_generates_on_a_reallocated_copy_and_the_reference_follows_by_ema(
    ray_cluster, tiny_config
):
    """The actor trains at tp = 2 and generates on a dp = 2 copy; the reference and the critic
    split each sequence over their 2 ranks (cp = 2), the reference following the actor by EMA
    into that layout."""
    import json

    import ray

    plan = {c: {"dp": 2} for c in PLAN}
    plan["actor_train"] = {"tp": 2}
    for call in ("ref_inf", "critic_inf", "critic_train"):
        plan[call] = {"dp": 2, "cp": 2}
    cfg = tiny_config(steps=1, plan=plan, **{"cluster.n_devices": 2, "models.ref.ema": 0.25})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        assert {"ref.d0-1.dp2tp1pp1cp2[1]", "critic.d0-1.dp2tp1pp1cp2[1]"} <= alive_actors()
        critic = session.groups["critic"]
        critic_before = ray.get(critic.actors[0].weights_summary.remote()).digest
        home, ref = session.groups["actor"], session.groups["ref"]
        copy = session.copies["actor.d0-1.dp2tp1pp1"]
        assert home.layout.tp == 2 and copy.layout.dp == 2
        actor_before = ray.get([a.get_weights.remote() for a in home.actors])[0]
        ref_before = ray.get(ref.actors[0].get_weights.remote())
        assert _same(actor_before, ref_before), "the ref starts as the actor, by reallocation"
        RunLoop(cfg, assets, session).loop(0)
        actor_after = ray.get([a.get_weights.remote() for a in home.actors])[0]
        ref_after = ray.get(ref.actors[0].get_weights.remote())
        critic_after = {
            w.digest for w in ray.get([a.weights_summary.remote() for a in critic.actors])
        }
        copy_bytes = [w.bytes for w in ray.get([a.weights_summary.remote() for a in copy.actors])]
    assert not _same(actor_before, actor_after)
    # the critic's two ranks each saw half of every sequence and summed their gradients
    assert len(critic_after) == 1 and critic_before not in critic_after
    expected = {
        k: v.clone().mul_(0.75).add_(actor_after[k], alpha=0.25) for k, v in ref_before.items()
    }
    assert _same(ref_after, expected), "ref = 0.25 * actor + 0.75 * ref, exactly"
    assert copy_bytes == [0, 0], "the generation copy is dropped after its call"
    row = json.loads((Path(cfg.resolved_run_dir()) / "metrics.jsonl").read_text().splitlines()[0])
    # the reference scores the samples at the weights that drew them, each sequence split
    assert row["step"] == 1 and abs(row["kl"]) < 1e-5, row["kl"]
    # the two replicas' shares balance tokens, against what equal counts of rows would give;
    # the reference's cp group takes the whole batch: no split to report
    balanced, by_rows = (row[f"dp_{k}_max_over_mean/rew_inf"] for k in ("tokens", "by_rows"))
    assert 1.0 <= balanced <= by_rows and "dp_tokens_max_over_mean/ref_inf" not in row
    # each call's fullest device: a process of its own, its interpreter and weights included
    modelled = [c for c in assets.graph.order if assets.graph.by_name[c].role in assets.specs]
    assert len(modelled) == 5 and all(0.1 < row[f"peak_memory_gb/{c}"] < 4 for c in modelled)
    moved = session.mover.plan(assets.specs["actor"], home.layout, copy.layout).total_bytes
    assert row["realloc_bytes/actor_gen"] == moved
    assert row["realloc_seconds/actor_gen"] > 0
    assert row["realloc_bytes/ref_ema"] > 0
    events = read_trace(Path(cfg.resolved_run_dir()) / TRACE_FILE)
    moves = {e["name"]: e for e in events if e.get("cat") == "realloc"}
    calls = {e["name"]: e for e in events if e.get("cat") == "call"}
    assert moves["realloc:actor_gen"]["args"]["bytes"] == moved
    assert moves["realloc:actor_gen"]["args"]["layout"] == "d0-1.dp1tp2pp1 -> d0-1.dp2tp1pp1"
    # A span joins all ranks, and each rank waits only for its own device's part of the unit
    # before it (the exact weights above show what arrived): the move starts and ends before the
    # call, the blend starts and ends after training.
    gen, ema = moves["realloc:actor_gen"], moves["ema:ref"]
    use, train = calls["actor_gen"], calls["actor_train"]
    assert gen["ts"] <= use["ts"] and gen["ts"] + gen["dur"] <= use["ts"] + use["dur"]
    assert train["ts"] <= ema["ts"] and train["ts"] + train["dur"] <= ema["ts"] + ema["dur"]


EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MOE = {"family": "qwen3_moe", "n_heads": 4, "n_kv_heads": 2, "config": EXPERTS}
EP_PLAN = {
    "actor_gen": {"dp": 2},
    "actor_train": {"dp": 2, "ep": 2},
    "ref_inf": {"mesh": [1, 0], "dp": 2, "ep": 2},  # its ranks on the devices the other way
    "critic_inf": {"dp": 2},
    "critic_train": {"dp": 2},
    "rew_inf": {"dp": 2},
}


def test_an_moe_actor_trains_and_scores_with_its_experts_split_over_ranks(ray_cluster, tiny_config):
    """A Qwen3-MoE actor: each of its 2 train ranks and the reference's holds half of every
    layer's experts (ep = 2), the generator all of them (weights moved between the two each
    step); the trainer's log-probs of the sampled tokens are the generator's, each token goes
    to the experts the generator chose for it (routing replay, under packing and ep = 2, the
    reference's ranks on the devices in the other order), and the checkpoint is the trained
    model, whole."""
    import json

    import ray

    replay = {"models.actor.init": MOE, "algorithm.router_replay": "replay"}
    cfg = tiny_config(steps=2, plan=EP_PLAN, **{"cluster.n_devices": 2, **replay})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        alive = alive_actors()
        assert {"actor.d0-1.dp2tp1pp1ep2[0]", "actor.d0-1.dp2tp1pp1ep2[1]"} <= alive
        assert {"actor.d0-1.dp2tp1pp1[0]", "ref.d1_0.dp2tp1pp1ep2[1]"} <= alive
        split = session.groups["actor"].actors[0]
        whole = next(g for g in session.all_groups() if g.layout.ep == 1 and g.role == "actor")
        split_bytes = ray.get(split.weights_summary.remote()).bytes
        whole_bytes = ray.get(whole.actors[0].weights_summary.remote()).bytes
        assert split_bytes < 0.8 * whole_bytes  # half the experts, the rest whole
        RunLoop(cfg, assets, session).loop(0)
        trained = ray.get([a.get_weights.remote() for a in session.groups["actor"].actors])[0]
    rows = [json.loads(line) for line in (Path(cfg.resolved_run_dir()) / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert len(steps) == 2 and all(r["logprob_mismatch"] < 1e-5 for r in steps)
    assert all(r["routes_differ"] == 0.0 and r["routes_differ_own"] < 0.05 for r in steps)
    saved = Path(cfg.resolved_run_dir()) / "checkpoints" / "step_000002" / "actor"
    hf = AutoModelForCausalLM.from_pretrained(saved)
    assert _same({k: v.float() for k, v in hf.state_dict().items()}, trained)
