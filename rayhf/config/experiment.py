"""The experiment config: one YAML file, composed of each component's own small config.

Components own their configs (``PPOConfig`` next to the PPO math, ``GenerationConfig`` next to
the generation engine, ...); this module only composes them, loads YAML, applies
``key.sub=value`` overrides and turns validation errors into one-line messages that name the
field. Unknown keys are rejected everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from rayhf.algorithms.dapo import DAPOConfig
from rayhf.algorithms.interface import Algorithm
from rayhf.algorithms.judge import JudgeConfig
from rayhf.config.driver import DriverConfig
from rayhf.config.faults import FaultToleranceConfig
from rayhf.config.registry import ALGORITHMS, DEFAULT_ALGORITHM
from rayhf.data.datasets import DatasetConfig
from rayhf.engines.config import ENGINES, EngineConfig, default_engine, owner_of
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.envs.env import EnvConfig
from rayhf.errors import RayhfError
from rayhf.metrics.tracker import MetricsConfig
from rayhf.models.init import ModelInit
from rayhf.models.lora import LoraConfig
from rayhf.models.precision import Precision
from rayhf.planner import ClusterConfig, PlanConfig
from rayhf.sampling import GenerationConfig

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # rayhf/, which holds graphs/
REPO_ROOT = PACKAGE_ROOT.parent  # a checkout: examples/ beside the package


def _algorithm_name(value: Any) -> str:
    """The ``name`` that selects an algorithm config; the default algorithm when none is given."""
    if isinstance(value, dict):
        return value.get("name", DEFAULT_ALGORITHM)
    return getattr(value, "name", DEFAULT_ALGORITHM)


def algorithm_union(algorithms: Mapping[str, Algorithm]) -> Any:
    """The ``algorithm:`` section's type: one of ``algorithms``' configs, chosen by ``name``."""
    tagged = tuple(Annotated[a.config, Tag(n)] for n, a in algorithms.items())
    return Annotated[Union[tagged], Discriminator(_algorithm_name)]  # noqa: UP007


if TYPE_CHECKING:
    AlgorithmConfig = Any  # as ``InterfaceSettings.algorithm``: each interface narrows it
else:
    AlgorithmConfig = algorithm_union(ALGORITHMS)


class RoleConfig(BaseModel):
    """Where a role's weights come from (exactly one source) and how it trains."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    path: str | None = None
    """A local Hugging Face model directory."""
    init: ModelInit | None = None
    """Create a small random model of this shape."""
    init_from: str | None = None
    """Start from another role's initial weights (ref <- actor)"""
    ema: float | None = Field(None, gt=0, le=1)
    """With init_from: after each train step of that role, w = ema * source + (1 - ema) * w (a
    moving-average reference); None = frozen."""
    function: str | None = None
    """A "module:function" reward instead of a model."""
    value_head: bool = False
    """Scalar head per token (critic, reward model)"""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW's settings for a trained role."""
    activation_checkpointing: bool = False
    """Keep only each layer's input in training and recompute the rest in backward: less activation
    memory (long responses) for one more forward of each layer (torch engine)."""
    precision: Precision = "auto"
    """What the role's matmuls run in: bf16/fp16 keep fp32 master weights and optimizer state for a
    trained (or moving-average) role, and store frozen copies in the low dtype; auto is bf16 on GPUs
    and fp32 on CPU."""
    fp32_lm_head: bool = False
    """At bf16/fp16, run the LM head (the projection to the vocabulary) and its log-probs in fp32,
    in every call of the role (generate, inference, train), so sampled and trained log-probs agree
    more closely."""
    lora: LoraConfig | None = None
    """Train LoRA adapters of a trained role's linear layers, its weights frozen (PEFT's
    format)."""

    @model_validator(mode="after")
    def _one_source(self) -> RoleConfig:
        given = [k for k in ("path", "init", "init_from", "function") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, init, init_from, function (got {given})")
        if self.ema is not None and self.init_from is None:
            raise ValueError("ema needs init_from (the role whose weights it follows)")
        if self.lora is not None and (self.function is not None or self.ema is not None):
            raise ValueError("lora adapts a trained model: drop it, or function / ema")
        return self


class TokenizerConfig(BaseModel):
    """A local tokenizer directory, or a character tokenizer built from an alphabet."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    path: str | None = None
    """None with no alphabet = the actor's model directory."""
    alphabet: str | None = None
    """Build a character-level tokenizer over these characters."""
    chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own (it renders a prompt column of chat
    messages); the run's tokenizer, template included, is saved under run_dir/tokenizer."""


class ExperimentConfig(BaseModel):
    """Everything one run needs."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    name: str = "ppo"
    """The run's name: its directory is runs/{name} unless run_dir is set."""
    graph: str = "graphs/ppo.yaml"
    """The dataflow graph file."""
    run_dir: str | None = None
    """None = runs/{name}."""
    seed: int = 1
    """Seeds the models' initialisation, the data order and sampling."""
    steps: int = Field(30, gt=0)
    """Iterations of the graph."""
    batch_size: int = Field(16, gt=0)
    """Dataset rows per step (prompts, pairs, demonstrations)"""
    eval_every: int = Field(0, ge=0)
    """Evaluate on dataset.eval_path every N steps (0 = never)"""
    eval_samples: int = Field(1, gt=0)
    """Answers sampled per held-out prompt, for eval/pass@k."""
    eval_correct_at: float = 1.0
    """An answer scoring at least this counts as correct (pass@k)"""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only at the end)"""
    models: dict[str, RoleConfig]
    """Role -> where its weights come from and how it trains (the graph names the roles)."""
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """The tokenizer every role shares, when the models do not bring one."""
    dataset: DatasetConfig
    """The prompts (or pairs, or demonstrations) and the held-out set."""
    dataset_builder: str | None = None
    """"module:function(path)" that writes a missing dataset."""
    dataset_builder_args: dict[str, Any] = Field(default_factory=dict)
    """The dataset builder's keyword arguments."""
    algorithm: AlgorithmConfig = Field(default_factory=ALGORITHMS[DEFAULT_ALGORITHM].config)
    """One algorithm's section, chosen by its ``name`` (default ppo)."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """How generate calls sample: lengths, temperature, top-k/top-p, group size."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """The devices the plan uses and the Ray cluster they are on."""
    plan: PlanConfig = "auto"
    """"auto" (searched), "colocated", call -> layouts, or a file of them."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Where each step's metrics go: console, metrics.jsonl, a plot, Ray metrics, trackers."""
    driver: DriverConfig = Field(default_factory=DriverConfig)
    """How each step's DAG runs."""
    engines: dict[str, EngineConfig] = Field(default_factory=dict)
    """Call -> its backend: one of the engines' sections, chosen by its ``engine``."""
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    """Recovery from dead actors and lost nodes, SIGTERM, injected faults."""
    env: EnvConfig | None = None
    """The environment of a multi-turn generate call (interface ``grpo_agent``)."""
    judge: JudgeConfig | None = None
    """How a judge model's generate call (interface ``judge``) is asked and read."""
    resume: Literal["never", "auto"] = "never"
    """Auto: a run directory holding a complete checkpoint continues from it (a retried RayJob
    resumes by itself); never: such a directory is an error that names --resume."""

    @model_validator(mode="after")
    def _stale_steps_overlap(self) -> ExperimentConfig:
        k = getattr(self.algorithm, "max_staleness", 0)
        if k and not self.driver.overlap_steps:
            raise ValueError(
                f"algorithm.max_staleness: {k} runs steps overlapped; set driver.overlap_steps: "
                "true (the plain executor) or algorithm.max_staleness: 0"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_within_the_limit(self) -> ExperimentConfig:
        alg, limit = self.algorithm, self.generation.max_new_tokens
        if isinstance(alg, DAPOConfig) and alg.overlong_tokens(limit) >= limit:
            raise ValueError(
                f"algorithm.overlong_buffer: {alg.overlong_buffer} is not below "
                f"generation.max_new_tokens ({limit}); lower it or raise max_new_tokens"
            )
        return self

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> ExperimentConfig:
        for role, rc in self.models.items():
            sched = rc.optimizer.schedule
            total = sched.total_steps or self.steps
            if sched.warmup_steps >= total:
                raise ValueError(
                    f"models.{role}.optimizer.schedule.warmup_steps: {sched.warmup_steps} is "
                    f"not shorter than the schedule's {total} steps; lower it or raise steps"
                )
        return self

    @model_validator(mode="after")
    def _injected_role_exists(self) -> ExperimentConfig:
        for i, inject in enumerate(self.fault_tolerance.inject):
            if inject.role not in self.models:
                raise ValueError(
                    f"fault_tolerance.inject.{i}.role '{inject.role}' is not a role of models "
                    f"({', '.join(self.models)})"
                )
        return self

    def engine_of(self, call: str, kind: str) -> EngineConfig:
        """A call's backend: its ``engines`` entry or its kind's default."""
        return self.engines.get(call) or default_engine(kind)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def graph_path(self) -> Path:
        return resolve_path(self.graph)

    def with_overrides(self, overrides: dict[str, Any] | list[str]) -> ExperimentConfig:
        """A new validated config with dotted-key overrides applied."""
        raw = self.model_dump(mode="json", exclude_unset=False)
        return validate_config(apply_overrides(raw, overrides), "overrides")


def resolve_path(path: str) -> Path:
    """A path as given if it exists; else inside the installed package (``graphs/...``: the
    built-in graphs ship in it), else relative to the rayhf checkout (``examples/...``)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    for root in (PACKAGE_ROOT, REPO_ROOT):
        if (root / p).exists():
            return root / p
    return p


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise RayhfError(f"override '{item}' must look like key.sub=value")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        return key.strip(), value


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries in the raw config dict (values parsed as YAML)."""
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides)
    for key, value in items:
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RayhfError(f"override {key}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


# fields renamed since a release: the old name is refused with a pointer to the new one
RENAMED = {"algorithm.kl_ctl": "algorithm.kl_coef"}  # the KL weight's one name in every algorithm


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith("function-after")]
    engine = None  # the engine section a field is in: engines.<call>.<tag>.<field>
    if len(loc) > 1 and loc[0] == "algorithm":
        loc.pop(1)  # the union tag (ppo, grpo, ...) is not a key the user wrote
    elif len(loc) > 3 and loc[0] == "engines" and loc[2] in ENGINES:
        engine = loc.pop(2)  # nor is the engine's (native, vllm, ...)
    field = ".".join(loc)
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key (remove it or check its spelling)"
        if field in RENAMED:
            msg = f"renamed: write {RENAMED[field]}"
        owner = owner_of(loc[-1]) if engine is not None else None
        if owner is not None:
            msg = f"not a setting of engine '{engine}': {loc[-1]} is a setting of engine '{owner}'"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found") and loc[0] == "engines":
        given = first["ctx"].get("tag") if first["type"] == "union_tag_invalid" else None
        what = f"'{given}' is not an engine" if given else "missing"
        return f"{source}: config field {field}.engine: {what} (one of {', '.join(ENGINES)})"
    extra = (
        f" (got {first['input']!r})" if first["type"] not in ("extra_forbidden", "missing") else ""
    )
    if len(extra) > 80:
        extra = ""
    more = f" [+{err.error_count() - 1} more]" if err.error_count() > 1 else ""
    if first["type"] == "value_error":  # a validator's message names its fields itself
        msg = msg.removeprefix("Value error, ")
        if not field:
            return f"{source}: {msg}{more}"
    return f"{source}: config field {field}: {msg}{extra}{more}"


def _inline_plan_file(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``plan: some/file.yaml`` -> the file's call -> layout mapping."""
    plan = raw.get("plan")
    if not isinstance(plan, str) or plan in ("auto", "colocated"):
        return raw
    path = resolve_path(plan)
    if not path.is_file():
        raise RayhfError(
            f"{source}: config field plan: '{plan}' is neither 'auto', 'colocated', call -> "
            f"layout entries, nor a plan file that exists"
        )
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RayhfError(f"plan file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return {**raw, "plan": entries}


def validate_config(raw: Any, source: str) -> ExperimentConfig:
    if not isinstance(raw, dict):
        raise RayhfError(f"{source}: the config must be a YAML mapping")
    raw = _inline_plan_file(raw, source)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise RayhfError(_format_error(e, source)) from None


def config_json_schema() -> dict[str, Any]:
    """The JSON schema of an experiment config. The algorithm section is one of the algorithms'
    configs chosen by ``name`` (PPO without one): every other algorithm requires its name, so a
    section matches exactly one of them, as validation picks it."""
    schema = ExperimentConfig.model_json_schema()
    variants = schema["properties"]["algorithm"]["oneOf"]
    for ref in variants:
        variant = schema["$defs"][ref["$ref"].rsplit("/", 1)[1]]
        if variant["properties"]["name"].get("default") != "ppo":
            variant.setdefault("required", []).append("name")
    return schema


def load_config(path: str | Path, overrides: list[str] | dict[str, Any] | None = None):
    """Load ``path`` (YAML), apply overrides, validate; every mistake is one RayhfError line."""
    p = Path(path)
    if not p.is_file():
        raise RayhfError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise RayhfError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if overrides and isinstance(raw, dict):
        raw = apply_overrides(raw, overrides)
    return validate_config(raw, str(p))


def dump_config(cfg: ExperimentConfig, path: Path) -> None:
    """Write the resolved config (every default filled in) as YAML, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)
