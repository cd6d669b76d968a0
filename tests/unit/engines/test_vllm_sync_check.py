"""Checking a weight sync into vLLM without vLLM: the checksum, which sent tensors each vLLM
parameter is made of (fused, padded, tied, renamed), what a vLLM-shaped model reports after a
reload (its CPU kernels' repacking included), and the one-line error naming the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayhf.engines import vllm_sync_check as sc
from rayhf.errors import RayhfError

Q, K, V = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
QKV = "model.layers.0.self_attn.qkv_proj.weight"
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
HINT = "set engines.gen.check_sync: false to skip this check"


# ----- checksum -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "bits"), [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)]
)
def test_checksum_is_the_sum_of_the_values_bit_patterns_modulo_2_32(dtype, bits):
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = sum(t.view(bits).flatten().tolist())
    assert sc.checksum(t) == exact % 2**32
    assert sc.checksum(t.t()) == sc.checksum(t)  # any layout: a transposed copy sums the same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_single_changed_value_changes_the_checksum(dtype):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i in (0, 517, 999):
        for changed in (torch.nextafter(t[i], torch.tensor(9.0, dtype=dtype)), -t[i]):
            other = t.clone()
            other[i] = changed  # the next value up, or the sign bit (an 8-byte value's high bits)
            assert sc.checksum(other) != sc.checksum(t)


def test_checksums_add_up_across_concatenation_whatever_the_order():
    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, 8, generator=gen) for n in (4, 2, 2)]
    total = sum(sc.checksum(p) for p in parts) % 2**32
    assert sc.checksum(torch.cat(parts)) == total  # a fused parameter against its parts
    assert sc.checksum(torch.cat(parts[::-1])) == total
    assert sc.checksum(torch.cat(parts).flatten()[torch.randperm(64, generator=gen)]) == total


# ----- which sent tensors each vLLM parameter is made of ------------------------------------


def test_fused_parameters_are_made_of_their_parts():
    sent = {Q: (4, 4), K: (2, 4), V: (2, 4), NORM: (4,)}
    got = sc.match({QKV: (8, 4), NORM: (4,)}, PACKED, sent)
    assert got.groups == (sc.Group(QKV, (Q, K, V)), sc.Group(NORM, (NORM,)))
    assert got.unused == ()


def test_a_padded_vocabulary_compares_the_rows_the_sent_tensor_fills():
    got = sc.match({EMBED: (64, 4)}, PACKED, {EMBED: (17, 4)})
    assert got.groups == (sc.Group(EMBED, (EMBED,), rows=17),)
    bad = sc.match({EMBED: (64, 4), QKV: (10, 4)}, PACKED, {EMBED: (65, 4), Q: (4, 4), V: (2, 4)})
    assert [g.problem for g in bad.groups] == [
        "holds 256 values where 260 were sent",
        "holds 40 values where 24 were sent",  # a fused parameter missing a part is never padded
    ]


def test_a_tied_head_vllm_does_not_hold_is_reported_unused_for_the_caller_to_skip():
    got = sc.match({EMBED: (64, 4)}, PACKED, {EMBED: (17, 4), HEAD: (17, 4)})
    assert got.groups == (sc.Group(EMBED, (EMBED,), rows=17),) and got.unused == (HEAD,)
    both = sc.match({EMBED: (17, 4), HEAD: (17, 4)}, PACKED, {EMBED: (17, 4), HEAD: (17, 4)})
    assert both.unused == () and both.groups[1] == sc.Group(HEAD, (HEAD,))  # held: checked


def test_uncovered_parameters_and_unused_tensors_are_both_found():
    got = sc.match({QKV: (8, 4), NORM: (4,)}, PACKED, {Q: (4, 4), K: (2, 4), V: (2, 4), "x": (1,)})
    assert got.groups[1] == sc.Group(NORM, (), problem="gets no tensor from the sync")
    assert got.unused == ("x",)


def test_the_models_renaming_comes_first_and_may_drop_a_tensor():
    def rename(name):  # as vLLM's hf_to_vllm_mapper.map_name
        return None if name.endswith(".attn.bias") else name.replace("transformer.", "model.")

    sent = {"transformer.h.0.attn.bias": (1, 1), "transformer.wte.weight": (3, 4)}
    got = sc.match({"model.wte.weight": (3, 4)}, PACKED, sent, rename)
    assert got.groups == (sc.Group("model.wte.weight", ("transformer.wte.weight",)),)
    assert got.unused == ()  # the dropped buffer is vLLM's choice, not a lost weight


# ----- a vLLM-shaped model: report after a reload, compare ----------------------------------


class RepackedLinear:
    """As vLLM's CPU GEMMs do: after loading, keep the weight in the kernel's own format and
    leave the parameter empty."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class VllmLike(nn.Module):
    """A vLLM model's shape: q/k/v fused, the vocabulary padded from 5 rows to 8, the head tied
    to the embedding (not held), the linear repacked; ``load`` loads as vLLM's loaders do."""

    packed_modules_mapping = PACKED

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = _with_weight(torch.zeros(8, 4))
        self.model.norm = _with_weight(torch.zeros(4))
        self.model.layers = nn.ModuleList([nn.Module()])
        qkv = _with_weight(torch.zeros(8, 4))
        qkv.quant_method = RepackedLinear()
        self.model.layers[0].self_attn = nn.Module()
        self.model.layers[0].self_attn.qkv_proj = qkv

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        qkv = self.model.layers[0].self_attn.qkv_proj
        if Q in weights:  # a layer vLLM gets no weights for is left as it was
            qkv.weight = nn.Parameter(torch.cat([weights[Q], weights[K], weights[V]]))
            qkv.quant_method.process_weights_after_loading(qkv)
        with torch.no_grad():
            self.model.embed_tokens.weight[:5] = weights[EMBED]
            self.model.norm.weight.copy_(weights[NORM])


def _with_weight(t: torch.Tensor) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(t, requires_grad=False)
    return module


def sent_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {EMBED: (5, 4), Q: (4, 4), K: (2, 4), V: (2, 4), NORM: (4,)}
    out = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    out[HEAD] = out[EMBED]  # full_state sends a tied head as its own tensor
    return out


def held_after(model: VllmLike, weights: dict[str, torch.Tensor]) -> sc.HeldWeights:
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    return sc.held_after(model, lambda: model.load(weights), shapes, frozenset({HEAD}))


def test_a_good_reload_is_reported_and_passes():
    model, weights = VllmLike(), sent_weights()
    held = held_after(model, weights)
    assert held.model == "VllmLike" and held.unused == ()  # the tied head is skipped
    groups = {h.group.name: h.group for h in held.params}
    assert groups[QKV].parts == (Q, K, V) and groups[EMBED].rows == 5
    assert model.model.layers[0].self_attn.qkv_proj.weight.numel() == 0  # read before repacking
    method = model.model.layers[0].self_attn.qkv_proj.quant_method
    assert "process_weights_after_loading" not in vars(method)  # the hook is undone
    sc.verify(held, weights, HINT)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    unskipped = sc.held_after(model, lambda: model.load(weights), shapes, ())
    with pytest.raises(RayhfError, match=r"lm_head\.weight is sent but no parameter of VllmLike"):
        sc.verify(unskipped, weights, HINT)


def test_bf16_vllm_weights_compare_with_the_sent_tensors_cast_to_bf16():
    model, weights = VllmLike().to(torch.bfloat16), sent_weights()
    held = sc.held_after(
        model, lambda: model.load({n: t.bfloat16() for n, t in weights.items()}),
        {n: tuple(t.shape) for n, t in weights.items()}, frozenset({HEAD}),
    )  # fmt: skip
    assert {h.dtype for h in held.params} == {torch.bfloat16}
    sc.verify(held, weights, HINT)  # the fp32 sent tensors, cast as vLLM cast them


def test_a_differing_parameter_is_named_in_one_line():
    model, weights = VllmLike(), sent_weights()
    loaded = dict(weights)
    loaded[K] = weights[K].clone()
    loaded[K][1, 2] += 1.0  # one value of k_proj differs from what the rank sent
    held = sc.held_after(
        model, lambda: model.load(loaded), {n: tuple(t.shape) for n, t in weights.items()},
        frozenset({HEAD}),
    )  # fmt: skip
    with pytest.raises(RayhfError) as info:
        sc.verify(held, weights, HINT)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"vLLM weight sync: {QKV} (from {Q}, {K}, {V}) differs from the rank's")
    assert "(checksum " in msg and msg.endswith(f"; {HINT}")


def test_an_unloaded_parameter_is_named_with_the_count_of_the_others():
    model, weights = VllmLike(), sent_weights()
    held_after(model, weights)  # its linear is repacked now, as after a first sync
    del weights[Q], weights[K], weights[V]
    held = held_after(model, weights)  # nothing reaches the fused parameter this time
    with pytest.raises(RayhfError, match=f"^vLLM weight sync: {QKV} gets no tensor from the sync;"):
        sc.verify(held, weights, HINT)
    with torch.no_grad():
        model.model.norm.weight[0] += 1  # vLLM's norm differs too, and its tied head is unused
    held = sc.held_after(model, lambda: None, {n: tuple(t.shape) for n, t in weights.items()}, ())
    with pytest.raises(RayhfError, match=rf"^vLLM weight sync: {NORM} differs .* \(and 2 more\);"):
        sc.verify(held, weights, HINT)


def test_the_rank_s_checksums_computed_ahead_are_used_and_other_dtypes_computed_then():
    model, weights = VllmLike(), sent_weights()
    held = held_after(model, weights)
    sums = sc.sent_checksums(weights, torch.float32)
    assert sums[NORM, torch.float32] == sc.checksum(weights[NORM])
    sc.verify(held, weights, HINT, sums)
    sums[NORM, torch.float32] += 1  # taken as given: the ahead-of-time sum is what is compared
    with pytest.raises(RayhfError, match=f"^vLLM weight sync: {NORM} differs"):
        sc.verify(held, weights, HINT, sums)
    sc.verify(held, weights, HINT, sc.sent_checksums(weights, torch.bfloat16))  # not vLLM's
