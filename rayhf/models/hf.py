"""Hugging Face causal LMs: create tiny ones from a config, load from a local directory.

The actor and reference are ``AutoModelForCausalLM``; critic and reward models are the same
backbone with a scalar head (``AutoModelForSequenceClassification`` with one label), whose
``score`` layer we apply to every token to get per-token values. Both save with
``save_pretrained`` and load offline; nothing is downloaded.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig

from rayhf.errors import RayhfError
from rayhf.models.families import family_traits, name_registered_row, text_tower
from rayhf.models.init import ModelInit

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rayhf.models.families import FamilyTraits
    from rayhf.models.files import ModelFiles

# Hugging Face's model classes are imported where a model is built or loaded whole, not here:
# their import (the modelling stack, torch._dynamo) costs a process about 1.5 s. Role-group
# workers import none of this module: the driver renders what they need (``model_files``).


def hf_config(init: ModelInit, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    """The Hugging Face config for ``init`` with the tokenizer's vocabulary (or a padded one)
    and special ids."""
    fields = dict(init.config)
    padded = int(fields.pop("vocab_size", vocab_size))
    if padded < vocab_size:
        raise RayhfError(
            f"init.config.vocab_size={padded} is below the tokenizer's {vocab_size} tokens; "
            "raise it or leave it out"
        )
    traits = family_traits(init.family)
    names = traits.config_names
    cls = getattr(transformers, traits.hf_config_class)
    inter = init.intermediate_size
    if inter is None and traits.mlp_ratio is not None:
        inter = int(traits.mlp_ratio * init.hidden_size)
    extra: dict[str, Any] = dict.fromkeys(names.zeroed, 0.0)  # RLHF log-probs must reproduce
    if traits.rope:
        extra.update(_rope_model_fields(init, traits))
    if names.n_kv_heads is not None:
        extra[names.n_kv_heads] = init.n_kv_heads or init.n_heads
    sizes = {
        names.hidden_size: init.hidden_size,
        names.n_layers: init.n_layers,
        names.n_heads: init.n_heads,
        names.intermediate_size: inter,
        names.max_positions: init.max_positions,
    }
    config = cls(
        **extra,
        vocab_size=padded,
        **sizes,
        tie_word_embeddings=init.tied,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **fields,
    )
    name_registered_row(config, init.family)
    return config


def _rope_model_fields(init: ModelInit, traits: FamilyTraits) -> dict[str, Any]:
    """A RoPE model's head size, RoPE, window and (alternating) layer types."""
    extra: dict[str, Any] = {"head_dim": init.hidden_size // init.n_heads}  # Qwen3's is 128
    if init.rope_parameters is not None and traits.rope_per_layer_type:
        extra["rope_parameters"] = init.rope_parameters
    elif init.rope_parameters is not None:
        extra["rope_parameters"] = {"rope_theta": 10000.0, **init.rope_parameters}
    if init.sliding_window is not None:
        extra["sliding_window"] = init.sliding_window
    if traits.alternating_layer_types:  # sliding and full attention alternate, as in Gemma 2
        extra["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(init.n_layers)
        ]
    return extra


def build_model(config: PretrainedConfig, value_head: bool, seed: int = 0) -> PreTrainedModel:
    """A randomly initialized model (fp32, eager attention so CPU results are exact)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    if value_head:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float()


def save_model(model: PreTrainedModel, out_dir: str | Path, tokenizer=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _quiet_deepspeed_guess()
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _quiet_deepspeed_guess() -> None:
    """Keep DeepSpeed's "Setting accelerator to CPU" warning off stdout. ``save_pretrained``
    unwraps the model through accelerate (peft's dependency), which imports DeepSpeed wherever it
    is installed; on a machine without a GPU its import prints that guess, into ``rayhf plan``'s
    table. Its logger is named before DeepSpeed creates it, so the filter is in place first."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _NoAcceleratorGuess) for f in logger.filters):
        logger.addFilter(_NoAcceleratorGuess())


class _NoAcceleratorGuess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def read_model_config(path: str | Path, value_head: bool, field: str) -> PretrainedConfig:
    """A local model directory's config (one label for a value head); ``field`` names the
    config entry in errors."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise RayhfError(f"{field}: {p} is not a model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise _unloadable(p, field, e) from None
    if value_head:  # a critic of a released multimodal checkpoint: its text tower alone
        config = text_tower(config)
        config.num_labels = 1
    return config


def _unloadable(p: Path, field: str, e: Exception) -> RayhfError:
    return RayhfError(f"{field}: cannot load a model from {p}: {str(e).splitlines()[0]}")


def _from_pretrained(p: Path, config: PretrainedConfig, value_head: bool, field: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    try:
        model = cls.from_pretrained(
            p, config=config, local_files_only=True, attn_implementation="eager"
        )
    except (OSError, ValueError, KeyError) as e:
        raise _unloadable(p, field, e) from None
    return model.float()


def load_model(path: str | Path, value_head: bool, field: str) -> PreTrainedModel:
    """Load a local model directory; ``field`` names the config entry in errors."""
    config = read_model_config(path, value_head, field)
    return _from_pretrained(Path(path), config, value_head, field)


def load_weights(
    path: str | Path, value_head: bool, field: str
) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """A local model directory's config and fp32 weights under the names ``model_spec`` gives
    them, read from its safetensors files (``rayhf.models.files.read_weights``) without building
    the model. When the files do not hold every one of those names (a critic from a causal LM's
    directory: no ``score`` head; another naming; .bin weights), the model is built as
    ``load_model`` builds it, and its state dict is the answer."""
    from rayhf.models.files import read_weights
    from rayhf.models.spec import model_spec

    p = Path(path)
    config = read_model_config(p, value_head, field)
    state = read_weights(p, model_spec(config, value_head))
    if state is None:
        model = _from_pretrained(p, config, value_head, field)
        return model.config, model.state_dict()
    return config, state


def model_files(config: PretrainedConfig, value_head: bool, path: str | None = None) -> ModelFiles:
    """What a role-group worker needs to read and save this model without transformers: its
    spec, and config.json (and generation_config.json for a causal LM) as ``save_pretrained``
    of a model built from ``config`` writes them. A released multimodal checkpoint read from
    ``path`` is saved as one again, its other tensors copied from there."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    from rayhf.models.files import ModelFiles
    from rayhf.models.spec import model_spec

    saved = copy.deepcopy(config)
    names = (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
        if value_head
        else (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    )
    dtype = str(saved.dtype or torch.float32).removeprefix("torch.")  # what from_config builds
    released = path if text_tower(config) is not config else None
    saved.dtype = dtype
    if released is None:  # the architecture of the config's class (a registered row may
        saved.architectures = [names[type(saved).model_type]]  # rename its model type)
    with tempfile.TemporaryDirectory() as tmp:
        saved.save_pretrained(tmp)
        if not value_head:
            GenerationConfig.from_model_config(saved).save_pretrained(tmp)
        texts = tuple((f.name, f.read_text()) for f in sorted(Path(tmp).glob("*.json")))
    return ModelFiles(model_spec(config, value_head), dtype, texts, released)


def per_token_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Scalar head applied to every position: ``[B, T]`` values."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask)[0]
    head = model.get_submodule("score")
    return head(hidden).squeeze(-1)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
