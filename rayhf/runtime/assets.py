"""Everything a run needs on disk, checked before any Ray process starts.

Bad input (a missing dataset, a too-long prompt, a directory that is not a model, a graph
mistake, an impossible plan) fails here with a one-line ``RayhfError``, so a run that starts
actors has already passed every check a user can fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from rayhf.algorithms import resolve_function
from rayhf.algorithms.refill import GroupRefill
from rayhf.algorithms.reward import check_columns
from rayhf.config import ExperimentConfig
from rayhf.config.experiment import resolve_path
from rayhf.config.registry import INTERFACES
from rayhf.data.datasets import DatasetKind, PromptDataset, kind_for_inputs
from rayhf.engines.config import EngineSite, check_kind, engines_for
from rayhf.envs.env import check_env
from rayhf.errors import RayhfError
from rayhf.graph import Graph, load_graph
from rayhf.metrics.tracker import check_trackers
from rayhf.models.families import family_traits
from rayhf.models.files import special_ids
from rayhf.models.hf import build_model, hf_config, save_model
from rayhf.models.lora import with_lora
from rayhf.models.precision import priced
from rayhf.models.spec import Lora, ModelSpec, model_spec
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.planner import Plan, make_plan
from rayhf.planner.plan import check_plan_fits
from rayhf.realloc.plan import check_compatible
from rayhf.runtime.planning import auto_plan, check_staleness


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
    special_ids: dict[str, int | None]  # the tokenizer's pad/eos/bos_token_id
    trainable: set[str]  # roles with a train call
    loras: dict[str, Lora] = dataclasses.field(default_factory=dict)  # LoRA adapters, by role


def prepare_tokenizer(cfg: ExperimentConfig, run_dir: Path, policy: str):
    """The run's tokenizer: built from ``tokenizer.alphabet``, else loaded from
    ``tokenizer.path``, else from the policy role's model directory; with
    ``tokenizer.chat_template`` in place of its own. Saved alone under ``run_dir/tokenizer``
    (returned with it), which the role groups read and copy into each checkpoint."""
    out = run_dir / "tokenizer"
    tok: Any
    if cfg.tokenizer.alphabet is not None:
        tok, where = build_char_tokenizer(cfg.tokenizer.alphabet, out), out
    else:
        path = cfg.tokenizer.path
        if path is None and policy in cfg.models:
            path = cfg.models[policy].path
        if path is None:
            raise RayhfError("tokenizer: set tokenizer.path or tokenizer.alphabet")
        try:
            tok, where = AutoTokenizer.from_pretrained(path, local_files_only=True), Path(path)
        except (OSError, ValueError) as e:
            raise RayhfError(f"tokenizer.path: cannot load a tokenizer from {path}: {e}") from None
    if cfg.tokenizer.chat_template is not None:
        tok.chat_template = cfg.tokenizer.chat_template
    if where != out or cfg.tokenizer.chat_template is not None:
        tok.save_pretrained(str(out))
    return tok, out


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


def existing_dataset(cfg: ExperimentConfig, graph: Graph) -> PromptDataset | None:
    """The training dataset if its file exists (for ``rayhf plan``, which writes nothing)."""
    if not Path(cfg.dataset.path).is_file():
        return None
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = prepare_tokenizer(cfg, Path(tmp), graph.policy_role)
        return PromptDataset.from_config(cfg.dataset, tokenizer, kind_for_inputs(graph.inputs))


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
            if rc.value_head and not family_traits(rc.init.family).value_head_class:
                raise RayhfError(
                    f"models.{role}.init.family: '{rc.init.family}' has no sequence-"
                    "classification class in transformers, so it cannot take the role's value "
                    "head; use another family"
                )
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


def model_configs(cfg: ExperimentConfig, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every model role's Hugging Face config, from the config alone (nothing written); roles
    in ``skip`` (and those copied from them) are left out, their directories not read."""
    import tempfile

    skipped = skip | {r for r, rc in cfg.models.items() if rc.init_from in skip}
    wanted = {role: rc for role, rc in cfg.models.items() if role not in skipped}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = None
        if any(rc.init is not None for rc in wanted.values()):  # a tokenizer sizes their vocab
            policy = load_graph(cfg.graph_path()).policy_role
            tokenizer, _ = prepare_tokenizer(cfg, Path(tmp), policy)
        configs: dict[str, Any] = {}
        for role, rc in wanted.items():
            if rc.path is not None:
                _check_model_dir(Path(rc.path), f"models.{role}.path")
                configs[role] = AutoConfig.from_pretrained(rc.path, local_files_only=True)
            elif rc.init is not None:
                assert tokenizer is not None
                ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
                configs[role] = hf_config(rc.init, len(tokenizer), *ids)
        for role, rc in wanted.items():
            if rc.init_from is not None and rc.init_from in configs:
                configs[role] = configs[rc.init_from]
    return configs


def model_specs(cfg: ExperimentConfig, skip: frozenset[str] = frozenset()) -> dict[str, ModelSpec]:
    """Every model role's shape, from the config alone (nothing written; for ``rayhf plan``);
    roles in ``skip`` get theirs elsewhere (``rayhf plan --shape``)."""
    configs = model_configs(cfg, skip)
    return {role: role_spec(config, cfg, role) for role, config in configs.items()}


def role_spec(config: Any, cfg: ExperimentConfig, role: str) -> ModelSpec:
    """A model role's shape, with its precision and its LoRA adapters for the planner."""
    rc = cfg.models[role]
    spec = priced(model_spec(config, rc.value_head), rc.precision, rc.ema is not None)
    return with_lora(spec, rc.lora, f"models.{role}.lora")


def check_graph_against_config(graph: Graph, cfg: ExperimentConfig) -> None:
    """Interfaces exist and fit the algorithm; function-valued roles only score; the ``env:``
    class imports and has async ``reset`` and ``step`` (or its agent is an async function)."""
    if cfg.env is not None:
        check_env(cfg.env)
    for c in graph.calls:
        iface = INTERFACES.get(c.interface)
        if iface is None:
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' has unknown interface '{c.interface}' "
                f"(have: {', '.join(sorted(INTERFACES))})"
            )
        needs = iface.config_type
        if needs is not None and type(cfg.algorithm) is not needs:  # a subclass: another algorithm
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' (interface {c.interface}) needs "
                f"algorithm.name: {needs.model_fields['name'].default}, the config has "
                f"'{cfg.algorithm.name}'"
            )
        if iface.needs_env and cfg.env is None:
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' (interface {c.interface}) runs an "
                "environment: add an `env:` section naming its class (env.cls: module:Class) or "
                "agent (env.agent: module:function)"
            )
        if iface.needs_judge and (cfg.judge is None or cfg.judge.template is None):
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' (interface {c.interface}) asks a judge: "
                "set judge.template, the judge's prompt with {prompt} and {response}"
            )
        if cfg.models[c.role].function is not None and not iface.takes_function:
            raise RayhfError(
                f"graph '{graph.name}': call '{c.name}' ({c.kind}, {c.interface}) runs on role "
                f"'{c.role}', which has no model (models.{c.role}.function)"
            )


def refill_of(cfg: ExperimentConfig) -> GroupRefill | None:
    """The algorithm's batch refill (dynamic sampling), if it has one."""
    refill = getattr(cfg.algorithm, "refill", None)
    return refill() if refill is not None else None


def _check_env_layouts(graph: Graph, plan: Plan) -> None:
    """A call that runs an environment decodes what its trajectories send as they send it,
    which the ranks of a tp or pp layout would have to agree on: it needs tp = pp = 1."""
    for c in graph.calls:
        iface = INTERFACES.get(c.interface)
        lay = plan.layouts[c.name]
        if iface is not None and iface.needs_env and c.kind == "generate" and lay.tp * lay.pp > 1:
            raise RayhfError(
                f"call '{c.name}' runs an environment, which needs tp = pp = 1 (the plan gives "
                f"tp = {lay.tp}, pp = {lay.pp}): give it a dp-only layout in plan"
            )


def _model_specs(cfg: ExperimentConfig, model_dirs: dict[str, Path]) -> dict[str, ModelSpec]:
    specs = {}
    for role, path in model_dirs.items():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        specs[role] = role_spec(config, cfg, role)
    return specs


def _check_batch(cfg: ExperimentConfig, plan: Plan) -> None:
    widest = max(lay.dp for lay in plan.layouts.values())
    if cfg.batch_size < widest:
        raise RayhfError(f"batch_size={cfg.batch_size} is smaller than the plan's dp={widest}")


def check_engines(
    cfg: ExperimentConfig, graph: Graph, plan: Plan, specs: dict[str, ModelSpec]
) -> None:
    """Each ``engines.<call>`` names a call of the graph and an engine for its kind, which
    checks the layout and model it gets (its ``check``); a role that shards its optimizer
    (``zero1``) splits no experts over ep ranks in its train call."""
    for call in graph.calls:
        lay = plan.layouts[call.name]
        if call.kind == "train":
            _check_balancing(cfg, call.role, call.name, lay.pp, specs.get(call.role))
        if call.kind == "train" and lay.ep > 1 and cfg.models[call.role].optimizer.zero1:
            raise RayhfError(
                f"models.{call.role}.optimizer.zero1: ZeRO-1 shards the optimizer over the dp "
                f"ranks, which hold different experts at ep = {lay.ep}; set it to false, or "
                f"plan.{call.name}.ep to 1"
            )
    for name, ec in cfg.engines.items():
        if name not in graph.by_name:
            raise RayhfError(f"engines.{name}: graph '{graph.name}' has no call '{name}'")
        call = graph.by_name[name]
        check_kind(name, call.kind, ec)
        rc, spec = cfg.models[call.role], specs.get(call.role)
        if spec is not None and spec.moe is not None and not ec.runs_experts:
            raise RayhfError(
                f"engines.{name}: engine '{ec.engine}' does not run Mixture-of-Experts models "
                f"yet (role '{call.role}' is {spec.family}); use engine "
                f"'{engines_for(call.kind)[0]}' for {name}"
            )
        layouts = {c: plan.layouts[c] for c in graph.role_calls(call.role) if c in plan.layouts}
        ec.check(EngineSite(
            name, call.role, layouts, spec.head_dim if spec is not None else 0,
            cfg.cluster.device, rc.optimizer.zero1, rc.init_from, rc.precision, call.kind,
        ))  # fmt: skip


def _check_balancing(
    cfg: ExperimentConfig, role: str, call: str, pp: int, spec: ModelSpec | None
) -> None:
    """A role's load-balancing losses need a softmax-routed MoE model trained with pp = 1."""
    opt = cfg.models[role].optimizer
    keys = ("router_aux_loss", "router_z_loss", "router_bias_rate")
    named = [k for k in keys if getattr(opt, k) > 0]
    if not named:
        return
    field = f"models.{role}.optimizer.{named[0]}"
    if spec is None or spec.moe is None or spec.traits.moe is None:
        kind = spec.family if spec is not None else "not a model"
        raise RayhfError(f"{field}: role '{role}' is {kind}, which has no experts; set it to 0")
    if opt.router_bias_rate > 0 and spec.traits.moe.router != "sigmoid_grouped":
        raise RayhfError(
            f"models.{role}.optimizer.router_bias_rate: {spec.family}'s softmax router has no "
            "correction bias to move; set it to 0 (router_aux_loss balances it)"
        )
    if named == ["router_bias_rate"]:
        return
    if spec.traits.moe.router != "softmax_topk":
        raise RayhfError(
            f"{field}: {spec.family}'s sigmoid router balances by its correction bias, not by "
            "a loss; set it to 0"
        )
    if pp > 1:
        raise RayhfError(
            f"{field}: the load-balancing losses run with pp = 1 only (plan.{call}.pp is {pp}); "
            "set it to 0 or the call's pp to 1"
        )


def check_router_replay(cfg: ExperimentConfig, graph: Graph, specs: dict[str, ModelSpec]) -> None:
    """``algorithm.router_replay`` needs a Mixture-of-Experts policy whose generate calls
    record experts: single-turn ones (the native engine's; the others run no MoE)."""
    mode = getattr(cfg.algorithm, "router_replay", "off")
    if mode == "off":
        return
    role = graph.policy_role
    spec = specs.get(role)
    if spec is None or spec.moe is None:
        kind = spec.family if spec is not None else "not a model"
        raise RayhfError(
            f"algorithm.router_replay: {mode} routes a Mixture-of-Experts policy, and role "
            f"'{role}' is {kind}; set it to off"
        )
    for call in graph.calls:
        if call.role == role and call.kind == "generate" and INTERFACES[call.interface].needs_env:
            raise RayhfError(
                f"algorithm.router_replay: multi-turn rollouts (call '{call.name}') do not "
                "record experts yet; set it to off"
            )


def _check_token_budgets(cfg: ExperimentConfig, datasets: list[PromptDataset]) -> None:
    """Every call's token budget holds the longest sample it may get."""
    for call, engine in cfg.engines.items():
        budget = engine.token_budget
        if budget is None:
            continue
        for data in datasets:
            longest, why = data.longest_sample(cfg.generation.max_new_tokens)
            if budget < longest:
                raise RayhfError(
                    f"engines.{call}.max_tokens_per_microbatch={budget} is smaller than the "
                    f"longest sample ({longest} tokens: {why}); raise it to at least {longest}"
                )


def _check_reward_columns(cfg: ExperimentConfig, datasets: list[PromptDataset]) -> None:
    """Every reward function finds the columns it needs in every dataset it will score."""
    for rc in cfg.models.values():
        if rc.function is None:
            continue
        fn = resolve_function(rc.function, "")
        for data in datasets:
            check_columns(fn, rc.function, data.columns, data.config.path)


def base_sources(cfg: ExperimentConfig, graph: Graph) -> dict[str, str]:
    """Role -> the LoRA role that computes its calls on its base weights, its adapters off:
    each frozen copy (``init_from``; no moving average, no adapters of its own, the same
    precision and head) of a LoRA role whose calls all score (the reference for free)."""
    out = {}
    for role, rc in cfg.models.items():
        name = rc.init_from or ""
        source = cfg.models.get(name)  # (an unknown one is refused by ``prepare_models``)
        kinds = {c.kind for c in graph.calls if c.role == role}
        if (
            source is not None
            and source.lora is not None
            and rc.lora is None
            and rc.ema is None
            and kinds == {"inference"}
            and (rc.precision, rc.value_head) == (source.precision, source.value_head)
        ):
            out[role] = name
    return out


def run_graph(cfg: ExperimentConfig) -> tuple[Graph, dict[str, str]]:
    """The graph a run executes (``cfg.graph``, its roles checked against ``models``, the calls
    of ``base_sources``' roles run by their sources), and ``base_sources``."""
    graph = load_graph(resolve_path(cfg.graph))
    graph.validate_roles(set(cfg.models))
    bases = base_sources(cfg, graph)
    return graph.on_bases(bases), bases


def prepare_run(cfg: ExperimentConfig, run_dir: Path) -> RunAssets:
    graph, bases = run_graph(cfg)
    check_graph_against_config(graph, cfg)
    if (refill := refill_of(cfg)) is not None:
        refill.check(graph)
    check_trackers(cfg.metrics)
    check_lora_engines(cfg, graph)
    plan = make_plan(graph, cfg.plan, cfg.cluster) if cfg.plan != "auto" else None
    if plan is not None:
        _check_batch(cfg, plan)
    for role, rc in cfg.models.items():
        if rc.function is not None:
            resolve_function(rc.function, f"models.{role}.function")
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_dir = prepare_tokenizer(cfg, run_dir, graph.policy_role)
    dataset, eval_dataset = prepare_dataset(cfg, tokenizer, kind_for_inputs(graph.inputs))
    datasets = [d for d in (dataset, eval_dataset) if d is not None]
    _check_reward_columns(cfg, datasets)
    _check_token_budgets(cfg, datasets)
    model_dirs = prepare_models(cfg, run_dir, tokenizer)
    model_dirs = {role: d for role, d in model_dirs.items() if role not in bases}
    specs = _model_specs(cfg, model_dirs)
    if plan is None:
        plan = auto_plan(cfg, graph, model_dirs, dataset, run_dir)
        _check_batch(cfg, plan)
    check_plan_fits(plan, graph, specs)
    _check_env_layouts(graph, plan)
    check_engines(cfg, graph, plan, specs)
    check_router_replay(cfg, graph, specs)
    check_staleness(cfg, graph, plan)
    for role, rc in cfg.models.items():
        if rc.init_from is not None and role in specs:  # the base weights: adapters aside
            source, copy = (dataclasses.replace(specs[r], lora=None) for r in (rc.init_from, role))
            check_compatible(source, copy, f"models.{role}.init_from")
    trainable = {c.role for c in graph.calls if c.kind == "train"}
    for role in trainable:
        if role not in model_dirs:
            raise RayhfError(f"models.{role}: role '{role}' is trained, so it needs a model")
    loras = check_lora(cfg, graph, specs, trainable)
    return RunAssets(
        run_dir, graph, plan, dataset, eval_dataset, tokenizer_dir, model_dirs, specs,
        special_ids(tokenizer), trainable, loras,
    )  # fmt: skip


def check_lora_engines(cfg: ExperimentConfig, graph: Graph) -> None:
    """Every call of a role with ``models.<role>.lora`` on an engine that runs adapters as
    configured (before planning: the planner prices only such engines for it)."""
    for c in graph.calls:
        ec, lora = cfg.engine_of(c.name, c.kind), cfg.models[c.role].lora
        if lora is not None and not ec.runs_adapters:
            lower = ", or a lower zero_stage" if ec.zero_choices else ""
            raise RayhfError(
                f"engines.{c.name}: engine '{ec.engine}' as configured does not run LoRA "
                f"adapters (models.{c.role}.lora); use engine '{engines_for(c.kind)[0]}'{lower}"
            )


def check_lora(
    cfg: ExperimentConfig, graph: Graph, specs: dict[str, ModelSpec], trainable: set[str]
) -> dict[str, Lora]:
    """Each ``models.<role>.lora`` as its model's ``Lora``: on a trained role with a model of
    its own, and no moving average following it (the engines: ``check_lora_engines``)."""
    out = {}
    for role, rc in cfg.models.items():
        if rc.lora is None:
            continue
        field = f"models.{role}.lora"
        if role not in trainable:
            raise RayhfError(
                f"{field}: role '{role}' has no train call in graph '{graph.name}', so no "
                "adapters to train; drop it"
            )
        if rc.init_from is not None:
            raise RayhfError(
                f"{field}: adapters on a role whose weights come from another's (init_from) are "
                "not built yet; give it a path or init"
            )
        for other, oc in cfg.models.items():
            if oc.init_from == role and oc.ema is not None:
                raise RayhfError(
                    f"models.{other}.ema: it follows '{role}', whose LoRA adapters it does not "
                    "hold; drop ema (a frozen reference) or the lora"
                )
        lora = specs[role].lora  # resolved with the role's spec (``role_spec``)
        assert lora is not None
        out[role] = lora
    return out
