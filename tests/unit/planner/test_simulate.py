"""The simulator (``rayhf.planner.simulate``): calls on shared devices serialize, disjoint
ones overlap, reallocations and memory peaks appear where a plan implies them (no Ray)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from planner_support import GRAPH, SPECS, WORKS

from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.shapes import public_shape
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import AnalyticCost
from rayhf.planner.hardware import cpu_cluster, parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import energy
from rayhf.planner.simulate import Carried, realloc_seconds, simulate
from rayhf.planner.step import StepOptions
from rayhf.realloc.plan import CHUNK_BYTES, plan_realloc


def _plan(layout_of) -> Plan:
    return Plan({c.name: layout_of(c) for c in GRAPH.calls}, "test")


def test_simulator_overlaps_disjoint_meshes_and_serializes_shared_ones():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    shared = _plan(lambda c: Layout(tuple(range(8)), 4, 2))
    sim = simulate(Problem(GRAPH, SPECS, WORKS, cost), shared)
    calls = [s for s in sim.spans if s.iteration == 0 and not s.name.startswith("realloc")]
    for a, b in itertools.pairwise(calls):
        assert b.start >= a.end - 1e-12, "calls on the same devices run one after another"
    split = {"ref": (0, 1, 2, 3), "critic": (4, 5, 6, 7)}  # each role at home on its own half
    apart = _plan(lambda c: Layout(split[c.role], 2, 2) if c.role in split else
                  Layout(tuple(range(8)), 4, 2))  # fmt: skip
    spans = {
        s.name: s
        for s in simulate(Problem(GRAPH, SPECS, WORKS, cost), apart).spans
        if s.iteration == 0
    }
    ref, critic = spans["ref_inf"], spans["critic_inf"]
    assert ref.start < critic.end and critic.start < ref.end, "disjoint meshes overlap in time"
    # On-policy: no actor call of iteration 1 starts before the actor trained in iteration 0.
    train0 = next(s for s in sim.spans if s.name == "actor_train" and s.iteration == 0)
    gen1 = next(s for s in sim.spans if s.name == "actor_gen" and s.iteration == 1)
    assert gen1.start >= train0.end


def test_reallocation_appears_when_a_role_changes_layout():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    plan = _plan(lambda c: Layout(tuple(range(8)), 8) if c.name == "actor_gen"
                 else Layout(tuple(range(8)), 2, 4))  # fmt: skip
    sim = simulate(Problem(GRAPH, SPECS, WORKS, cost), plan, n_iterations=2)
    moves = [s for s in sim.spans if s.name == "realloc:actor_gen"]
    assert len(moves) == 2 and all(m.end > m.start for m in moves)


def test_a_move_is_priced_as_the_plan_routes_it():
    """The busiest device's bytes at the link bandwidth, the relays' pipeline fill and a
    latency per hop: one device to eight replicas costs one copy of the model, not seven."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec = public_shape("llama2-7b")
    one, eight = Layout((0,), 1), Layout(tuple(range(8)), 8)
    plan = plan_realloc(spec, one, eight, cost.weight_bytes(spec))
    assert plan.max_sent == plan.max_received and plan.depth == 7
    bw, hop = cost.cluster.bandwidth(tuple(range(8))), cost.cluster.link_latency
    local = plan.local[0]  # device 0 also copies the model into its own replica
    want = (plan.max_sent + local + 6 * CHUNK_BYTES) / bw + 7 * hop
    assert realloc_seconds(cost, spec, one, eight) == pytest.approx(want)
    assert realloc_seconds(cost, spec, one, eight) < 3 * plan.max_received / bw  # not 7 + 1
    # from ZeRO-3's flat slices on the eight devices (each holds an eighth of every tensor)
    tp2 = Layout((0, 1), 1, 2)
    plan = plan_realloc(spec, eight, tp2, cost.weight_bytes(spec), src_flat=True)
    busiest = max(max(plan.sent.get(d, 0), plan.received.get(d, 0)) + plan.local.get(d, 0)
                  for d in range(8))  # fmt: skip
    fill = max(_hops_before_last(s) * min(CHUNK_BYTES, s.nbytes) for s in plan.streams)
    want = (busiest + fill) / bw + max(1, plan.depth) * hop
    assert realloc_seconds(cost, spec, eight, tp2, Carried(flat=True)) == pytest.approx(want)


def test_a_small_relayed_stream_fills_the_pipeline_with_itself_not_a_whole_message():
    """A stream smaller than a message is its own first message: the relays wait for it, not
    for 4 MiB, once per hop before the last."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    one, eight = Layout((0,), 1), Layout(tuple(range(8)), 8)
    init = ModelInit(family="llama", n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2)
    spec = model_spec(hf_config(init, 37, 0, 2, 1), value_head=False)
    plan = plan_realloc(spec, one, eight, cost.weight_bytes(spec))
    assert plan.depth == 7 and max(s.nbytes for s in plan.streams) < CHUNK_BYTES
    # a copy between two processes on one device (device 0) is no hop of the pipeline
    local = [
        s
        for s in plan.streams
        if len(s.hops) == 1 and one.mesh[s.sender] == eight.mesh[s.hops[0][1]]
    ]
    fill = max(_hops_before_last(s) * s.nbytes for s in plan.streams if s not in local)
    bw, hop = cost.cluster.bandwidth(tuple(range(8))), cost.cluster.link_latency
    want = (plan.max_sent + plan.local[0] + fill) / bw + 7 * hop
    assert realloc_seconds(cost, spec, one, eight) == pytest.approx(want)
    assert fill < 6 * CHUNK_BYTES


def test_role_groups_sharing_gpus_move_at_the_staged_speed_and_disjoint_ones_over_nvlink():
    """NCCL refuses two ranks on one GPU, so groups whose meshes overlap stage every message
    through host memory (priced at the speed measured for it); disjoint meshes use NVLink; on
    one GPU with CUDA IPC, device copies. (A ``--cluster`` not at hand prices NVLink for all.)"""
    from rayhf.planner.hardware import GPU_STAGED_BANDWIDTH, gpu_cluster

    gpus = gpu_cluster(8, "NVIDIA H100 80GB HBM3")
    assert gpus is not None
    cost = AnalyticCost(gpus)
    spec = public_shape("llama2-7b")
    tp2, dp2, other = Layout((0, 1), 1, 2), Layout((0, 1), 2), Layout((2, 3), 2)
    staged = plan_realloc(spec, tp2, dp2, cost.weight_bytes(spec))
    busiest = max(max(staged.sent.get(d, 0), staged.received.get(d, 0)) + staged.local.get(d, 0)
                  for d in (0, 1))  # fmt: skip
    hops = max(1, staged.depth) * cost.cluster.link_latency
    want = busiest / GPU_STAGED_BANDWIDTH + hops
    assert realloc_seconds(cost, spec, tp2, dp2) == pytest.approx(want)
    assert realloc_seconds(cost, spec, tp2, other) < want / 20, "NVLink: about 100x the rate"
    datasheet = AnalyticCost(parse_cluster("1x8xH100"))
    assert realloc_seconds(datasheet, spec, tp2, dp2) < want / 20
    one, moved = Layout((0,), 1), Layout((0,), 1)
    for ipc, rate in ((False, GPU_STAGED_BANDWIDTH), (True, 3.35e12 / 4)):
        gpu = gpu_cluster(1, "NVIDIA H100 80GB HBM3", ipc=ipc)
        assert gpu is not None
        got = realloc_seconds(AnalyticCost(gpu), spec, one, moved)
        plan = plan_realloc(spec, one, moved, cost.weight_bytes(spec))
        assert got == pytest.approx(plan.local[0] / rate + gpu.link_latency)


def test_a_large_move_between_emulated_devices_is_priced_at_shared_memory_speed():
    """On one host a move's large messages go through shared memory (relays pass headers on):
    the busiest device's bytes at the copy speed measured for it; a tiny model's move still
    takes the links, and so does every move with ``driver.same_host_transport: group``."""
    from rayhf.planner.hardware import CPU_SHM_BANDWIDTH, cpu_cluster
    from rayhf.realloc.plan import SHM_MIN_BYTES

    shm, sockets = AnalyticCost(cpu_cluster(4, 4.0, 2)), AnalyticCost(cpu_cluster(4, 4.0, 2, False))
    tp2, dp4 = Layout((0, 1), 1, 2), Layout((0, 1, 2, 3), 4)
    init = ModelInit(family="llama", n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=4)
    big = model_spec(hf_config(init, 8192, 0, 2, 1), value_head=False)
    plan = plan_realloc(big, tp2, dp4, shm.weight_bytes(big))
    busiest = max(max(plan.sent.get(d, 0), plan.received.get(d, 0)) + plan.local.get(d, 0)
                  for d in range(4))  # fmt: skip
    assert busiest >= SHM_MIN_BYTES
    hops = max(1, plan.depth) * shm.cluster.link_latency
    assert realloc_seconds(shm, big, tp2, dp4) == pytest.approx(busiest / CPU_SHM_BANDWIDTH + hops)
    assert realloc_seconds(sockets, big, tp2, dp4) > 5 * realloc_seconds(shm, big, tp2, dp4)
    small = ModelInit(family="llama", n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2)
    tiny = model_spec(hf_config(small, 37, 0, 2, 1), value_head=False)
    assert realloc_seconds(shm, tiny, tp2, dp4) == realloc_seconds(sockets, tiny, tp2, dp4)


def _hops_before_last(s) -> int:
    """A stream's depth (its hops form a tree from the sender, -1) less one."""
    level = {-1: 0}
    for a, b in s.hops:
        level[b] = level[a] + 1
    return max(level.values()) - 1


def test_a_plan_over_memory_is_infeasible():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    crammed = _plan(lambda c: Layout((0,), 1))
    sim = simulate(Problem(GRAPH, SPECS, WORKS, cost), crammed)
    assert not sim.feasible and sim.over_memory[0][1] == 0
    assert energy(sim, 80e9) > 10 * sim.iteration_seconds


def test_a_lora_actor_s_copy_keeps_its_weights_and_receives_only_its_adapters():
    """Generation on a copy of a LoRA actor: the move before it is priced at the adapters' bytes
    (the copy keeps the frozen weights), and those weights count on its devices all the time."""
    from rayhf.models.lora import LoraConfig, with_lora

    cost = AnalyticCost(parse_cluster("1x8xH100"))
    lora = with_lora(SPECS["actor"], LoraConfig(rank=16), "models.actor.lora")
    full, adapted = Problem(GRAPH, SPECS, WORKS, cost), Problem(GRAPH, {**SPECS, "actor": lora},
                                                                 WORKS, cost)  # fmt: skip
    assert adapted.adapters == {"actor"} and not full.adapters
    home, copy = Layout((0, 1, 2, 3), 1, 4), Layout((4, 5, 6, 7), 4)
    plan = _plan(lambda c: copy if c.name == "actor_gen" else home)
    moved = {}
    for name, problem in (("full", full), ("lora", adapted)):
        sim = simulate(problem, plan, n_iterations=2)
        (move,) = [s for s in sim.spans if s.name == "realloc:actor_gen" and s.iteration == 1]
        moved[name] = move.end - move.start
        gen = cost.memory(problem.specs["actor"], copy, WORKS["actor_gen"])
        assert sim.peak_memory[4] == pytest.approx(gen), "the copy's devices hold the call alone"
    adapters = realloc_seconds(cost, lora, home, copy, Carried(skip_frozen=True))
    assert moved["lora"] == pytest.approx(adapters)
    assert moved["lora"] < moved["full"] / 20
    # the copy is never released: on devices a later call shares, its weights are still there
    shared = _plan(lambda c: copy if c.name in ("actor_gen", "critic_inf") else home)
    with_copy, without = (simulate(p, shared).peak_memory[4] for p in (adapted, full))
    kept = cost.resident(lora, copy, False)
    critic = cost.memory(SPECS["critic"], copy, WORKS["critic_inf"])
    assert with_copy >= kept + critic - 1 and without < kept + critic


def test_a_lora_copy_on_devices_it_would_overflow_is_released_and_refilled_whole():
    """Kept, the copy's weights would overflow its devices: the plan releases it, it fits,
    and the move before it is priced as the whole model's."""
    from rayhf.models.lora import LoraConfig, with_lora
    from rayhf.planner.simulate import _memory, released

    cost = AnalyticCost(parse_cluster("1x8xH100"))
    lora = with_lora(SPECS["actor"], LoraConfig(rank=16), "models.actor.lora")
    problem = Problem(GRAPH, {**SPECS, "actor": lora}, WORKS, cost)
    for home, copy, drop in (
        (Layout((0, 1, 2, 3), 1, 4), Layout((0, 1, 2, 3), 4), {"actor_gen"}),
        (Layout(tuple(range(8)), 2, 4), Layout(tuple(range(8)), 8), set()),  # room to keep it
    ):
        plan = _plan(lambda c, h=home, g=copy: g if c.name == "actor_gen" else h)
        assert bool(_memory(problem, plan)[1]) == bool(drop), "kept, it would overflow"
        assert released(problem, plan).released == drop
        sim = simulate(problem, plan, n_iterations=2)
        assert sim.feasible and sim.released == drop
        (move,) = [s for s in sim.spans if s.name == "realloc:actor_gen" and s.iteration == 1]
        whole = realloc_seconds(cost, lora, home, copy)
        alone = realloc_seconds(cost, lora, home, copy, Carried(skip_frozen=True))
        assert move.end - move.start == pytest.approx(whole if drop else alone)
    assert json.loads(dataclasses.replace(plan, released=frozenset({"actor_gen"})).to_json())[
        "actor_gen"
    ]["release"]


def test_a_call_at_home_of_a_trained_role_still_counts_its_cache():
    """Generation at the actor's home layout adds its KV cache on top of the resident state."""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    lay = Layout(tuple(range(16)), 2, 8)
    plan = _plan(lambda c: lay)
    sim = simulate(Problem(GRAPH, SPECS, WORKS, cost), plan)
    resident = sum(cost.resident(SPECS[r], lay, r in ("actor", "critic")) for r in SPECS)
    gen = cost.memory(SPECS["actor"], lay, WORKS["actor_gen"]) - cost.resident(
        SPECS["actor"], lay, False
    )
    assert gen > 0 and sim.peak_memory[0] >= resident + gen - 1


def test_overlapped_steps_are_priced_as_the_driver_runs_them_and_barriers_when_asked():
    """A split plan gains from overlapping steps, a shared one cannot; one step at a time costs
    its makespan; EMA blends are priced units."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    half = {"actor": (0, 1, 2, 3), "ref": (0, 1, 2, 3)}
    split = _plan(lambda c: Layout(half.get(c.role, (4, 5, 6, 7)), 4))
    ema = StepOptions({"actor": [("ref", 0.1)]})
    specs = {**SPECS, "critic": public_shape("llama2-13b", value_head=True)}  # trains longer
    over = simulate(Problem(GRAPH, specs, WORKS, cost, step=ema), split)
    barrier = simulate(
        Problem(GRAPH, specs, WORKS, cost, step=StepOptions(ema.followers, False)), split
    )
    first = [s for s in barrier.spans if s.iteration == 0]
    makespan = max(s.end for s in first)
    assert abs(barrier.iteration_seconds - makespan) < 1e-9
    assert over.iteration_seconds < barrier.iteration_seconds
    assert "ema:ref" in [s.name for s in first]
    gen1 = next(s for s in over.spans if s.name == "actor_gen" and s.iteration == 1)
    critic0 = next(s for s in over.spans if s.name == "critic_train" and s.iteration == 0)
    blend0 = next(s for s in over.spans if s.name == "ema:ref" and s.iteration == 0)
    assert gen1.start < critic0.end and gen1.start >= blend0.end
    shared = _plan(lambda c: Layout(tuple(range(8)), 8))
    a, b = (
        simulate(
            Problem(GRAPH, SPECS, WORKS, cost, step=StepOptions(overlap=o)), shared
        ).iteration_seconds
        for o in (True, False)
    )
    assert abs(a - b) < 1e-9, "on shared devices nothing can overlap"


def test_open_zero_stages_take_the_fastest_that_fits_and_dp_only_for_deepspeed():
    """A train call whose workload leaves the stage open runs at the fastest stage that fits;
    where its devices overflow, a higher one; stages 2-3 (DeepSpeed) only on dp-only layouts;
    a stage the plan names is kept."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    works = {
        n: dataclasses.replace(w, zero_choices=(0, 1, 2, 3)) if w.kind == "train" else w
        for n, w in WORKS.items()
    }
    dp = _plan(lambda c: Layout(tuple(range(8)), 8))
    sim = simulate(Problem(GRAPH, SPECS, works, cost), dp)
    assert sim.stages["actor_train"] == 2  # dp only: stage 1 overflows, 3 is refused (shared)
    tp = _plan(lambda c: Layout(tuple(range(8)), 2, 4))
    assert set(simulate(Problem(GRAPH, SPECS, works, cost), tp).stages.values()) <= {0, 1}
    own = Plan({**dp.layouts, "actor_gen": Layout(tuple(range(8)), 2, 4)}, "test")
    assert simulate(Problem(GRAPH, SPECS, works, cost), own).stages["actor_train"] == 3
    named = Plan(dp.layouts, "test", {"actor_train": 1})
    assert simulate(Problem(GRAPH, SPECS, works, cost), named).stages["actor_train"] == 1
    assert (
        simulate(Problem(GRAPH, SPECS, WORKS, cost), dp).stages == {}
    )  # nothing open, nothing chosen
    roomy = AnalyticCost(cpu_cluster(8, 1e15))  # where every stage fits, a tie goes down
    one = _plan(lambda c: Layout((0,), 1))
    assert set(simulate(Problem(GRAPH, SPECS, works, roomy), one).stages.values()) == {0}
    assert simulate(Problem(GRAPH, SPECS, works, roomy), dp).stages["actor_train"] == 1  # 2 ties it


def test_emulated_devices_share_the_hosts_cores_among_units_that_run_together():
    """4 emulated devices on 2 cores: a unit on all 4 runs at half speed, units on one device
    each share the cores while they overlap, and a plan on one device is priced as before."""
    own = AnalyticCost(cpu_cluster(4, 1e6))
    shared = AnalyticCost(cpu_cluster(4, 1e6, cores=2))

    def seconds(plan: Plan, cost: AnalyticCost) -> float:
        return simulate(Problem(GRAPH, SPECS, WORKS, cost), plan).iteration_seconds

    alone = _plan(lambda c: Layout((0,), 1))
    assert seconds(alone, shared) == pytest.approx(seconds(alone, own))
    every = _plan(lambda c: Layout((0, 1, 2, 3), 4))
    assert seconds(every, shared) == pytest.approx(2 * seconds(every, own))
    split = {"actor": (0,), "ref": (1,), "critic": (2,), "reward": (3,)}
    apart = _plan(lambda c: Layout(split[c.role], 1))
    assert seconds(apart, own) < seconds(apart, shared) < 2 * seconds(apart, own)


def test_staleness_lets_generation_run_beside_training_and_each_batch_lags_at_most_k():
    """On a disjoint plan (generation on its own devices) k=1 runs step i+1's generation while
    step i's other calls run, so a period costs the busier side's work instead of the sum; a
    larger k adds nothing more; on a shared plan it gains nothing."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    gen_side = Layout((0, 1, 2, 3), 4)
    disjoint = _plan(lambda c: gen_side if c.name == "actor_gen" else Layout((4, 5, 6, 7), 4))
    sims = {
        k: simulate(Problem(GRAPH, SPECS, WORKS, cost, step=StepOptions(staleness=k)), disjoint)
        for k in (0, 1, 2)
    }
    on, one, two = (sims[k].iteration_seconds for k in (0, 1, 2))
    spans = sims[1].spans
    rest_side = sum(s.end - s.start for s in spans if s.iteration == 4 and 4 in s.devices)
    gen_seconds = next(s.end - s.start for s in spans if s.name == "actor_gen")
    assert abs(one - rest_side) < 1e-6 * on, "the busier side sets the period"
    assert abs(on - (one + gen_seconds)) < 1e-6 * on and abs(two - one) < 1e-6 * on
    for it in range(2, 5):  # period it: the generation of step it + 1 beside the rest of step it
        gen = next(s for s in spans if s.name == "actor_gen" and s.iteration == it)
        rew = next(s for s in spans if s.name == "rew_inf" and s.iteration == it)
        train_before = next(s for s in spans if s.name == "actor_train" and s.iteration == it - 1)
        assert gen.start < rew.end and gen.end > rew.start, "they run side by side"
        assert gen.start >= train_before.end, "it waits for the update of step it - 1"
    shared = _plan(lambda c: Layout(tuple(range(8)), 8))
    a, b = (
        simulate(
            Problem(GRAPH, SPECS, WORKS, cost, step=StepOptions(staleness=k)), shared
        ).iteration_seconds
        for k in (0, 1)
    )
    assert abs(a - b) < 1e-6 * a, "on shared devices nothing can overlap"
