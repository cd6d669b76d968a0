"""The copies of a model's matmul weights a decode engine lends its step
(``ShardedModel.lendable``): cast to the autocast dtype for fp32 master weights that compute in
bf16, or oneDNN-packed on CPUs (``rayhf.parallel.decode.DecodeEngine._lend_weights`` chooses).
An LM head that runs in fp32 (``Numerics.fp32_lm_head``) is lent in fp32: the weight itself, or
a copy of a low one, made once instead of at every token."""

from __future__ import annotations

import functools

import torch

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
    model: ShardedModel, low: torch.dtype | None, pack: bool
) -> dict[str, torch.Tensor]:
    """What the engine lends ``model`` (``ShardedModel.lendable``): each group's weights as
    one ``[out, in]`` matrix, with its biases joined under ``{key}.bias``; cast to ``low``, or
    (``pack``) oneDNN-packed where large enough, else fp32 (a single weight: itself). An fp32
    LM head (``Numerics.head_in_fp32``) is lent in fp32, and with neither ``low`` nor ``pack``
    alone."""
    lent: dict[str, torch.Tensor] = {}
    fp32_head = model.head_name if model.numerics.head_in_fp32 else None
    for key, names in model.lendable().items():
        if key == fp32_head:
            lent[key] = model.param(key).float()
            continue
        if low is None and not pack:
            continue
        if len(names) == 1:
            weight = (
                model.param(names[0]) if low is None else model.param(names[0]).to(low).contiguous()
            )
        else:
            weight = torch.cat([model.param(n) for n in names])
            weight = weight if low is None else weight.to(low)
            biases = [_bias(model, n) for n in names]
            if biases[0] is not None:
                lent[f"{key}.bias"] = torch.cat(biases)  # type: ignore[arg-type]
        if pack and weight.numel() >= PACK_MIN_ELEMENTS:
            out_in = weight if len(names) > 1 else model.weight_out_in(names[0])
            weight = torch.ops.mkldnn._reorder_linear_weight(out_in.contiguous(), None)
        lent[key] = weight
    return lent


def _bias(model: ShardedModel, weight: str) -> torch.Tensor | None:
    """The bias beside matmul weight ``weight`` (``...proj.weight`` -> ``...proj.bias``)."""
    return model.param_or_none(weight.removesuffix(".weight") + ".bias")


def refresh_lent(lent: dict[str, torch.Tensor], model: ShardedModel) -> None:
    """Copy ``model``'s weights into the cast copies of ``lent_weights``, in place."""
    for key, names in model.lendable().items():
        if key not in lent:
            continue
        row = 0
        for name in names:
            weight = model.param(name)
            lent[key][row : row + weight.shape[0]].copy_(weight)
            bias = _bias(model, name)
            if f"{key}.bias" in lent and bias is not None:
                lent[f"{key}.bias"][row : row + weight.shape[0]].copy_(bias)
            row += weight.shape[0]
