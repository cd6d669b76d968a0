"""A model directory read and written without transformers.

A role-group worker needs a model's shape, its weights and, to save, the JSON files Hugging Face
writes beside them. Importing transformers' config, model and tokenizer classes costs a worker
process about 2.5 s of start-up on 2 CPU cores (decision record 0088), so the driver, which has
them loaded anyway, reads the config and renders those files once (``rayhf.models.hf.
model_files``); a worker gets the result as a ``ModelFiles`` and reads and writes safetensors
itself. A directory written here loads with ``AutoModelForCausalLM.from_pretrained`` (or
``AutoModelForSequenceClassification`` for a value head) as one written by ``save_pretrained``.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rayhf.models.families import TOWER
from rayhf.models.sharding import layer_prefix, param_shards
from rayhf.models.spec import ModelSpec

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 50 * 2**30  # Hugging Face's default max_shard_size


def quiet_transformers() -> None:
    """No per-file progress bars or info logs from transformers (one run saves many models)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


SPECIAL = ("pad_token_id", "eos_token_id", "bos_token_id")


def special_ids(tokenizer: Any) -> dict[str, int | None]:
    """The ids a ``TokenizerDir`` knows without loading its tokenizer."""
    return {k: getattr(tokenizer, k) for k in SPECIAL}


class TokenizerDir:
    """A directory the driver saved a tokenizer alone in, with the special ids it read: the ids
    at once, ``save_pretrained`` as a copy of the files, everything else (encode, decode, chat
    templates) from the tokenizer, loaded on first use. Most ranks only need the ids and the
    copy, and loading the tokenizer imports transformers."""

    def __init__(
        self, path: str, pad_token_id: int | None, eos_token_id: int | None,
        bos_token_id: int | None,
    ) -> None:  # fmt: skip
        self.path = path
        self.pad_token_id, self.eos_token_id, self.bos_token_id = (
            pad_token_id, eos_token_id, bos_token_id,
        )  # fmt: skip

    def save_pretrained(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.path).iterdir():
            if f.is_file():
                shutil.copyfile(f, out / f.name)

    @functools.cached_property
    def decoder(self) -> Any | None:
        """The ``tokenizers`` tokenizer of the directory's tokenizer.json, where decoding with it
        is all transformers' fast tokenizer does (no clean-up of spaces set); else None. A
        reward function's rank decodes with it and never imports transformers, about 3 s of a
        worker's start-up on 2 CPU cores (decision record 0095)."""
        p = Path(self.path)
        config = p / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {}
        if not (p / "tokenizer.json").is_file() or settings.get("clean_up_tokenization_spaces"):
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(p / "tokenizer.json"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """``ids`` as text, as the loaded tokenizer's ``decode`` gives it."""
        if self.decoder is None:
            return self.loaded.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.decoder.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def loaded(self) -> Any:
        from transformers import AutoTokenizer

        quiet_transformers()
        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def __getattr__(self, name: str) -> Any:  # what is not set above: the tokenizer's
        # while unpickling, before these are set
        if name.startswith("__") or name in ("path", "loaded", "decoder"):
            raise AttributeError(name)
        return getattr(self.loaded, name)


@dataclass(frozen=True)
class ModelFiles:
    """A model's shape, the dtype its weights are saved in, and the JSON files (name, text)
    written beside them, as Hugging Face's ``save_pretrained`` writes them."""

    spec: ModelSpec
    dtype: str = "float32"
    texts: tuple[tuple[str, str], ...] = ()
    released: str | None = None
    """The directory of the released multimodal checkpoint this model is the text tower of:
    saves put the tower under ``model.language_model`` and copy that checkpoint's other
    tensors (vision tower, MTP heads) as they are there."""
    adapter_config: str | None = None
    """With ``spec.lora``: PEFT's ``adapter_config.json`` for the adapters, written with them
    under ``adapter/`` beside the model's files."""

    def write_texts(self, out_dir: str | Path) -> None:
        """The JSON files alone (a model's shape, for an engine that loads its weights later)."""
        for name, text in self.texts:
            (Path(out_dir) / name).write_text(text)


ADAPTER_DIR = "adapter"  # a LoRA model's adapters, PEFT's directory, beside its files


def weight_files(path: str | Path) -> dict[str, Path]:
    """Which safetensors file of a model directory holds each tensor (empty: none does)."""
    from safetensors import safe_open

    p = Path(path)
    if (p / INDEX).is_file():
        return {k: p / f for k, f in json.loads((p / INDEX).read_text())["weight_map"].items()}
    if (p / WEIGHTS).is_file():
        with safe_open(p / WEIGHTS, framework="pt") as f:
            return dict.fromkeys(f.keys(), p / WEIGHTS)
    return {}


def saved_names(spec: ModelSpec) -> dict[str, list[str]]:
    """Each parameter's name in memory -> the tensors ``save_pretrained`` writes of it: itself,
    except for stacked experts, saved one tensor per expert (``experts.{e}.gate_proj.weight``,
    ..., or Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``, ...), gate|up as every
    expert's gate, then every expert's up."""
    out = {p.name: [p.name] for p in param_shards(spec) if ".lora_" not in p.name}
    if spec.moe is None or spec.traits.moe is None or spec.traits.moe.files == "stacked":
        return out
    mixtral = spec.traits.moe.files == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in spec.moe_layers:
        m = f"{layer_prefix(spec, i)}.mlp"
        disk = f"{layer_prefix(spec, i)}.block_sparse_moe" if mixtral else m
        each = [f"{disk}.experts.{e}" for e in range(spec.moe.n_experts)]
        out[f"{m}.experts.gate_up_proj"] = [f"{x}.{gate}.weight" for x in each] + [
            f"{x}.{up}.weight" for x in each
        ]
        out[f"{m}.experts.down_proj"] = [f"{x}.{down}.weight" for x in each]
        out[f"{m}.gate.weight"] = [f"{disk}.gate.weight"]
    return out


def join_saved(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Parameter ``name`` from the tensors ``saved_names`` lists for it."""
    if len(tensors) == 1:  # saved as it is held (stacked experts too: gpt-oss)
        return tensors[0]
    if name.endswith("experts.gate_up_proj"):
        half = len(tensors) // 2
        return torch.cat([torch.stack(tensors[:half]), torch.stack(tensors[half:])], dim=1)
    if name.endswith("experts.down_proj"):
        return torch.stack(tensors)
    (t,) = tensors
    return t


def split_saved(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``save_pretrained`` writes of parameter ``name`` (``join_saved`` undone)."""
    if name.endswith("experts.gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        return [*gate.unbind(0), *up.unbind(0)]
    if name.endswith("experts.down_proj"):
        return list(t.unbind(0))
    return [t]


def released_name(spec: ModelSpec, name: str) -> str:
    """Parameter ``name``'s name in a released multimodal checkpoint: the backbone's under
    ``model.language_model``, the head's as it is."""
    backbone = spec.prefix + "."
    return TOWER + name[len(spec.prefix) :] if name.startswith(backbone) else name


def read_weights(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor] | None:
    """The fp32 tensors of every parameter ``spec`` names, read from the directory's safetensors
    files (stacking experts saved one by one; a released multimodal checkpoint's text tower);
    None when the files do not hold them all (a critic from a causal LM's directory: no
    ``score`` head; another naming; .bin weights): then the model must be built to be read."""
    from safetensors import safe_open

    where = weight_files(path)
    saved = saved_names(spec)
    disk = {n: n for parts in saved.values() for n in parts}
    if not all(n in where for n in disk):
        disk = {n: released_name(spec, n) for n in disk}
        if not all(d in where for d in disk.values()):
            return None
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({where[d] for d in disk.values()}):
        with safe_open(file, framework="pt") as f:
            for n, d in disk.items():
                if where[d] == file:
                    tensors[n] = f.get_tensor(d).float()
    return {name: join_saved(name, [tensors[n] for n in parts]) for name, parts in saved.items()}


def write_model(out_dir: str | Path, files: ModelFiles, full: Mapping[str, torch.Tensor]) -> None:
    """Write the whole model ``full`` (Hugging Face names) as ``save_pretrained`` would: the
    weights in ``files.dtype`` without a tied head, one file up to 50 GiB, else shards with an
    index; then the JSON files."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, files.dtype)
    tied = "lm_head.weight" if files.spec.tied else None  # the embedding, saved once
    saved = saved_names(files.spec)
    state = {
        n: t.to(dtype).contiguous()
        for k, v in full.items()
        if k != tied and ".lora_" not in k
        for n, t in zip(
            saved.get(k, [k]), split_saved(k, v) if len(saved.get(k, [k])) > 1 else [v], strict=True
        )
    }
    if files.released is not None:
        state = {released_name(files.spec, n): t for n, t in state.items()}
        state |= _kept(files.released, set(state))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        stale.unlink(missing_ok=True)  # a previous save's shards
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    files.write_texts(out)
    if files.spec.lora is not None and files.adapter_config is not None:
        from rayhf.models.lora import write_adapter

        write_adapter(full, files.spec.lora, out / ADAPTER_DIR, files.adapter_config)


def _kept(path: str, tower: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of the released checkpoint in ``path`` outside its text tower, as saved."""
    from safetensors import safe_open

    where = {n: f for n, f in weight_files(path).items() if n not in tower}
    kept: dict[str, torch.Tensor] = {}
    for file in sorted(set(where.values())):
        with safe_open(file, framework="pt") as f:
            kept |= {n: f.get_tensor(n) for n, at in where.items() if at == file}
    return kept
