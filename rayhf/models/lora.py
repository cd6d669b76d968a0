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

from rayhf.errors import RayhfError
from rayhf.models.sharding import ParamShard
from rayhf.models.spec import Lora

if TYPE_CHECKING:
    from rayhf.models.files import ModelFiles


def adapted(files: ModelFiles, lora: Lora | None) -> ModelFiles:
    """``files`` whose model carries ``lora``'s adapters (None: none)."""
    return dataclasses.replace(files, spec=dataclasses.replace(files.spec, lora=lora))


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


def peft_config(lora: Lora, base: str | None = None):
    """``lora`` as PEFT's ``LoraConfig`` (``base``: the base model's path, recorded in it)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # (a float works)
        target_modules=list(lora.targets),
        use_rslora=lora.rslora, modules_to_save=list(lora.trains) or None,
        base_model_name_or_path=base, lora_dropout=0.0,
    )  # fmt: skip


def save_adapter(
    state: Mapping[str, torch.Tensor], lora: Lora, out_dir: str | Path, base: str | None = None
) -> None:
    """The adapters of ``state`` (a whole model's, by rayhf's names) written as PEFT writes an
    adapter: ``PeftModel.from_pretrained`` loads the directory."""
    from safetensors.torch import save_file

    if lora.trains:
        raise RayhfError(
            f"lora.trains: saving {list(lora.trains)} beside the adapters is not built"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapters = {f"{PEFT_PREFIX}{n}": t.contiguous() for n, t in state.items() if ".lora_" in n}
    save_file(adapters, out / ADAPTER_FILE, metadata={"format": "pt"})
    peft_config(lora, base).save_pretrained(str(out))


def load_adapter(path: str | Path) -> tuple[Lora, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's ``Lora`` and tensors (by rayhf's names)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    where = Path(path)
    if not (where / ADAPTER_CONFIG).is_file():
        raise RayhfError(
            f"{where}: no {ADAPTER_CONFIG}; a LoRA adapter is a PEFT adapter directory"
        )
    cfg = LoraConfig.from_pretrained(str(where))
    if isinstance(cfg.target_modules, str) or cfg.rank_pattern or cfg.alpha_pattern:
        raise RayhfError(
            f"{where / ADAPTER_CONFIG}: target_modules as a regex, rank_pattern and alpha_pattern "
            "are not read; name the target modules as a list"
        )
    targets = tuple(sorted(cfg.target_modules or ()))
    trains = tuple(cfg.modules_to_save or ())
    lora = Lora(cfg.r, float(cfg.lora_alpha), targets, bool(cfg.use_rslora), trains)
    return lora, from_peft(load_file(str(where / ADAPTER_FILE)))
