"""Hand-written placements that the search must beat, as plans in the same format.

- ``colocated``: every call on all devices in one shared layout, no reallocation.
- ``verl`` (verl's hybrid engine): every call on all devices; training FSDP-like (dp only,
  ZeRO-3); generation in its own dp x tp layout, the actor resharded into it every step; the
  other calls in layouts of their own on all devices.
- ``openrlhf`` (OpenRLHF): each role on its own devices, generation on engines of its own
  (dp x tp) that the training group broadcasts the weights to; training ZeRO-3.
- ``disjoint``: each role on its own devices, generation on the actor's.
- ``realhf``: ReaLHF's PPO heuristic, as its public code writes it
  (``realhf/experiments/common/ppo_exp.py`` in github.com/openpsi-project/ReaLHF): the rules are
  in ``realhf`` and ``_realhf_plan`` below.
- ``verl_sp4``, where some call's sequences are long: ``verl`` with them split over 4 Ulysses
  ranks, its long-response recipes' degree.

Their ZeRO-3 covers train calls with data-parallel ranks; a one-rank group has nothing to shard,
and its stage is left to the rule that picks every other call's.

Each gets the tuning the search gets: among the layouts its rule allows (tp a power of two
within a node, pp any divisor of what tp leaves, micro-batches, the ZeRO stage where its rule
leaves it open: ``simulate.staged``; a long call's sequence splits: ``search.context_splits``),
the one with the lowest simulated time is kept, call by call; the disjoint ones also move
devices between their groups while that helps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rayhf.graph import Graph
from rayhf.models.sharding import check_layout, param_shards
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import (
    MICRO_BATCHES,
    context_splits,
    energy,
    layouts_on,
    splits_sequences,
)
from rayhf.planner.simulate import simulate

Score = Callable[[Plan], float]
# verl's long-response recipes split sequences over 4 Ulysses ranks: DAPO with Qwen2.5-7B at 8k
# response tokens and with Qwen3-30B-A3B at 20k (``sp_size=4`` in its ``recipe/dapo`` scripts)
RECIPE_ULYSSES = 4
SHORTLIST = 4  # layouts per call tried while the disjoint baselines move devices


@dataclass(frozen=True)
class Setting:
    """What a baseline is built for and tuned by: the problem (graph, models, workloads, the
    cluster) and the score of a plan (lower is better). With ``ranked`` the problem's cost model
    ranks a call's layouts for the disjoint baselines' device moves (without, they try every
    layout)."""

    problem: Problem
    score: Score
    ranked: bool = True

    @classmethod
    def priced(cls, problem: Problem) -> Setting:
        """Scored by the simulator's energy, as the search scores."""
        seen: dict[tuple, float] = {}

        def score(plan: Plan) -> float:
            key = (*(plan.layouts[n] for n in problem.graph.order), *sorted(plan.zero.items()))
            if key not in seen:
                seen[key] = energy(simulate(problem, plan), problem.capacity)
            return seen[key]

        return cls(problem, score)

    @property
    def graph(self) -> Graph:
        return self.problem.graph

    @property
    def specs(self) -> Mapping[str, ModelSpec]:
        return self.problem.specs

    @property
    def works(self) -> Mapping[str, Workload]:
        return self.problem.works

    @property
    def n_devices(self) -> int:
        return self.problem.cluster.n_devices

    @property
    def per_node(self) -> int:
        return self.problem.cluster.devices_per_node

    @property
    def cost(self) -> AnalyticCost | None:
        """The cost model that ranks layouts (None: not ``ranked``)."""
        return self.problem.cost if self.ranked else None

    def spec(self, call: str) -> ModelSpec | None:
        return self.problem.spec(call)

    def trains(self) -> list[str]:
        """The train calls of roles with a model."""
        return [c.name for c in self.graph.calls if c.kind == "train" and self.spec(c.name)]

    def adapters(self) -> bool:
        """Whether some train call's role trains LoRA adapters (on rayhf's torch engine only,
        so at ZeRO stages 0-1: ``open_stages``)."""
        return any((spec := self.spec(t)) is not None and spec.lora for t in self.trains())

    def zero3(self) -> bool:
        """Whether every train call may run ZeRO-3."""
        return all(
            self.works[t].zero_stage == 3 or 3 in self.works[t].zero_choices for t in self.trains()
        )


def _options(s: Setting, name: str, mesh: tuple[int, ...], rule: _Rule) -> list[Layout]:
    """Layouts call ``name`` may take on ``mesh`` under ``rule``: with ``engines`` (verl's and
    OpenRLHF's rules) a train call dp only (ZeRO-3) and generation dp x tp (vLLM's engines);
    with ``megatron`` (verl's Megatron backend, slime) any layout but generation dp x tp
    (vLLM's or SGLang's engines); a long call's sequences split as the search may split them
    (``context_splits``: verl's Ulysses, OpenRLHF's ring attention, Megatron's context
    parallelism), or with ``ulysses`` over that many ranks only (a recipe's degree)."""
    kind = s.graph.by_name[name].kind
    spec = s.spec(name)
    out = layouts_on(mesh, spec, s.per_node)
    if rule.engines and kind == "train":
        out = [lay for lay in out if lay.tp == 1 and lay.pp == 1]
    if (rule.engines or rule.megatron) and kind == "generate":
        out = [lay for lay in out if lay.pp == 1 and (lay.ep == 1 or not rule.megatron)]
    split = context_splits(spec, s.works[name], out)
    if rule.ulysses and split:  # the recipe's degree where it fits, else the most it can
        fixed = [lay for lay in split if lay.cp == rule.ulysses]
        most = max(lay.cp for lay in split)
        return fixed or [lay for lay in split if lay.cp == most]
    return out + split


def _model_takes(plan: Plan, graph: Graph, specs: Mapping[str, ModelSpec]) -> bool:
    """Whether every call's model can take its layout (heads over tp, layers over pp)."""
    return all(
        specs.get(c.role) is None
        or check_layout(specs[c.role], plan.layouts[c.name].tp, plan.layouts[c.name].pp) is None
        for c in graph.calls
    )


def colocated(s: Setting) -> Plan:
    """Every call on every device, one layout for all (the best such layout)."""
    largest = max((p for p in s.specs.values() if p is not None), key=_size)
    options = layouts_on(tuple(range(s.n_devices)), largest, s.per_node)
    fits_all = [
        lay for lay in options
        if all(p is None or check_layout(p, lay.tp, lay.pp) is None for p in s.specs.values())
    ]  # fmt: skip
    plans = [Plan({c.name: lay for c in s.graph.calls}, "colocated") for lay in fits_all]
    return min(plans, key=s.score)


def verl(s: Setting, ulysses: int = 0) -> Plan | None:
    """verl's hybrid engine: every call on every device; train calls dp only at ZeRO-3;
    generation dp x tp; each call tuned in its own layout, long sequences split over Ulysses
    ranks as the search may split them, or with ``ulysses`` over that many (a recipe's
    ``ulysses_sequence_parallel_size``) (None where ZeRO-3 is not open). With LoRA roles, which
    verl trains on FSDP and rayhf on its torch engine, the same layouts at the stages rayhf
    runs adapters at."""
    if not s.zero3() and not s.adapters():
        return None
    every = tuple(range(s.n_devices))
    source = f"verl_sp{ulysses}" if ulysses else "verl"
    rule = _Rule(source, zero3=s.zero3(), engines=True, ulysses=ulysses)
    options = {c.name: _options(s, c.name, every, rule) for c in s.graph.calls}
    return _tune(s, options, rule, passes=2)


def openrlhf(s: Setting) -> Plan | None:
    """OpenRLHF: each role on devices of its own, each generate call on its own too; train calls
    dp only at ZeRO-3, generation dp x tp (None where ZeRO-3 is not open; with LoRA roles, as
    for ``verl``, at the stages rayhf runs adapters at)."""
    if not s.zero3() and not s.adapters():
        return None
    groups: dict[str, list[str]] = {}
    for c in s.graph.calls:
        groups.setdefault(c.name if c.kind == "generate" else c.role, []).append(c.name)
    return _disjoint(s, groups, _Rule("openrlhf", zero3=s.zero3(), engines=True))


def _experts(s: Setting) -> bool:
    return any(spec is not None and spec.moe is not None for spec in s.specs.values())


def verl_megatron(s: Setting) -> Plan | None:
    """verl's Megatron backend, which its Mixture-of-Experts recipes use (Qwen3-30B-A3B,
    GLM-4.5-Air): the hybrid engine, every call on every device; train and inference calls in
    any tp x pp x ep layout, generation dp x tp (vLLM); each call tuned in its own layout.
    (slime's recipes, all ``--colocate``, take the same layouts in this cost model.) None
    without an MoE model: the dense baselines stand as they were measured."""
    if not _experts(s):
        return None
    every = tuple(range(s.n_devices))
    rule = _Rule("verl_megatron", zero3=False, engines=False, megatron=True)
    options = {c.name: _options(s, c.name, every, rule) for c in s.graph.calls}
    return _tune(s, options, rule, passes=2)


def slime(s: Setting) -> Plan | None:
    """slime without ``--colocate``: the generate calls (SGLang, dp x tp) on devices of their
    own, every other call (Megatron: any tp x pp x ep) on the rest, block sizes tuned. None
    without an MoE model."""
    if not _experts(s):
        return None
    groups: dict[str, list[str]] = {}
    for c in s.graph.calls:
        groups.setdefault("rollout" if c.kind == "generate" else "train", []).append(c.name)
    return _disjoint(s, groups, _Rule("slime", zero3=False, engines=False, megatron=True))


def disjoint(s: Setting) -> Plan:
    """Each role on devices of its own (generation on the actor's); stages as the rule picks."""
    groups = {r: s.graph.role_calls(r) for r in s.graph.roles}
    return _disjoint(s, groups, _Rule("disjoint", zero3=False, engines=False))


def _size(spec: ModelSpec) -> int:
    return sum(p.numel for p in param_shards(spec))


def _least_memory(s: Setting, name: str, options: list[Layout]) -> Layout:
    """The option that keeps the least on a device (the most sharded, without a cost model)."""
    spec = s.spec(name)
    if s.cost is None or spec is None:
        return max(options, key=lambda lay: (lay.tp * lay.pp, lay.n_microbatches))
    cost, work = s.cost, s.works[name]
    return min(options, key=lambda lay: cost.least_memory(spec, lay, work))


@dataclass(frozen=True)
class _Rule:
    """What a baseline's rule fixes: the plan's source, whether train calls run ZeRO-3
    wherever they have data-parallel ranks to shard over, and whether its engines' layouts
    apply (``_options``: dp-only training, dp x tp generation), and how it splits long
    sequences (as the search may; with ``ulysses``, over that many ranks only)."""

    source: str
    zero3: bool
    engines: bool
    megatron: bool = False
    ulysses: int = 0


def _tune(s: Setting, options: dict[str, list[Layout]], rule: _Rule, passes: int) -> Plan:
    """Every call from its least-memory option, then each call in turn on the option that
    scores best with the others fixed, ``passes`` times, train calls at ZeRO-3 as ``rule``
    says."""

    def plan(layouts: dict[str, Layout]) -> Plan:
        ordered = {name: layouts[name] for name in s.graph.order}
        zero = {t: 3 for t in s.trains() if rule.zero3 and layouts[t].dp > 1}
        return Plan(ordered, rule.source, zero)

    fixed = {name: _least_memory(s, name, opts) for name, opts in options.items()}
    for _ in range(passes):
        for name in s.graph.order:
            trials = [plan({**fixed, name: lay}) for lay in options[name]]
            fixed = dict(min(trials, key=s.score).layouts)
    return plan(fixed)


def _disjoint(s: Setting, groups: dict[str, list[str]], rule: _Rule) -> Plan:
    """Groups of calls on disjoint device blocks (sized at first by their models' parameters,
    trained ones thrice), each call tuned on its group's block; then a block grows at another's
    expense (a node, or half of a smaller block) while the plan gets faster."""
    modelled = {g: calls for g, calls in groups.items() if any(s.spec(c) for c in calls)}
    weight = {g: sum(_weight(s, c) for c in calls) for g, calls in modelled.items()}
    total = sum(weight.values())
    shares = {g: _block_size(s.n_devices * weight[g] / total, s) for g in modelled}
    while sum(shares.values()) > s.n_devices and max(shares.values()) > 1:
        biggest = max(shares, key=lambda g: shares[g])
        shares[biggest] = _smaller(shares[biggest], s)
    best = _on_blocks(s, groups, shares, rule, quick=True)
    best_e = s.score(best)
    for _ in range(4 * len(shares)):
        moved = False
        for trial in _share_moves(shares, s):
            plan = _on_blocks(s, groups, trial, rule, quick=True)
            e = s.score(plan)
            if e < best_e:
                best, best_e, shares, moved = plan, e, trial, True
                break
        if not moved:
            break
    return _on_blocks(s, groups, shares, rule, quick=False)


def _weight(s: Setting, name: str) -> int:
    """A call's share of the devices at first: its model's parameters, thrice to train."""
    spec = s.spec(name)
    return 0 if spec is None else _size(spec) * (3 if s.graph.by_name[name].kind == "train" else 1)


def _block_size(devices: float, s: Setting) -> int:
    """A block size at or below ``devices``: a power of two within a node, or whole nodes."""
    if devices >= s.per_node:
        return s.per_node * max(1, int(devices // s.per_node))
    return max(1, 2 ** int(math.log2(max(1.0, devices))))


def _smaller(size: int, s: Setting) -> int:
    return size - s.per_node if size > s.per_node else max(1, size // 2)


def _larger(size: int, s: Setting) -> int:
    return size + s.per_node if size >= s.per_node else size * 2


def _share_moves(shares: dict[str, int], s: Setting):
    """Block sizes with one group grown by a step, the devices taken from idle ones, or from
    one group shrunk by as many steps as it takes, or from two groups shrunk a step each."""
    free = s.n_devices - sum(shares.values())
    for a in shares:
        grown = {**shares, a: _larger(shares[a], s)}
        need = grown[a] - shares[a] - free
        if need <= 0:
            yield grown
            continue
        others = [b for b in shares if b != a]
        for b in others:
            size = shares[b]
            while size > 1 and shares[b] - size < need:
                size = _smaller(size, s)
            if shares[b] - size >= need:
                yield {**grown, b: size}
        for b, c in itertools.combinations(others, 2):
            sb, sc = _smaller(shares[b], s), _smaller(shares[c], s)
            if sb < shares[b] and sc < shares[c] and shares[b] - sb + shares[c] - sc >= need:
                yield {**grown, b: sb, c: sc}


def _on_blocks(
    s: Setting, groups: dict[str, list[str]], shares: dict[str, int], rule: _Rule, quick: bool
) -> Plan:
    """Blocks laid out largest first (with more groups than devices they wrap around and
    share); each call tuned on its group's block (``quick``: one pass over a shortlist)."""
    start, meshes = 0, {}
    for g in sorted(shares, key=lambda g: -shares[g]):
        start = start if start + shares[g] <= s.n_devices else 0
        meshes[g] = tuple(range(start, start + shares[g]))
        start += shares[g]
    options: dict[str, list[Layout]] = {}
    for g, calls in groups.items():
        for name in calls:
            opts = _options(s, name, meshes[g], rule) if g in meshes else [Layout((0,), 1)]
            options[name] = _shortlist(s, name, opts) if quick else opts
    return _tune(s, options, rule, passes=1 if quick else 2)


def _shortlist(s: Setting, name: str, options: list[Layout]) -> list[Layout]:
    """The ``SHORTLIST`` fastest options that fit alone, and the least-memory one."""
    spec = s.spec(name)
    if s.cost is None or spec is None or len(options) <= SHORTLIST:
        return options
    cost, work, cap = s.cost, s.works[name], s.cost.cluster.device.memory_bytes
    fits = [lay for lay in options if cost.least_memory(spec, lay, work) <= cap]
    fastest = sorted(fits, key=lambda lay: cost.call(spec, lay, work).seconds)[:SHORTLIST]
    least = _least_memory(s, name, options)
    return fastest + ([least] if least not in fastest else [])


def realhf(s: Setting) -> Plan | None:
    """ReaLHF's PPO heuristic (its public ``realhf/experiments/common/ppo_exp.py`` rules), for
    nodes of 8 devices; None for other graphs or node sizes."""
    graph, specs = s.graph, s.specs
    if s.per_node != 8 or not {"actor_gen", "actor_train", "critic_train"} <= set(graph.by_name):
        return None
    plans = [_realhf_plan(graph, specs, s.n_devices // 8, k) for k in MICRO_BATCHES]
    plans = [p for p in plans if _model_takes(p, graph, specs)]
    return min(plans, key=s.score) if plans else None  # its fixed tp/pp exceed a small model


def _realhf_plan(
    graph: Graph, specs: Mapping[str, ModelSpec], n_nodes: int, n_microbatches: int
) -> Plan:
    n = 8 * n_nodes
    every = tuple(range(n))
    actor, critic = specs.get("actor"), specs.get("critic")
    a = _size(actor) if actor is not None else 1
    c = _size(critic) if critic is not None else 1
    gen_pp = max(2, n_nodes)
    lay = {"actor_gen": Layout(every, n // gen_pp, 1, gen_pp, n_microbatches)}
    if n_nodes == 1:
        first, second = tuple(range(4)), tuple(range(4, 8))
        tp = 4 if a > 8e9 else 2
        lay["actor_train"] = Layout(first, 4 // tp, tp, 1, n_microbatches)
        lay["critic_train"] = Layout(second, 4 // tp, tp, 1, n_microbatches)
        lay["rew_inf"], lay["critic_inf"] = Layout(first, 2, 2), Layout(second, 2, 2)
        lay["ref_inf"] = Layout(every, 4, 2)
    else:
        actor_nodes = min(n_nodes - 1, math.ceil(n_nodes * a / (a + c)))
        blocks = {
            "actor_train": tuple(range(8 * actor_nodes)),
            "critic_train": tuple(range(8 * actor_nodes, n)),
            "ref_inf": every,
            "rew_inf": tuple(range(n // 2)),
            "critic_inf": tuple(range(n // 2, n)),
        }
        for name, mesh in blocks.items():
            lay[name] = Layout(mesh, 2, 4, len(mesh) // 8, n_microbatches)
    return Plan({call.name: lay[call.name] for call in graph.calls}, "realhf")


def build_all(s: Setting) -> dict[str, Plan | None]:
    """Every baseline for ``s`` (None: its rules give no plan for this graph, cluster or
    engines)."""
    out = {
        "colocated": colocated(s),
        "verl": verl(s),
        "openrlhf": openrlhf(s),
        "disjoint": disjoint(s),
        "realhf": realhf(s),
    }
    if _experts(s):  # the peers' MoE recipes' rules
        out |= {"verl_megatron": verl_megatron(s), "slime": slime(s)}
    if any(map(splits_sequences, s.works.values())):  # verl at its recipes' Ulysses degree
        out["verl_sp4"] = verl(s, RECIPE_ULYSSES)
    return out
