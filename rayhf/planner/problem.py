"""The planner's problem, built once: what is planned (the graph's calls, each role's model,
each call's work per step), on what (the cost model of the cluster) and how the driver runs a
step (EMA blends, overlap, staleness). The search, the simulator, the baselines and ``plan:
auto`` all read it; only a plan varies between their calls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import ClusterSpec
from rayhf.planner.step import StepOptions, lora_roles


@dataclass(frozen=True, eq=False)
class Problem:
    """A planning problem: everything a plan is chosen for and priced by."""

    graph: Graph
    specs: Mapping[str, ModelSpec]  # role -> its model (a role without one is a function)
    works: Mapping[str, Workload]  # call -> its work per step
    cost: AnalyticCost  # prices calls, memory and weight moves on ``cost.cluster``
    step: StepOptions = field(default_factory=StepOptions)  # the step as the driver runs it
    # units on disjoint devices run at the same time (False: a driver that runs one at a time)
    concurrent: bool = True

    @property
    def cluster(self) -> ClusterSpec:
        return self.cost.cluster

    @property
    def capacity(self) -> float:
        """Bytes of memory of one device."""
        return self.cost.cluster.device.memory_bytes

    @functools.cached_property
    def trained(self) -> frozenset[str]:
        """The roles some call trains."""
        return frozenset(c.role for c in self.graph.calls if c.kind == "train")

    @functools.cached_property
    def adapters(self) -> frozenset[str]:
        """The roles trained through LoRA adapters."""
        return lora_roles(self.specs)

    def spec(self, call: str) -> ModelSpec | None:
        """The model of ``call``'s role (None: a function, such as a reward function)."""
        return self.specs.get(self.graph.by_name[call].role)

    def with_works(self, works: Mapping[str, Workload]) -> Problem:
        return dataclasses.replace(self, works=works)

    def with_step(self, step: StepOptions) -> Problem:
        return dataclasses.replace(self, step=step)
