"""The ``rayhf`` command: a thin layer over the public API in ``rayhf/__init__.py``.

User errors (``RayhfError``) print one line to stderr and exit 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from rayhf.cli.config_cmd import app as config_app
from rayhf.errors import RayhfError, RunFailed, RunInterrupted, RunPreempted
from rayhf.k8s.cli import app as k8s_app
from rayhf.serve.cli import serve as serve_command

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="rayhf: RLHF on Ray with a per-call layout for every model call.",
    pretty_exceptions_enable=False,
)

Overrides = Annotated[
    list[str] | None, typer.Argument(help="Config overrides, e.g. steps=5 algorithm.kl_coef=0.05")
]


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")


@app.command()
def run(
    config: Annotated[str | None, typer.Argument(help="Experiment YAML")] = None,
    overrides: Overrides = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue the run in this directory from its last checkpoint; key=value "
            "arguments may then change steps, save_every, eval_every, eval_samples, metrics.*"
        ),
    ] = None,
) -> None:
    """Train: plan the graph, start the role groups on Ray, run the steps, checkpoint."""
    import rayhf

    _quiet_libraries()
    if resume is None and config is None:
        raise RayhfError("give a CONFIG file, or --resume RUN_DIR")
    if resume is not None:
        if config is not None and "=" not in config:
            raise RayhfError("--resume takes the config saved in the run directory; drop CONFIG")
        changes = ([config] if config is not None else []) + (overrides or [])
        _report(rayhf.run(resume=resume, overrides=changes))
        return
    assert config is not None
    _report(rayhf.run(rayhf.load_config(config, overrides or [])))


def _report(result) -> None:
    last = result.metrics[-1] if result.metrics else {}
    typer.echo(f"run directory: {result.run_dir}")
    if result.policy_checkpoint is not None:
        typer.echo(f"{result.policy} checkpoint (Hugging Face format): {result.policy_checkpoint}")
    if result.plot is not None:
        typer.echo(f"plot: {result.plot}")
    if "task_reward" in last:
        typer.echo(f"final task reward: {last['task_reward']:.3f}")
    for key in sorted(k for k in last if k.startswith("eval/")):
        typer.echo(f"final {key}: {last[key]:.4f}")


def _stage(config: str, overrides: list[str] | None, graph_name: str) -> None:
    import rayhf
    from rayhf.runtime.train_stage import run_train_stage

    _quiet_libraries()
    cfg = rayhf.load_config(config, overrides or [])
    if cfg.graph_path().name != f"{graph_name}.yaml":
        raise RayhfError(
            f"graph: `rayhf {graph_name}` runs graphs/{graph_name}.yaml, got {cfg.graph}"
        )
    result = run_train_stage(cfg)
    _report(result)


@app.command()
def sft(
    config: Annotated[str, typer.Argument(help="Experiment YAML with graph: graphs/sft.yaml")],
    overrides: Overrides = None,
) -> None:
    """Supervised fine-tuning as a Ray Train job (TorchTrainer, data parallel)."""
    _stage(config, overrides, "sft")


@app.command()
def rm(
    config: Annotated[str, typer.Argument(help="Experiment YAML with graph: graphs/rm.yaml")],
    overrides: Overrides = None,
) -> None:
    """Reward-model training (Bradley-Terry) as a Ray Train job."""
    _stage(config, overrides, "rm")


@app.command()
def plan(
    config: Annotated[str, typer.Argument(help="Experiment YAML")],
    overrides: Overrides = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
    cluster: Annotated[
        str | None, typer.Option(help="Plan by search for a cluster spec, e.g. 16x8xH100")
    ] = None,
    shape: Annotated[
        list[str] | None,
        typer.Option(help="ROLE=SHAPE: plan with a public model shape, e.g. actor=llama2-70b"),
    ] = None,
    search_seconds: Annotated[
        float, typer.Option(help="Time limit of the baselines and the search (seconds)")
    ] = 20.0,
    gantt: Annotated[str | None, typer.Option(help="Write a Gantt chart PNG here")] = None,
) -> None:
    """Print the plan (per call: mesh and dp/tp/pp, and the reallocations it implies); with
    --cluster, search the plan for that cluster and compare it with the baselines."""
    import rayhf
    from rayhf.planner.plan import check_plan_fits, format_reallocations
    from rayhf.runtime.assets import model_specs, run_graph

    cfg = rayhf.load_config(config, overrides or [])
    graph, bases = run_graph(cfg)
    shaped = frozenset(item.partition("=")[0] for item in shape or [])
    specs = _with_shapes(model_specs(cfg, shaped), cfg, shape or [])
    specs = {role: spec for role, spec in specs.items() if role not in bases}
    if cluster is not None:
        _search_plan(cfg, graph, specs, cluster, search_seconds, json_out, gantt)
        return
    the_plan = rayhf.make_plan(cfg)
    check_plan_fits(the_plan, graph, specs)  # what `rayhf run` refuses, refused here too
    if json_out:
        typer.echo(the_plan.to_json())
    else:
        if cfg.plan == "auto" and cfg.cluster.n_devices > 1:
            typer.echo(
                "plan: auto -- the plan rayhf run searches for this config (the same search, "
                "from the roles' models timed on this machine's "
                + ("emulated devices)" if cfg.cluster.device == "cpu" else "GPU)")
            )
        typer.echo(rayhf.format_plan(the_plan, graph))
        if the_plan.estimates:
            est = the_plan.estimates
            typer.echo(
                f"  estimated {est['auto']:.3f} s a step; the colocated plan "
                f"{est['colocated']:.3f} s ({est['colocated'] / est['auto']:.2f}x this plan)"
            )
        typer.echo(format_reallocations(the_plan, graph, specs))
        if cfg.cluster.device == "cpu":
            typer.echo(_memory_per_device(cfg, graph, the_plan, specs))


def _memory_per_device(cfg, graph, the_plan, specs) -> str:
    """The simulated peak memory per emulated device under a plan, engines included."""
    from rayhf.planner.cost import AnalyticCost
    from rayhf.planner.hardware import cpu_cluster
    from rayhf.planner.problem import Problem
    from rayhf.planner.simulate import simulate
    from rayhf.runtime.assets import existing_dataset
    from rayhf.runtime.planning import planner_workloads, step_options

    works = planner_workloads(cfg, graph, existing_dataset(cfg, graph))
    cost = AnalyticCost(cpu_cluster(cfg.cluster.n_devices, cfg.cluster.device_memory_gb))
    sim = simulate(Problem(graph, specs, works, cost, step_options(cfg)), the_plan)
    peaks = ", ".join(f"d{d} {b / 2**20:.1f} MiB" for d, b in sorted(sim.peak_memory.items()))
    return f"  memory per device (weights, optimizer state, engines, largest call): {peaks}"


def _with_shapes(specs: dict, cfg, shapes: list[str]) -> dict:
    from rayhf.models.lora import with_lora
    from rayhf.models.precision import priced
    from rayhf.models.shapes import public_shape

    for item in shapes:
        role, sep, name = item.partition("=")
        if not sep or role not in cfg.models:
            raise RayhfError(
                f"--shape {item!r}: write ROLE=SHAPE with ROLE one of {list(cfg.models)}"
            )
        rc = cfg.models[role]
        shape = public_shape(name, rc.value_head)
        spec = priced(shape, rc.precision, rc.ema is not None)
        specs[role] = with_lora(spec, rc.lora, f"models.{role}.lora")
        for copy, other in cfg.models.items():  # a role copied from this one has its shape
            if other.init_from == role and copy not in specs:
                specs[copy] = priced(shape, other.precision, other.ema is not None)
    return specs


def _search_plan(cfg, graph, specs, cluster_text, seconds, json_out, gantt) -> None:
    from pathlib import Path

    from rayhf.planner import format_plan
    from rayhf.planner.auto import auto_plan, format_auto, step_estimates, write_gantt
    from rayhf.planner.cost import AnalyticCost
    from rayhf.planner.hardware import parse_cluster
    from rayhf.planner.problem import Problem
    from rayhf.runtime.assets import existing_dataset
    from rayhf.runtime.planning import planner_workloads, staleness, step_options

    cost = AnalyticCost(parse_cluster(cluster_text))
    dataset = existing_dataset(cfg, graph)
    works = planner_workloads(cfg, graph, dataset)
    problem = Problem(graph, specs, works, cost, step_options(cfg, "cuda"))
    result = auto_plan(problem, cfg.seed, seconds)
    chosen = result.chosen.plan
    if json_out:
        typer.echo(chosen.to_json())
        return
    typer.echo(format_plan(chosen, graph))
    typer.echo(format_auto(result))
    on_policy = works  # the work at k=0: with k > 0, without the proximal forward
    if staleness(cfg):
        synced = cfg.with_overrides({"algorithm.max_staleness": 0})
        on_policy = planner_workloads(synced, graph, dataset)
    ways = step_estimates(problem, result, cfg.seed, seconds, on_policy)
    typer.echo("\n".join(ways))
    if gantt is not None:
        typer.echo(f"gantt chart: {write_gantt(result.chosen.simulation, Path(gantt))}")


app.add_typer(k8s_app, name="k8s", help="Render and validate KubeRay manifests offline.")
app.command("serve")(serve_command)
app.add_typer(config_app, name="config", help="Show a resolved config or write its JSON schema.")


def main() -> None:
    # Ctrl-C stops a run. A shell without job control starts a background job (`rayhf run ... &`
    # in a script) with SIGINT ignored, and Python then keeps it ignored: a SIGINT sent to the
    # run on purpose would be lost (seen when a test suite ran in the background).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        app()
    except RayhfError as e:
        typer.echo(f"rayhf: error: {e}", err=True)
        sys.exit(2)
    except RunFailed as e:
        typer.echo(f"rayhf: run stopped: {e}", err=True)
        sys.exit(1)
    except RunPreempted as e:
        typer.echo(f"rayhf: {e}", err=True)
        sys.exit(143)
    except RunInterrupted as e:
        typer.echo(f"rayhf: {e}", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("rayhf: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
