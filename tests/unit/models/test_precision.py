"""A role's precision: what its weights are kept in and what its matmuls run in."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import Tok, tiny_model
from rayhf.checks.parity import _batch
from rayhf.engines.rank_model import RankModel
from rayhf.models.precision import Numerics, resolve


def test_auto_is_bf16_on_gpus_and_fp32_on_cpu():
    assert resolve("auto", "cuda") == "bf16" and resolve("auto", "cuda:1") == "bf16"
    assert resolve("auto", "cpu") == "fp32" and resolve("fp16", "cpu") == "fp16"


def test_trained_copies_keep_fp32_and_autocast_frozen_copies_keep_the_low_dtype():
    trained, frozen = Numerics("bf16", master=True), Numerics("bf16")
    assert trained.storage == torch.float32 and trained.autocast == torch.bfloat16
    assert frozen.storage == torch.bfloat16 and frozen.autocast is None
    assert Numerics().autocast is None and Numerics("fp32", True).storage_name == "fp32"
    assert frozen.storage_name == "bf16"


def test_logits_leave_in_fp32_and_weights_stay_in_their_dtype_through_release():
    ids, mask = _batch()
    hf = tiny_model("llama", {"n_heads": 4, "n_kv_heads": 2})
    for numerics, kept in ((Numerics("bf16"), torch.bfloat16), (Numerics("bf16", True), None)):
        model = RankModel.from_hf(hf, Tok(), False, numerics=numerics)
        want = kept or torch.float32
        assert {p.dtype for p in model.module.parameters()} == {want}
        logits = model.forward(ids, mask)
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        model.release()
        model.receive_buffers()
        assert {p.dtype for p in model.module.parameters()} == {want}
        assert model.local_bytes() == sum(p.numel() for p in hf.parameters()) * want.itemsize


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_fp16_copies_match_hugging_face_s_fp16_model(case):
    """A frozen fp16 copy against Hugging Face's model cast to fp16 (one process; the layouts
    are the parity harness's, in fp32 and bf16): fp16's 10-bit mantissa gives about 1e-3."""
    from rayhf.checks.parity import _model, _rel

    ids, mask = _batch()
    keep = mask.bool()
    ref = _model(case, False).to(torch.float16)
    model = RankModel.from_hf(_model(case, False), Tok(), False, numerics=Numerics("fp16"))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits.float()
        assert _rel(model.forward(ids, mask)[keep], want[keep]) < 5e-3
