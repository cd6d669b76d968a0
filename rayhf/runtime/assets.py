"""Everything a run needs on disk, checked before any Ray process starts.

Bad input (a missing dataset, a too-long prompt, a directory that is not a model, a graph
mistake, an impossible plan) fails here with a one-line ``RayhfError``, so a run that starts
actors has already passed every check a user can fix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from rayhf.algorithms.reward import resolve_function
from rayhf.config import ExperimentConfig
from rayhf.config.experiment import resolve_path
from rayhf.data.datasets import DatasetKind, PromptDataset, kind_for_inputs
from rayhf.engines.config import ENGINES_BY_KIND
from rayhf.engines.deepspeed_engine import DEEPSPEED_EXTRA
from rayhf.engines.vllm_engine import VLLM_CPU_HEAD_DIMS, VLLM_EXTRA
from rayhf.errors import RayhfError
from rayhf.graph import Graph, load_graph
from rayhf.models.hf import build_model, hf_config, save_model
from rayhf.models.spec import ModelSpec, model_spec
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.planner import Layout, Plan, make_plan
from rayhf.planner.plan import check_plan_fits
from rayhf.realloc.plan import check_compatible


@dataclass
class RunAssets:
    """Resolved inputs of a run: files on disk and the validated graph, plan and dataset."""

    run_dir: Path
    graph: Graph
    plan: Plan
    dataset: PromptDataset
    eval_dataset: PromptDataset | None
    tokenizer_dir: Path
    model_dirs: dict[str, Path]  # initial weights of every role that has a model
    specs: dict[str, ModelSpec]  # shape of every role that has a model
    trainable: set[str]  # roles with a train call


def prepare_tokenizer(cfg: ExperimentConfig, run_dir: Path):
    if cfg.tokenizer.alphabet is not None:
        out = run_dir / "tokenizer"
        return build_char_tokenizer(cfg.tokenizer.alphabet, out), out
    path = cfg.tokenizer.path
    if path is None and "actor" in cfg.models:
        path = cfg.models["actor"].path
    if path is None:
        raise RayhfError("tokenizer: set tokenizer.path or tokenizer.alphabet")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True), Path(path)
    except (OSError, ValueError) as e:
        raise RayhfError(f"tokenizer.path: cannot load a tokenizer from {path}: {e}") from None


EVAL_BUILD = {"n": 256, "seed": 10_007}  # held-out rows: another seed than the training file
# (the builder's other arguments, ``dataset_builder_args``, stay the same)


def prepare_dataset(
    cfg: ExperimentConfig, tokenizer, kind: DatasetKind
) -> tuple[PromptDataset, PromptDataset | None]:
    """The training dataset and the held-out one (``dataset.eval_path``), built if missing."""
    build = (
        resolve_function(cfg.dataset_builder, "dataset_builder") if cfg.dataset_builder else None
    )
    path, eval_path = Path(cfg.dataset.path), cfg.dataset.eval_path
    if build is not None and not path.exists():
        build(path, **cfg.dataset_builder_args)
    if build is not None and eval_path is not None and not Path(eval_path).exists():
        build(Path(eval_path), **{**cfg.dataset_builder_args, **EVAL_BUILD})
    train = PromptDataset.from_config(cfg.dataset, tokenizer, kind)
    held_out = None
    if eval_path is not None:
        held_out = PromptDataset.from_config(cfg.dataset, tokenizer, kind, path=eval_path)
    if cfg.eval_every and held_out is None:
        raise RayhfError("eval_every is set but dataset.eval_path is not")
    return train, held_out


def _check_model_dir(path: Path, field: str) -> None:
    if not (path / "config.json").is_file():
        raise RayhfError(f"{field}: {path} is not a model directory (no config.json)")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise RayhfError(f"{field}: {path} is not a model: {str(e).splitlines()[0]}") from None


def prepare_models(cfg: ExperimentConfig, run_dir: Path, tokenizer) -> dict[str, Path]:
    """Initial weights per role: a given path, or a model created from ``init`` and saved."""
    dirs: dict[str, Path] = {}
    for role, rc in cfg.models.items():
        if rc.path is not None:
            _check_model_dir(Path(rc.path), f"models.{role}.path")
            dirs[role] = Path(rc.path)
        elif rc.init is not None:
            out = run_dir / "init" / role
            if not (out / "config.json").is_file():
                config = hf_config(
                    rc.init,
                    len(tokenizer),
                    tokenizer.pad_token_id,
                    tokenizer.bos_token_id,
                    tokenizer.eos_token_id,
                )
                model = build_model(config, rc.value_head, seed=rc.init.seed + 1000 * cfg.seed)
                save_model(model, out, tokenizer)
            dirs[role] = out
    for role, rc in cfg.models.items():
        if rc.init_from is not None:
            if rc.init_from not in dirs:
                raise RayhfError(
                    f"models.{role}.init_from: '{rc.init_from}' is not a role with a model"
                )
            dirs[role] = dirs[rc.init_from]
    return dirs


def model_configs(cfg: ExperimentConfig) -> dict[str, Any]:
    """Every model role's Hugging Face config, from the config alone (nothing written)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = prepare_tokenizer(cfg, Path(tmp))
        configs: dict[str, Any] = {}
        for role, rc in cfg.models.items():
            if rc.path is not None:
                _check_model_dir(Path(rc.path), f"models.{role}.path")
                configs[role] = AutoConfig.from_pretrained(rc.path, local_files_only=True)
            elif rc.init is not None:
                ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
                configs[role] = hf_config(rc.init, len(tokenizer), *ids)
        for role, rc in cfg.models.items():
            if rc.init_from is not None and rc.init_from in configs:
                configs[role] = configs[rc.init_from]
    return configs


def model_specs(cfg: ExperimentConfig) -> dict[str, ModelSpec]:
    """Every model role's shape, from the config alone (nothing written; for ``rayhf plan``)."""
    return {
        role: model_spec(config, cfg.models[role].value_head)
        for role, config in model_configs(cfg).items()
    }


def check_graph_against_config(graph: Graph, cfg: ExperimentConfig) -> None:
    """Interfaces exist and fit the algorithm; function-valued roles only score."""
    from rayhf.algorithms import INTERFACES

    for c in graph.calls:
        iface = INTERFACES.get(c.interface)
        if iface is None:
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' has unknown interface '{c.interface}' "
                f"(have: {', '.join(sorted(INTERFACES))})"
            )
        needs = iface.config_type
        if needs is not None and not isinstance(cfg.algorithm, needs):
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' (interface {c.interface}) needs "
                f"algorithm.name: {needs.model_fields['name'].default}, the config has "
                f"'{cfg.algorithm.name}'"
            )
        if cfg.models[c.role].function is not None and c.interface != "reward":
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' ({c.kind}, {c.interface}) runs on role "
                f"'{c.role}', which has no model (models.{c.role}.function)"
            )


def _model_specs(cfg: ExperimentConfig, model_dirs: dict[str, Path]) -> dict[str, ModelSpec]:
    specs = {}
    for role, path in model_dirs.items():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        specs[role] = model_spec(config, cfg.models[role].value_head)
    return specs


def _check_batch(cfg: ExperimentConfig, plan: Plan) -> None:
    widest = max(lay.dp for lay in plan.layouts.values())
    if cfg.batch_size < widest:
        raise RayhfError(f"batch_size={cfg.batch_size} is smaller than the plan's dp={widest}")


def call_engines(cfg: ExperimentConfig, graph: Graph) -> dict[str, tuple[str, int, bool]]:
    """Per call not on rayhf's own engines: (engine, ZeRO stage, offload), as the planner
    prices them (a torch train call with ``optimizer.zero1`` is ZeRO stage 1)."""
    out = {}
    for c in graph.calls:
        engine, zero, offload = cfg.engine_of(c.name, c.kind)
        if c.kind == "train" and engine == "torch" and c.role in cfg.models:
            zero = 1 if cfg.models[c.role].optimizer.zero1 else 0
        if engine in ("vllm", "deepspeed") or zero:
            out[c.name] = (engine if engine in ("vllm", "deepspeed") else "", zero, offload)
    return out


def _auto_plan(
    cfg: ExperimentConfig, graph: Graph, model_dirs: dict[str, Path], dataset, run_dir: Path
) -> Plan:
    """The planner's choice for this run, kept in the run directory so a resumed run keeps it."""
    from rayhf.planner.auto import plan_for_run, workloads
    from rayhf.planner.plan import plan_from_json

    saved = run_dir / PLAN_FILE
    if saved.exists():  # a resumed run keeps its plan (if it still fits the graph and cluster)
        plan = plan_from_json(saved.read_text(), "auto")
        meshes = {d for lay in plan.layouts.values() for d in lay.mesh}
        if set(plan.layouts) == set(graph.by_name) and max(meshes) < cfg.cluster.n_devices:
            return plan
    configs = {
        role: (AutoConfig.from_pretrained(path, local_files_only=True), cfg.models[role].value_head)
        for role, path in model_dirs.items()
    }
    minibatches = getattr(cfg.algorithm, "n_minibatches", 1)
    prompt_len = round(dataset.mean_prompt_len())
    works = workloads(
        graph, cfg.batch_size, prompt_len, cfg.generation.max_new_tokens, minibatches,
        call_engines(cfg, graph),
    )  # fmt: skip
    plan = plan_for_run(graph, configs, works, cfg.cluster, cfg.seed)
    saved.write_text(plan.to_json())
    return plan


PLAN_FILE = "plan.json"


def check_engines(
    cfg: ExperimentConfig, graph: Graph, plan: Plan, specs: dict[str, ModelSpec]
) -> None:
    """Each ``engines.<call>`` names a call of the graph, an engine for its kind, a layout and a
    model the engine can run, and an engine that is installed."""
    for name, ec in cfg.engines.items():
        field = f"engines.{name}.engine"
        if name not in graph.by_name:
            raise RayhfError(f"engines.{name}: graph '{graph.name}' has no call '{name}'")
        kind = graph.by_name[name].kind
        if ec.engine not in ENGINES_BY_KIND[kind]:
            allowed = ", ".join(ENGINES_BY_KIND[kind])
            raise RayhfError(f"{field}: a {kind} call runs on {allowed}, not '{ec.engine}'")
        layout = plan.layouts[name]
        if ec.engine == "vllm" and (layout.tp > 1 or layout.pp > 1):
            raise RayhfError(
                f"{field}: vLLM runs one whole model per rank here (tp=1, pp=1) but the plan "
                f"gives {name} {layout.name}; set plan.{name} to a dp-only layout"
            )
        if ec.engine == "deepspeed":
            _check_deepspeed(cfg, name, graph.by_name[name].role, layout)
            _check_zero3_layouts(cfg, graph, plan, name)
        if ec.engine != "vllm":
            continue
        if importlib.util.find_spec("vllm") is None:
            raise RayhfError(f"{field}: vLLM is not installed: {VLLM_EXTRA}")
        role = graph.by_name[name].role
        head_dim = specs[role].head_dim
        if cfg.cluster.device == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
            raise RayhfError(
                f"{field}: vLLM's CPU attention runs head_dim {VLLM_CPU_HEAD_DIMS} but role "
                f"'{role}' has {head_dim} (hidden_size / n_heads): change models.{role}"
            )


def _check_deepspeed(cfg: ExperimentConfig, call: str, role: str, layout: Layout) -> None:
    field = f"engines.{call}"
    if layout.tp > 1 or layout.pp > 1:
        raise RayhfError(
            f"{field}.engine: DeepSpeed ZeRO shards over data-parallel ranks only (tp=1, pp=1) "
            f"but the plan gives {call} {layout.name}; set plan.{call} to a dp-only layout"
        )
    if cfg.models[role].optimizer.zero1:
        raise RayhfError(
            f"models.{role}.optimizer.zero1: {call} runs on DeepSpeed, whose zero_stage "
            f"already shards the optimizer; remove zero1"
        )
    if cfg.engines[call].zero_stage == 3 and cfg.models[role].init_from is not None:
        raise RayhfError(
            f"{field}.zero_stage: a ZeRO-3 role sends its weights but cannot receive them, and "
            f"models.{role}.init_from would; use zero_stage 1 or 2, or drop init_from"
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise RayhfError(f"{field}.engine: DeepSpeed is not installed: {DEEPSPEED_EXTRA}")


def _check_zero3_layouts(cfg: ExperimentConfig, graph: Graph, plan: Plan, call: str) -> None:
    """A ZeRO-3 group's ranks hold slices, so the role's other calls run in layouts of their own
    (their weights come by reallocation from the slices)."""
    if cfg.engines[call].zero_stage != 3:
        return
    role = graph.by_name[call].role
    for c in graph.role_calls(role):
        if c != call and plan.layouts[c] == plan.layouts[call]:
            raise RayhfError(
                f"plan.{c}: role '{role}' trains on ZeRO-3 ({call}), whose ranks hold only "
                f"slices of the weights; give {c} a layout other than {call}'s"
            )


def prepare_run(cfg: ExperimentConfig, run_dir: Path) -> RunAssets:
    graph = load_graph(resolve_path(cfg.graph))
    graph.validate_roles(set(cfg.models))
    check_graph_against_config(graph, cfg)
    plan = make_plan(graph, cfg.plan, cfg.cluster) if cfg.plan != "auto" else None
    if plan is not None:
        _check_batch(cfg, plan)
    for role, rc in cfg.models.items():
        if rc.function is not None:
            resolve_function(rc.function, f"models.{role}.function")
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_dir = prepare_tokenizer(cfg, run_dir)
    dataset, eval_dataset = prepare_dataset(cfg, tokenizer, kind_for_inputs(graph.inputs))
    model_dirs = prepare_models(cfg, run_dir, tokenizer)
    specs = _model_specs(cfg, model_dirs)
    if plan is None:
        plan = _auto_plan(cfg, graph, model_dirs, dataset, run_dir)
        _check_batch(cfg, plan)
    check_plan_fits(plan, graph, specs)
    check_engines(cfg, graph, plan, specs)
    for role, rc in cfg.models.items():
        if rc.init_from is not None and role in specs:
            check_compatible(specs[rc.init_from], specs[role], f"models.{role}.init_from")
    trainable = {c.role for c in graph.calls if c.kind == "train"}
    for role in trainable:
        if role not in model_dirs:
            raise RayhfError(f"models.{role}: role '{role}' is trained, so it needs a model")
    return RunAssets(
        run_dir, graph, plan, dataset, eval_dataset, tokenizer_dir, model_dirs, specs, trainable
    )
