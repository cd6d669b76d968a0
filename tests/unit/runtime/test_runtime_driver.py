"""The driver's step DAG (``rayhf.runtime.driver``) as pure functions over fake role groups and
results: which actor calls take which arguments, what a step reports, and how a dead actor is
named. No Ray is started."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from runtime_support import PPO, _homes

from rayhf.data.batch import PackedBatch
from rayhf.parallel.layout import Layout
from rayhf.planner.step import StepOptions, group_key
from rayhf.realloc.mover import Routes
from rayhf.realloc.plan import Transfer
from rayhf.runtime.driver import DagExecutor, Placement, StepDag
from rayhf.runtime.messages import CallResult, MoveResult
from rayhf.runtime.waits import died


@dataclass
class FakeGroup:
    """What the DAG builder reads of a role group."""

    role: str
    layout: Layout
    actors: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.actors = [f"{self.key}[{r}]" for r in range(len(self.layout.mesh))]

    @property
    def key(self) -> str:
        return group_key(self.role, self.layout)

    @property
    def ranks_per_replica(self) -> int:
        return self.layout.tp * self.layout.pp

    def actor_name(self, rank: int) -> str:
        return self.actors[rank]


class FakeMover:
    """Every source rank sends one slice to the destination rank with its index."""

    def routes(self, src, dst, spec, skip_frozen=False) -> Routes:
        t = Transfer("w", 0, 0, 1, 0, 0, 0, 0, 4)  # contents do not matter to the DAG's shape
        n = len(dst.actors)
        sends = {r: {n + r: [t]} for r in range(min(len(src.actors), n))}
        return Routes(f"{src.key}+{dst.key}", sends, {r: {r: [t]} for r in range(n)}, "fp32")


def test_dag_nodes_take_their_sources_head_ranks_and_keep_each_actor_in_order():
    tp2 = Layout((0, 1), 1, 2)
    dp2 = Layout((0, 1), 2)
    layouts = {c.name: dp2 for c in PPO.calls} | {"actor_gen": tp2, "actor_train": tp2}
    homes = _homes(layouts)
    groups = {
        g.key: g
        for g in (FakeGroup(c.role, layouts[c.name]) for c in PPO.calls)  # one per role/layout
    }
    placement = Placement(groups, layouts, homes, {}, FakeMover())  # type: ignore[arg-type]
    dag = StepDag(PPO, placement, evaluate=False)
    assert len(dag.nodes) == 2 * len(PPO.calls), "one node per rank of every call"
    index = {(n.info.unit.name, n.info.rank): i for i, n in enumerate(dag.nodes)}
    ref0 = dag.nodes[index["ref_inf", 0]]
    gen_heads = [index["actor_gen", 0]]  # tp=2: one replica, its head is rank 0
    assert set(gen_heads) <= set(ref0.args) and index["actor_gen", 1] not in ref0.args
    last: dict[str, int] = {}
    for i, node in enumerate(dag.nodes):
        name = node.info.actor_name
        if name in last:
            assert last[name] in node.args, f"{node.info.unit.name} does not follow its actor"
        last[name] = i
        assert all(a < i for a in node.args), "arguments come from earlier nodes"


def _placement(followers=None) -> Placement:
    """PPO on two devices: the actor generates data parallel and trains tensor parallel (so a
    move precedes generation), the ref follows the actor by moving average."""
    tp2, dp2 = Layout((0, 1), 1, 2), Layout((0, 1), 2)
    layouts = {c.name: dp2 for c in PPO.calls} | {"actor_train": tp2}
    homes = _homes(layouts)
    groups = {g.key: g for g in (FakeGroup(c.role, layouts[c.name]) for c in PPO.calls)}
    specs = dict.fromkeys(homes)  # FakeMover does not read the shapes
    step = StepOptions(followers or {})
    return Placement(groups, layouts, homes, specs, FakeMover(), step)  # type: ignore[arg-type]


def _results(dag: StepDag, seq: PackedBatch) -> list:
    """Every node's result: calls ran 1 + rank seconds from 1 + rank to 5 + rank (each actor_gen
    replica made its sample's ``seq`` and reports the version its move's senders sent, 7);
    receivers of a move hold their slices at 3.0, its senders return at 10.0."""
    out: list = []
    for node in dag.nodes:
        info = node.info
        name, rank = info.unit.name, info.rank
        if node.method == "dag_call":
            batch = seq.select([rank]) if name == "actor_gen" and info.is_head else None
            stats = {f"{name}/loss": float(rank)} if name.endswith("_train") else {}
            version = 7 if name == "actor_gen" else 0  # on the copy: what its move sent
            out.append(CallResult(name, rank, batch, stats, 1.0 + rank, "torch", 1.0 + rank,
                                  5.0 + rank, version=version))  # fmt: skip
        elif node.method == "dag_recv":
            out.append(MoveResult(name, rank, 4, 0.5, 3.0))
        else:
            out.append(MoveResult(name, rank, 0, 0.0, 10.0, version=7))  # the weights it sent
    return out


def test_the_outcome_reports_every_call_and_move_of_the_step():
    dag = StepDag(PPO, _placement({"actor": [("ref", 0.5)]}), evaluate=False)
    assert [u.name for u in dag.units if u.kind == "realloc"] == ["realloc:actor_gen", "ema:ref"]
    senders = [i for i, n in enumerate(dag.nodes) if n.method == "dag_send"]
    for node in dag.nodes:  # a call on the copy reads its weights' version from the first sender
        if node.info.unit.name == "actor_gen":
            assert senders[0] in node.args and senders[1] not in node.args
    base = PackedBatch([0, 1], {"prompts": torch.arange(4)}, {"prompts": [2, 2]})
    seq = PackedBatch([0, 1], {"seq": torch.arange(6)}, {"seq": [3, 3]})
    out = dag.outcome(9, base, _results(dag, seq))
    assert out.batch.keys() == ["prompts", "seq"] and out.batch.sample_ids == [0, 1]
    assert out.stats == {
        "actor_train/loss": 0.0, "critic_train/loss": 0.0,  # a rank's stats
        # step 9 sampled with the weights of step 7's update (its move's senders held them)
        "async/staleness": 1.0, "async/policy_version": 7.0, "async/staleness_0": 0.0,
    }  # fmt: skip
    gen = next(s for s in out.spans if s.name == "actor_gen")
    assert gen.args == {"engine": "torch", "version": 7, "staleness": 1}
    assert out.compute_seconds == {c.name: 2.0 for c in PPO.calls}, "the slowest rank"
    assert out.wall_seconds == {c.name: 5.0 for c in PPO.calls}, "first start to last end"
    moves = {k: (s.seconds, s.bytes) for k, s in out.reallocs.items()}
    assert moves == {"actor_gen": (3.0, 8), "ref_ema": (3.0, 8)}, "done when received"
    assert [s.name for s in out.spans] == [u.name for u in dag.units]
    move = next(s for s in out.spans if s.name == "realloc:actor_gen")
    assert move.kind == "realloc" and move.layout == "d0-1.dp1tp2pp1 -> d0-1.dp2tp1pp1"
    assert move.track == "actor.d0-1.dp2tp1pp1" and move.args == {"bytes": 8}
    call = next(s for s in out.spans if s.name == "critic_inf")
    assert (call.kind, call.role, call.args) == ("call", "critic", {"engine": "torch"})


def test_evaluation_runs_every_call_in_evaluate_mode_and_blends_nothing():
    executor = DagExecutor(PPO, _placement({"actor": [("ref", 0.5)]}))
    train, evaluate = executor.dag(False), executor.dag(True)
    assert executor.dag(False) is train, "one DAG per mode, built once"
    calls = [n.const for n in evaluate.nodes if n.method == "dag_call"]
    assert calls and all(c.evaluate for c in calls)
    assert not any(n.const.evaluate for n in train.nodes if n.method == "dag_call")
    assert "ema:ref" not in [u.name for u in evaluate.units]
    executor.close()  # nothing compiled: nothing to tear down


@dataclass(frozen=True)
class _Handle:
    """An actor handle as ``failure`` reads it (printed as its name)."""

    name: str

    def __str__(self) -> str:
        return self.name

    @property
    def _actor_id(self) -> SimpleNamespace:
        return SimpleNamespace(hex=lambda: self.name)


class _Died(Exception):
    def __init__(self, actor_id: str) -> None:
        super().__init__("The actor died unexpectedly before finishing this task.\n  details")
        self.actor_id = actor_id
        self.actor_init_failed = False


def test_a_dead_actor_is_named_with_its_role_and_the_unit_it_was_running():
    placement = _placement()
    for group in placement.groups.values():
        group.actors = [_Handle(name) for name in group.actors]  # type: ignore[misc]
    dag = StepDag(PPO, placement, evaluate=False)
    victim = dag.nodes[next(i for i, n in enumerate(dag.nodes) if n.info.unit.name == "critic_inf")]
    name = victim.info.group.actors[1].name
    ran = {i for i, n in enumerate(dag.nodes) if n.info.unit.name == "critic_inf"}
    reason = "(The actor died unexpectedly before finishing this task.)"
    calls = dag.pending([None] * len(dag.nodes))
    assert str(died(_Died(name), calls, ran)) == (  # type: ignore[arg-type]
        f"role 'critic': actor {name} died during call 'critic_train' {reason}"
    )
    everything = set(range(len(dag.nodes)))
    assert "during call 'critic_inf'" in str(died(_Died(name), calls, everything))  # type: ignore[arg-type]
    assert str(died(_Died("elsewhere"), calls, set())) == f"an actor died {reason}"  # type: ignore[arg-type]
    ev = StepDag(PPO, placement, evaluate=True)
    evaluating = ev.pending([None] * len(ev.nodes))
    assert "during eval call 'critic_inf'" in str(died(_Died(name), evaluating, set()))  # type: ignore[arg-type]
