"""The planner's problem (``rayhf.planner.problem``): one object instead of the same clump of
arguments threaded through every function, and the budget that keeps it that way."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from planner_support import GRAPH, SPECS, WORKS

import rayhf.planner
from rayhf.planner.cost import AnalyticCost
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.problem import Problem
from rayhf.planner.step import StepOptions

MAX_PARAMETERS = 5  # beyond this a function wants a small object (like ``Problem``) instead


def _functions() -> Iterator[tuple[str, Any, ModuleType]]:
    """Every function and method in a planner module's namespace, with the module (``_parameters``
    keeps those written in its file)."""
    for info in pkgutil.iter_modules(rayhf.planner.__path__):
        module = importlib.import_module(f"rayhf.planner.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                for attr, member in vars(obj).items():
                    if isinstance(member, staticmethod | classmethod):
                        member = member.__func__
                    elif isinstance(member, property):
                        member = member.fget
                    yield f"{module.__name__}.{name}.{attr}", member, module
            else:
                yield f"{module.__name__}.{name}", obj, module


def _parameters(fn: Any, module: ModuleType) -> list[str] | None:
    """``fn``'s parameters but ``self`` and ``cls``, keyword-only ones included; None for what
    is not a function written in ``module``'s file (an import, a method ``dataclass`` or
    pydantic generates, one a class inherits)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename != module.__file__:
        return None
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


def test_no_planner_function_takes_more_than_five_parameters():
    counted, over = 0, []
    for where, fn, module in _functions():
        params = _parameters(fn, module)
        if params is None:
            continue
        counted += 1
        if len(params) > MAX_PARAMETERS:
            over.append(f"{where}({', '.join(params)})")
    assert counted > 100, "the walk finds the planner's functions"
    assert not over, f"more than {MAX_PARAMETERS} parameters: {over}"


def test_a_problem_derives_what_its_functions_used_to_be_passed():
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    problem = Problem(GRAPH, SPECS, WORKS, cost)
    assert problem.cluster is cost.cluster and problem.cluster.n_devices == 16
    assert problem.capacity == cost.cluster.device.memory_bytes
    assert problem.trained == {"actor", "critic"}
    assert problem.spec("critic_inf") is SPECS["critic"]
    assert problem.step == StepOptions() and problem.concurrent


def test_a_problem_changes_only_by_copy():
    problem = Problem(GRAPH, SPECS, WORKS, AnalyticCost(parse_cluster("1x8xH100")))
    fewer = {name: w for name, w in WORKS.items() if name != "ref_inf"}
    ahead = problem.with_works(fewer).with_step(StepOptions(staleness=1))
    assert ahead.works is fewer and ahead.step.staleness == 1 and ahead.cost is problem.cost
    assert problem.works is WORKS and problem.step == StepOptions()
