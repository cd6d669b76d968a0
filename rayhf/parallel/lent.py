"""The copies of a model's matmul weights a decode engine lends its step
(``ShardedModel.lendable``): cast to the autocast dtype for fp32 master weights that compute in
bf16, or oneDNN-packed on CPUs (``rayhf.parallel.decode.DecodeEngine.lend_weights`` chooses).
An LM head that runs in fp32 (``Numerics.fp32_lm_head``) is lent in fp32: the weight itself, or
a copy of a low one, made once instead of at every token. With ``merge``, each LoRA-adapted
weight is lent with its adapter merged in (``W + s B A``, summed in fp32): the step then
multiplies one matrix where the unmerged adapter costs two more small products, and the weights
themselves, which the reference reads with the adapters off, stay as they are."""

from __future__ import annotations

import functools

import torch

from rayhf.models.lora import merge_pair
from rayhf.parallel.model import ShardedModel


@functools.cache
def packable() -> bool:
    """Whether this torch packs linear weights for oneDNN (an op inductor uses on CPUs)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 4.0)))
    except (AttributeError, RuntimeError):
        return False


# Smaller weights stay unpacked: a packed call costs ~15 us more at one row (a 24-row LM head
# gains nothing). Packing the tiny model's 256x256 to 768x256 weights too gains 1-2% of a call's
# tokens/s (both bounds in one process, interleaved; decision record 0075).
PACK_MIN_ELEMENTS = 1 << 16


def lent_weights(
    model: ShardedModel, low: torch.dtype | None, pack: bool, merge: bool = False
) -> dict[str, torch.Tensor]:
    """What the engine lends ``model`` (``ShardedModel.lendable``): each group's weights as
    one ``[out, in]`` matrix, with its biases joined under ``{key}.bias``; cast to ``low``, or
    (``pack``) oneDNN-packed where large enough, else fp32 (a single weight: itself). An fp32
    LM head (``Numerics.head_in_fp32``) is lent in fp32, and with neither ``low`` nor ``pack``
    alone. With ``merge``, every adapted weight is lent, its adapter merged in."""
    lent: dict[str, torch.Tensor] = {}
    fp32_head = model.head_name if model.numerics.head_in_fp32 else None
    for key, names in model.lendable().items():
        if key == fp32_head:
            lent[key] = _kept(model, key, merge, torch.float32)
            continue
        if low is None and not pack and not (merge and any(n in model.adapters for n in names)):
            continue
        if len(names) == 1:
            weight = _kept(model, names[0], merge, low).contiguous()
        else:
            weight = torch.cat([_kept(model, n, merge, low) for n in names])
            biases = [_bias(model, n) for n in names]
            if biases[0] is not None:
                lent[f"{key}.bias"] = torch.cat(biases)  # type: ignore[arg-type]
        if pack and weight.numel() >= PACK_MIN_ELEMENTS:
            out_in = weight.T if len(names) == 1 and model.kept_in_out(names[0]) else weight
            weight = torch.ops.mkldnn._reorder_linear_weight(out_in.contiguous(), None)
        lent[key] = weight
    return lent


def _kept(model: ShardedModel, name: str, merge: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """Weight ``name`` as the model keeps it, cast to ``dtype`` (None: as it is; no copy); with
    ``merge`` and an adapter, a copy with it merged in, summed in fp32."""
    weight = model.param(name)
    pair = model.adapters.get(name) if merge else None
    if pair is None:
        return weight if dtype is None else weight.to(dtype)
    assert model.spec.lora is not None
    a, b = model.param(pair.a.name), model.param(pair.b.name)
    return merge_pair(weight, a, b, model.spec.lora.scale, model.kept_in_out(name), dtype)


def _bias(model: ShardedModel, weight: str) -> torch.Tensor | None:
    """The bias beside matmul weight ``weight`` (``...proj.weight`` -> ``...proj.bias``)."""
    return model.param_or_none(weight.removesuffix(".weight") + ".bias")


def refresh_lent(lent: dict[str, torch.Tensor], model: ShardedModel, merge: bool = False) -> None:
    """Copy ``model``'s weights into the cast copies of ``lent_weights`` (made with the same
    ``merge``), in place."""
    for key, names in model.lendable().items():
        if key not in lent:
            continue
        row = 0
        for name in names:
            weight = _kept(model, name, merge, None)
            lent[key][row : row + weight.shape[0]].copy_(weight)
            bias = _bias(model, name)
            if f"{key}.bias" in lent and bias is not None:
                lent[f"{key}.bias"][row : row + weight.shape[0]].copy_(bias)
            row += weight.shape[0]
