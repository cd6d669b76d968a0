"""Graphs as data: calls with input and output keys; edges and order follow from the keys.

A call reads keys and writes keys of the step's batch. A call runs after every call producing one
of its inputs; a key is produced once. Across steps, a role's train call of step i precedes the
role's first call of step i+1 (``Graph.role_order``): the driver enforces it.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayhf.errors import RayhfError

CallKind = Literal["generate", "inference", "train"]


class Call(BaseModel):
    """One node: a role, what it does, and the batch keys it reads and writes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # unique in the graph, e.g. actor_gen
    role: str  # the model it runs on, a key of the config's ``models``
    kind: CallKind
    interface: str  # the algorithm interface that computes it, e.g. ppo_actor
    inputs: list[str] = Field(default_factory=list)  # graph keys read
    outputs: list[str] = Field(default_factory=list)  # graph keys written
    input_remap: dict[str, str] = Field(default_factory=dict)  # interface name -> graph key
    output_remap: dict[str, str] = Field(default_factory=dict)  # interface name -> graph key
    args: dict[str, object] = Field(default_factory=dict)  # per-call interface options
    # runs on its role's base weights, the role's LoRA adapters off (a reference computed by
    # the LoRA actor it was copied from: ``Graph.on_bases``)
    base: bool = False

    def interface_inputs(self) -> dict[str, str]:
        """Interface key -> graph key for every input."""
        back = {g: i for i, g in self.input_remap.items()}
        return {back.get(k, k): k for k in self.inputs}

    def interface_outputs(self) -> dict[str, str]:
        """Interface key -> graph key for every output."""
        back = {g: i for i, g in self.output_remap.items()}
        return {back.get(k, k): k for k in self.outputs}


class Graph(BaseModel):
    """The calls of one iteration and the keys the dataset provides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    inputs: list[str]  # keys the dataset provides
    calls: list[Call]
    policy: str | None = None  # the role a run checkpoints for serving; None: the role of the
    # first generate call, else of the first train call

    @cached_property
    def by_name(self) -> dict[str, Call]:
        return {c.name: c for c in self.calls}

    @cached_property
    def producers(self) -> dict[str, str]:
        """Key -> name of the call that writes it."""
        return {k: c.name for c in self.calls for k in c.outputs}

    @cached_property
    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) call names, from matching keys."""
        out = []
        for c in self.calls:
            for p in sorted({self.producers[k] for k in c.inputs if k in self.producers}):
                out.append((p, c.name))
        return out

    @cached_property
    def order(self) -> list[str]:
        """Call names in a topological order, ties broken by file order."""
        return _topological(self.calls, self.edges)

    @cached_property
    def roles(self) -> list[str]:
        return sorted({c.role for c in self.calls})

    @cached_property
    def policy_role(self) -> str:
        """The role whose checkpoint is the run's result (what ``rayhf serve`` serves)."""
        if self.policy is not None:
            return self.policy
        for kind in ("generate", "train"):
            for c in self.calls:
                if c.kind == kind:
                    return c.role
        return self.calls[0].role

    def role_calls(self, role: str) -> list[str]:
        return [name for name in self.order if self.by_name[name].role == role]

    def split_after(self, key: str) -> tuple[Graph, Graph]:
        """The calls ``key`` needs (its producer and everything before it), then the others,
        which read the first part's keys as their graph inputs."""
        need, todo = set(), [self.producers[key]]
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo.extend(p for p, c in self.edges if c == name)
        first = [c for c in self.calls if c.name in need]
        made = [k for c in first for k in c.outputs]
        rest = [c for c in self.calls if c.name not in need]
        return (
            Graph(name=f"{self.name}:lead", inputs=self.inputs, calls=first),
            Graph(name=f"{self.name}:rest", inputs=made, calls=rest),
        )

    def on_bases(self, sources: Mapping[str, str]) -> Graph:
        """Each call of a role in ``sources`` run instead by the role it names, on that role's
        base weights (``Call.base``)."""
        if not sources:
            return self
        calls = [
            c.model_copy(update={"role": sources[c.role], "base": True}) if c.role in sources else c
            for c in self.calls
        ]
        return Graph(name=self.name, inputs=self.inputs, calls=calls, policy=self.policy)

    def validate_roles(self, roles: set[str]) -> None:
        """Every call's role must be a configured model."""
        for c in self.calls:
            if c.role not in roles:
                raise RayhfError(
                    f"graph '{self.name}': call '{c.name}' uses role '{c.role}', which has no "
                    f"entry in models (have: {', '.join(sorted(roles))})"
                )


def _topological(calls: list[Call], edges: list[tuple[str, str]]) -> list[str]:
    indegree = {c.name: 0 for c in calls}
    for _, dst in edges:
        indegree[dst] += 1
    done: list[str] = []
    ready = [c.name for c in calls if indegree[c.name] == 0]
    while ready:
        name = ready.pop(0)
        done.append(name)
        for src, dst in edges:
            if src == name:
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    ready.append(dst)
        ready.sort(key=[c.name for c in calls].index)
    if len(done) < len(calls):
        stuck = [c.name for c in calls if c.name not in done]
        raise RayhfError(f"graph has a cycle through calls: {', '.join(stuck)}")
    return done


def _check(graph: Graph) -> None:
    seen: dict[str, str] = {}
    names: set[str] = set()
    for c in graph.calls:
        if c.name in names:
            raise RayhfError(f"graph '{graph.name}': call name '{c.name}' appears twice")
        names.add(c.name)
        for k in c.outputs:
            if k in seen or k in graph.inputs:
                first = seen.get(k, "the dataset")
                raise RayhfError(
                    f"graph '{graph.name}': key '{k}' is produced by call '{c.name}' and by {first}"
                )
            seen[k] = f"call '{c.name}'"
        for field, remap, keys in (
            ("input_remap", c.input_remap, c.inputs),
            ("output_remap", c.output_remap, c.outputs),
        ):
            for src, dst in remap.items():
                if dst not in keys:
                    raise RayhfError(
                        f"graph '{graph.name}': call '{c.name}' {field} maps '{src}' to "
                        f"'{dst}', which is not one of its keys {keys}"
                    )
    if graph.policy is not None and graph.policy not in {c.role for c in graph.calls}:
        raise RayhfError(f"graph '{graph.name}': policy '{graph.policy}' is no call's role")
    for c in graph.calls:
        for k in c.inputs:
            if k not in seen and k not in graph.inputs:
                raise RayhfError(
                    f"graph '{graph.name}': call '{c.name}' reads key '{k}', which no call "
                    f"produces and the dataset does not provide"
                )
    _topological(graph.calls, graph.edges)


def load_graph(path: str | Path) -> Graph:
    """Load and validate a graph file; every mistake is a one-line RayhfError."""
    p = Path(path)
    if not p.is_file():
        raise RayhfError(f"graph file not found: {p} (config field: graph)")
    try:
        raw = yaml.safe_load(p.read_text())
        graph = Graph.model_validate(raw)
    except yaml.YAMLError as e:
        raise RayhfError(f"graph file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise RayhfError(f"graph file {p}: {where}: {err['msg']}") from None
    _check(graph)
    return graph
