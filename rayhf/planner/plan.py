"""Plans: the layout of every call, from the config (manual), the colocated placement, or the
search (``rayhf.planner.auto``); whatever makes the plan, the runtime only reads ``Plan``.

A role's *home* layout holds its weights (and optimizer): the layout of its train call, or of
its first call if it is not trained. A call in another layout runs on a copy
that reallocation fills from the home layout before the call and that is dropped after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from rayhf.errors import RayhfError
from rayhf.graph import Graph
from rayhf.models.sharding import check_layout
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.layout import LayoutSpec, layout_from_spec
from rayhf.planner.step import StepOptions, plan_step
from rayhf.realloc.plan import plan_realloc

PlanConfig = Literal["auto", "colocated"] | dict[str, LayoutSpec]


@dataclass(frozen=True)
class Plan:
    """Call name -> layout, and where the plan came from."""

    layouts: dict[str, Layout]
    source: str  # "colocated", "auto" or "manual"
    zero: dict[str, int] = field(default_factory=dict)  # train call -> the ZeRO stage it gets
    # calls on a copy of a LoRA role that drops its weights after the call, so the move before
    # it carries the whole model (else the copy keeps its frozen weights: the adapters move)
    released: frozenset[str] = frozenset()
    # a searched plan's estimated seconds per step, and the colocated plan's ("auto",
    # "colocated"), under the cost the search used; not saved with the plan
    estimates: dict[str, float] = field(default_factory=dict)

    def home_layouts(self, graph: Graph) -> dict[str, Layout]:
        """Where each role's weights live: its train call's layout, else its first call's."""
        homes: dict[str, Layout] = {}
        for name in graph.order:
            call = graph.by_name[name]
            if call.kind == "train" or call.role not in homes:
                homes[call.role] = self.layouts[name]
        return homes

    def role_layouts(self, graph: Graph) -> dict[str, list[Layout]]:
        """Every distinct layout each role runs in, its home layout first."""
        out: dict[str, list[Layout]] = {r: [lay] for r, lay in self.home_layouts(graph).items()}
        for name in graph.order:
            lay = self.layouts[name]
            if lay not in out[graph.by_name[name].role]:
                out[graph.by_name[name].role].append(lay)
        return out

    def reallocations(self, graph: Graph) -> list[tuple[str, Layout, Layout]]:
        """(call, home layout, call layout) for every call that runs away from its role's home."""
        homes = self.home_layouts(graph)
        return [
            (name, homes[graph.by_name[name].role], self.layouts[name])
            for name in graph.order
            if self.layouts[name] != homes[graph.by_name[name].role]
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                name: {
                    "mesh": list(lay.mesh),
                    "dp": lay.dp,
                    "tp": lay.tp,
                    "pp": lay.pp,
                    "n_microbatches": lay.n_microbatches,
                    **({"ep": lay.ep} if lay.ep > 1 else {}),
                    **({"cp": lay.cp} if lay.cp > 1 else {}),
                    **({"zero": self.zero[name]} if name in self.zero else {}),
                    **({"release": True} if name in self.released else {}),
                }
                for name, lay in self.layouts.items()
            },
            indent=2,
        )


def plan_from_json(text: str, source: str) -> Plan:
    """Inverse of ``Plan.to_json``; a plan saved before micro-batches were ``n_microbatches``
    (``n_mbs``) loads too, so a resumed run keeps its plan."""
    raw = json.loads(text)
    layouts = {
        name: Layout(
            tuple(v["mesh"]),
            v["dp"],
            v["tp"],
            v["pp"],
            _microbatches(v),
            v.get("ep", 1),
            v.get("cp", 1),
        )
        for name, v in raw.items()
    }
    zero = {name: v["zero"] for name, v in raw.items() if "zero" in v}
    released = frozenset(name for name, v in raw.items() if v.get("release"))
    return Plan(layouts, source, zero, released=released)


def _microbatches(entry: dict) -> int:
    return entry["n_microbatches"] if "n_microbatches" in entry else entry["n_mbs"]


def colocated_plan(graph: Graph, n_devices: int) -> Plan:
    """Every call on every device, data parallel (the colocated, verl-style placement)."""
    layout = Layout(tuple(range(n_devices)), dp=n_devices)
    return Plan({c.name: layout for c in graph.calls}, "colocated")


def make_plan(graph: Graph, plan_cfg: PlanConfig, cluster: ClusterConfig) -> Plan:
    """The plan for ``graph`` on ``cluster``: every call on every device, data parallel, for
    ``colocated`` (and ``auto`` where it does not search: one device, GPUs; where it does,
    ``planner.auto.plan_for_run`` searches from the roles' timed models), else the manual
    entries."""
    if plan_cfg in ("auto", "colocated"):
        return colocated_plan(graph, cluster.n_devices)
    assert isinstance(plan_cfg, dict)
    unknown = sorted(set(plan_cfg) - set(graph.by_name))
    if unknown:
        raise RayhfError(f"plan.{unknown[0]}: no call of that name in graph '{graph.name}'")
    missing = [c.name for c in graph.calls if c.name not in plan_cfg]
    if missing:
        raise RayhfError(f"plan: a manual plan needs every call; missing plan.{missing[0]}")
    layouts = {
        name: layout_from_spec(spec, cluster.n_devices, f"plan.{name}")
        for name, spec in plan_cfg.items()
    }
    return Plan(layouts, "manual")


def check_plan_fits(plan: Plan, graph: Graph, specs: dict[str, ModelSpec]) -> None:
    """Refuse a layout its role's model cannot take (tp over the heads, pp over the layers);
    ``specs`` maps each role that has a model to its spec."""
    for name in graph.order:
        call = graph.by_name[name]
        role, lay = call.role, plan.layouts[name]
        if role in specs:
            reason = check_layout(specs[role], lay.tp, lay.pp, lay.ep, lay.cp)
            if reason is not None:
                raise RayhfError(f"plan.{name}: {reason} (role '{role}')")
        if lay.cp > 1 and call.kind == "generate":
            raise RayhfError(
                f"plan.{name}.cp: a generate call decodes each row on one rank, and cp splits "
                f"rows; set cp to 1"
            )
        if lay.ep > 1 and lay.pp > 1 and call.kind == "generate":
            raise RayhfError(
                f"plan.{name}.ep: the decode engine splits experts over replicas with pp = 1 "
                f"only (pp is {lay.pp}); set ep to 1 or pp to 1"
            )


def format_plan(plan: Plan, graph: Graph) -> str:
    """A table of the plan for ``rayhf plan`` (with the ZeRO stage of each train call where the
    plan names it: 2-3 run on DeepSpeed)."""
    rows = [f"plan ({plan.source}) for graph '{graph.name}':"]
    experts = any(lay.ep > 1 for lay in plan.layouts.values())  # an ep column where one splits
    context = any(lay.cp > 1 for lay in plan.layouts.values())  # a cp column likewise
    rows.append(
        f"  {'call':<14}{'role':<10}{'kind':<11}{'mesh':<14}{'dp':>4}{'tp':>4}{'pp':>4}{'mbs':>5}"
        + ("  ep" if experts else "")
        + ("  cp" if context else "")
        + ("  zero" if plan.zero else "")
    )
    for name in graph.order:
        c, lay = graph.by_name[name], plan.layouts[name]
        mesh = lay.name.split(".")[0][1:]  # "0-15" or "0_2_5"
        rows.append(
            f"  {name:<14}{c.role:<10}{c.kind:<11}{mesh:<14}{lay.dp:>4}{lay.tp:>4}"
            f"{lay.pp:>4}{lay.n_microbatches:>5}"
            + (f"{lay.ep:>4}" if experts else "")
            + (f"{lay.cp:>4}" if context else "")
            + (f"{plan.zero.get(name, '-'):>6}" if plan.zero else "")
            + ("  (its copy released: the whole model moves)" if name in plan.released else "")
        )
    return "\n".join(rows)


def format_reallocations(plan: Plan, graph: Graph, specs: dict[str, ModelSpec]) -> str:
    """The reallocations a plan implies per step, with their bytes (for ``rayhf plan``)."""
    moves = plan.reallocations(graph)
    if not moves:
        return "  reallocations per step: none (every call runs in its role's home layout)"
    rows = ["  reallocations per step (role's home layout -> call's layout, before the call):"]
    step = StepOptions().with_lora(specs, plan.released)  # a LoRA copy kept: adapters alone
    units = plan_step(graph, plan.layouts, plan.home_layouts(graph), step)
    skip = {u.name.removeprefix("realloc:"): u.skip_frozen for u in units if u.kind == "realloc"}
    for name, home, lay in moves:
        moved = plan_realloc(specs[graph.by_name[name].role], home, lay, skip_frozen=skip[name])
        relays = f", relayed {moved.depth} hops deep" if moved.depth > 1 else ""
        rows.append(
            f"    {name:<14}{home.name} -> {lay.name}: {moved.total_bytes / 2**20:.2f} MiB in "
            f"{len(moved.streams)} streams; the busiest device sends "
            f"{moved.max_sent / 2**20:.2f} MiB, receives {moved.max_received / 2**20:.2f} MiB"
            f"{relays}"
        )
    return "\n".join(rows)
