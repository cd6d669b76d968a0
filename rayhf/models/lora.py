"""LoRA adapters (``rayhf.models.spec.Lora``): their starting values, their names and files as
PEFT's, their place in a model's files.

A weight ``W [out, in]`` adapted at rank ``r`` gains ``A [r, in]`` and ``B [out, r]``, and a
linear layer through it gives ``x W^T + s (x A^T) B^T`` with ``s = alpha / r`` (``alpha /
sqrt(r)`` with rsLoRA): PEFT's LoRA. The adapters are parameters of the model like any other
(``rayhf.models.sharding.param_shards`` lists them after the weight they adapt, which is then
frozen): tp splits them as the weight they adapt (``adapter_pairs``), pp with its layer, and
reallocation and gathering move them as any shard. Their names are PEFT's without its
``base_model.model.`` prefix and adapter name: ``{module}.lora_A.weight``,
``{module}.lora_B.weight``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from rayhf.errors import RayhfError
from rayhf.models.sharding import HEAD, ParamShard, adaptable, param_shards
from rayhf.models.spec import Lora, ModelSpec, module_named

if TYPE_CHECKING:
    from rayhf.models.files import ModelFiles


ALL_LINEAR = "all-linear"


class LoraConfig(BaseModel):
    """A role's LoRA adapters (``models.<role>.lora``): its weights frozen, adapters trained."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    rank: int = Field(8, gt=0)
    """The adapters' rank r."""
    alpha: float = Field(16.0, gt=0)
    """An adapter's term is scaled by alpha / rank (alpha / sqrt(rank) with rslora)."""
    targets: list[str] = Field(default_factory=lambda: [ALL_LINEAR], min_length=1)
    """The linear layers adapted, by module name or its last parts (PEFT's target_modules), or
    "all-linear": every linear layer of the decoder layers. An LM head of its own (untied) is
    adapted when named ("lm_head"), never by "all-linear". On a Mixture-of-Experts model never
    its routed experts or routers, nor a layer whose name PEFT reads as them (Qwen3-MoE's and
    GLM-4.5's gate_proj, up_proj, down_proj; Mixtral's w1, w2, w3)."""
    rslora: bool = False
    """Scale by alpha / sqrt(rank) (rank-stabilized LoRA)."""
    trains: list[str] = Field(default_factory=list)
    """Modules that train in full beside the adapters (PEFT's modules_to_save); a value head
    (score) always does."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapter's input in train calls (PEFT's lora_dropout; never in inference or
    generation, and a starting adapter's own is not read): the train call's log-probs then differ
    from the inference call's, so RL usually keeps 0."""
    adapter: str | None = None
    """A PEFT adapter directory to start from: its rank, alpha, targets, rslora and trains stand
    where these fields are not given, and must equal those that are."""


def linear_modules(spec: ModelSpec, head: bool = False) -> list[str]:
    """The modules LoRA can adapt: every 2-D weight's of the decoder layers (not a routed
    expert's nor a router's: ``adaptable``), and with ``head`` an untied LM head (which
    "all-linear" leaves out, as PEFT's does)."""
    base = dataclasses.replace(spec, lora=None)
    return [
        p.name.removesuffix(".weight")
        for p in param_shards(base)
        if p.name.endswith(".weight") and adaptable(spec, p)
        if head or p.name != f"{HEAD}.weight"
    ]


def with_lora(spec: ModelSpec, config: LoraConfig | None, field: str) -> ModelSpec:
    """``spec`` carrying the adapters ``config`` resolves to (``spec`` itself without one): what
    the planner prices and reallocation moves."""
    return spec if config is None else dataclasses.replace(spec, lora=lora_of(config, spec, field))


def lora_of(config: LoraConfig, spec: ModelSpec, field: str) -> Lora:
    """``config`` (with its starting adapter's config) as the model's ``Lora``, checked against
    the model: each target and trained module names one of its modules."""
    given = config.model_dump(include=config.model_fields_set)
    if config.adapter is not None:
        saved = _saved_config(config.adapter, f"{field}.adapter")
        for key, want in given.items():
            if key in saved and _norm(saved[key]) != _norm(want):
                raise RayhfError(
                    f"{field}.{key}: {want!r} differs from adapter {config.adapter}'s "
                    f"{saved[key]!r}; drop it or make it equal"
                )
        config = config.model_copy(update={k: v for k, v in saved.items() if k not in given})
    linear = linear_modules(spec, head=True)
    targets = config.targets
    if targets == [ALL_LINEAR]:
        targets = sorted({m.rsplit(".", 1)[-1] for m in linear_modules(spec)})
    for t in targets:
        if not any(module_named(m, (t,)) for m in linear):
            names = ", ".join(sorted({m.rsplit(".", 1)[-1] for m in linear}))
            if t == HEAD and spec.tied:
                raise RayhfError(
                    f"{field}.targets: this {spec.family} model's LM head is its embedding "
                    f"table (tied), which rayhf does not adapt; drop '{t}' or train it in full "
                    f"({field}.trains)"
                )
            moe = spec.traits.moe
            if moe is not None and t in moe.peft_fused:
                raise RayhfError(
                    f"{field}.targets: '{t}' is, to PEFT, this {spec.family} model's routed "
                    f"experts or router, and rayhf adapts neither; target among: {names}"
                )
            raise RayhfError(
                f"{field}.targets: '{t}' names no linear layer of this {spec.family} model's "
                f"decoder layers (they have: {names})"
            )
    trains, head = list(config.trains), spec.head_name.removesuffix(".weight")
    if spec.value_head and head not in trains:
        trains.append(head)
    modules = {p.name.rsplit(".", 1)[0] for p in param_shards(dataclasses.replace(spec, lora=None))}
    for t in trains:
        if not any(module_named(m, (t,)) for m in modules):
            raise RayhfError(f"{field}.trains: '{t}' names no module of this {spec.family} model")
    return Lora(
        config.rank, config.alpha, tuple(targets), config.rslora, tuple(trains), config.dropout
    )


def _norm(value):
    return sorted(value) if isinstance(value, list) else value


def _saved_config(path: str, field: str) -> dict:
    """A PEFT adapter directory's config as ``LoraConfig`` fields."""
    lora = read_adapter_config(path, field)
    return {
        "rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
        "rslora": lora.rslora, "trains": list(lora.trains),
    }  # fmt: skip


def merged(
    state: Mapping[str, torch.Tensor], lora: Lora, conv1d: bool = False
) -> dict[str, torch.Tensor]:
    """``state`` (a whole model's, by rayhf's names) with each adapted weight merged, ``W + s B A``
    as PEFT's ``merge_and_unload`` (``conv1d``: the weights are GPT-2's ``[in, out]``), and no
    adapter tensors: the model an engine that runs no adapters (vLLM) samples with."""
    out = {k: v for k, v in state.items() if ".lora_" not in k}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        b, w = state[f"{module}.lora_B.weight"], out[f"{module}.weight"]
        kept_in_out = conv1d and module != HEAD  # (GPT-2's head is a linear layer)
        out[f"{module}.weight"] = merge_pair(w, a, b, lora.scale, kept_in_out)
    return out


def merge_pair(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    kept_in_out: bool,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weight ``w`` with its adapter pair merged in, ``W + scale B A`` summed in fp32, in
    ``dtype`` (None: ``w``'s); ``kept_in_out``: ``w`` is kept ``[in, out]`` (GPT-2's Conv1D).
    Whole weights or one rank's shards alike: the pair is split as its weight is."""
    delta = b.float() @ a.float() * scale
    return (w.float() + (delta.T if kept_in_out else delta)).to(dtype or w.dtype)


def adapted(files: ModelFiles, lora: Lora | None, config_text: str | None = None) -> ModelFiles:
    """``files`` whose model carries ``lora``'s adapters (None: none), saved with PEFT's
    ``config_text``."""
    spec = dataclasses.replace(files.spec, lora=lora)
    return dataclasses.replace(files, spec=spec, adapter_config=config_text)


def initial(p: ParamShard) -> torch.Tensor:
    """PEFT's starting values: A Kaiming-uniform (seeded by its name, so every rank draws the
    same), B zeros: a fresh adapter changes nothing."""
    if ".lora_B." in p.name:
        return torch.zeros(p.shape)
    gen = torch.Generator().manual_seed(zlib.crc32(p.name.encode()))
    bound = 1 / math.sqrt(p.shape[1])  # kaiming_uniform_ with a = sqrt(5), as nn.Linear's
    return (torch.rand(p.shape, generator=gen) * 2 - 1) * bound


PEFT_PREFIX = "base_model.model."


def from_peft(
    state: Mapping[str, torch.Tensor], adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict (or a saved adapter's) under rayhf's names: the prefix and the
    adapter's name dropped, each wrapped layer's weight under its own name again."""
    out = {}
    for key, t in state.items():
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        out[
            name.replace(f".lora_A.{adapter}.", ".lora_A.").replace(
                f".lora_B.{adapter}.", ".lora_B."
            )
        ] = t
    return out


ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_config(lora: Lora, base: str | None = None, conv1d: bool = False):
    """``lora`` as PEFT's ``LoraConfig`` (``base``: the base model's path, recorded in it;
    ``conv1d``: its weights are GPT-2's ``[in, out]``)."""
    from peft import LoraConfig as PeftLora

    return PeftLora(
        r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # (a float works)
        target_modules=list(lora.targets),
        use_rslora=lora.rslora, modules_to_save=list(lora.trains) or None,
        base_model_name_or_path=base, lora_dropout=lora.dropout, fan_in_fan_out=conv1d,
    )  # fmt: skip


def adapter_config_text(lora: Lora, base: str | None = None, conv1d: bool = False) -> str:
    """The ``adapter_config.json`` PEFT writes for ``lora``: rendered where peft is imported
    (the driver), written by workers that do not import it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        peft_config(lora, base, conv1d).save_pretrained(tmp)
        return (Path(tmp) / ADAPTER_CONFIG).read_text()


def write_adapter(
    state: Mapping[str, torch.Tensor], lora: Lora, out_dir: str | Path, config_text: str
) -> None:
    """The adapters of ``state`` (a whole model's, by rayhf's names) and the modules that train
    in full (``lora.trains``), written as PEFT writes an adapter, with its ``config_text``:
    ``PeftModel.from_pretrained`` loads the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = {n: t for n, t in state.items() if ".lora_" in n or lora.trains_whole(n)}
    tensors = {f"{PEFT_PREFIX}{n}": t.contiguous() for n, t in kept.items()}
    save_file(tensors, out / ADAPTER_FILE, metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(config_text)


def save_adapter(
    state: Mapping[str, torch.Tensor], lora: Lora, out_dir: str | Path, base: str | None = None
) -> None:
    """``write_adapter`` with the config rendered here."""
    write_adapter(state, lora, out_dir, adapter_config_text(lora, base))


def read_adapter_config(path: str | Path, field: str = "adapter") -> Lora:
    """A PEFT adapter directory's ``Lora``."""
    from peft import LoraConfig as PeftLora

    where = Path(path)
    if not (where / ADAPTER_CONFIG).is_file():
        raise RayhfError(
            f"{field}: {where} has no {ADAPTER_CONFIG}; a LoRA adapter is a PEFT adapter directory"
        )
    cfg = PeftLora.from_pretrained(str(where))
    if isinstance(cfg.target_modules, str) or cfg.rank_pattern or cfg.alpha_pattern:
        raise RayhfError(
            f"{field}: {where / ADAPTER_CONFIG} gives target_modules as a regex, rank_pattern or "
            "alpha_pattern, which are not read; name the target modules as a list"
        )
    if cfg.target_parameters:
        params = ", ".join(sorted(cfg.target_parameters))
        raise RayhfError(
            f"{field}: {where / ADAPTER_CONFIG} adapts parameters ({params}), a "
            "Mixture-of-Experts model's routed experts, which rayhf does not adapt"
        )
    targets = tuple(sorted(cfg.target_modules or ()))
    trains = tuple(cfg.modules_to_save or ())
    return Lora(cfg.r, float(cfg.lora_alpha), targets, bool(cfg.use_rslora), trains)


def read_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory's tensors, by rayhf's names (no peft import: a worker reads it)."""
    from safetensors.torch import load_file

    return from_peft(load_file(str(Path(path) / ADAPTER_FILE)))


def load_adapter(path: str | Path) -> tuple[Lora, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's ``Lora`` and tensors (by rayhf's names)."""
    return read_adapter_config(path), read_adapter(path)
