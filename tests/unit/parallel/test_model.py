"""The sharded model on one rank (tp = pp = 1) against Hugging Face, family by family: packed
rows give each row's logits (or values) as the Hugging Face model run on that row alone."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import PAD, VOCAB, tiny_model
from rayhf.models.hf import per_token_values
from rayhf.models.spec import model_spec
from rayhf.parallel.attention import TokenLayout
from rayhf.parallel.groups import single
from rayhf.parallel.model import ShardedModel

SHAPES = {
    "llama": {"n_heads": 8, "n_kv_heads": 4},  # grouped-query attention
    "qwen2": {"n_heads": 4},  # q/k/v biases
    "mistral": {"n_heads": 8, "n_kv_heads": 4, "intermediate_size": 90},
    "gpt2": {"n_heads": 4},  # fused q|k|v, Conv1D, learned positions
}
LENGTHS = [5, 1, 8]


def _rows(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _sharded(hf, value_head: bool = False) -> ShardedModel:
    return ShardedModel(model_spec(hf.config, value_head), single(), hf.state_dict())


def _hf_rows(hf, rows, value_head: bool = False) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            if value_head:
                outs.append(per_token_values(hf, ids, torch.ones_like(ids))[0])
            else:
                outs.append(hf(ids).logits[0])
    return torch.cat(outs)


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("value_head", [False, True])
def test_packed_forward_matches_hugging_face(family, value_head):
    hf = tiny_model(family, SHAPES[family], value_head, seed=4)
    model, rows = _sharded(hf, value_head), _rows()
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        out = model(ids, TokenLayout.packed(LENGTHS))
    expected = _hf_rows(hf, rows, value_head)
    assert out.shape == expected.shape  # [n, V] or [n]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_mistral_sliding_window_masks_far_keys():
    hf = tiny_model("mistral", SHAPES["mistral"], seed=5)
    hf.config.sliding_window = 3
    model, rows = _sharded(hf), _rows(1)
    assert model.spec.sliding_window == 3
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        out = model(ids, TokenLayout.packed(LENGTHS))
    torch.testing.assert_close(out, _hf_rows(hf, rows), rtol=1e-5, atol=1e-5)
    hf.config.sliding_window = None  # and the window mattered for the 8-token row
    assert not torch.allclose(out[-1], _hf_rows(hf, rows)[-1], atol=1e-4)


def test_select_keeps_only_the_chosen_tokens_outputs():
    hf = tiny_model("llama", SHAPES["llama"])
    model, rows = _sharded(hf), _rows()
    ids = torch.tensor([t for r in rows for t in r])
    where = TokenLayout.packed(LENGTHS)
    last = torch.tensor(LENGTHS).cumsum(0) - 1
    with torch.no_grad():
        torch.testing.assert_close(model(ids, where, select=last), model(ids, where)[last])


def test_parameters_keep_their_hugging_face_names_and_shapes():
    hf = tiny_model("qwen2", SHAPES["qwen2"])
    model = _sharded(hf)
    state = hf.state_dict()
    local = model.local_state()
    assert set(local) == set(state)
    assert all(torch.equal(local[k], state[k]) for k in state)
    assert model.shard_shapes == {k: tuple(v.shape) for k, v in state.items()}
    assert model.device == torch.device("cpu")


def test_without_weights_every_shard_is_zero():
    hf = tiny_model("gpt2", SHAPES["gpt2"])
    model = ShardedModel(model_spec(hf.config, False), single(), None)
    assert all(p.abs().sum() == 0 for p in model.parameters())
    assert model.shard_shapes == {k: tuple(v.shape) for k, v in hf.state_dict().items()
                                  if k in model.shards}  # fmt: skip


def test_release_frees_and_allocate_restores_the_shapes():
    model = _sharded(tiny_model("llama", SHAPES["llama"]))
    model.release()
    released = list(model.parameters())
    assert released and all(p.numel() == 0 for p in released)
    model.allocate()
    assert {k: tuple(v.shape) for k, v in model.local_state().items()} == model.shard_shapes


def test_the_padding_row_of_llama_s_embedding_gets_no_gradient():
    hf = tiny_model("llama", SHAPES["llama"])
    model = _sharded(hf)
    ids = torch.tensor([5, PAD, 7, PAD])
    model(ids, TokenLayout.packed([4])).sum().backward()
    grad = model.param("model.embed_tokens.weight").grad
    hf(ids[None]).logits.sum().backward()
    ref = hf.model.embed_tokens.weight.grad
    assert grad[PAD].abs().sum() == 0 and ref[PAD].abs().sum() == 0
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_new_cache_holds_this_rank_s_kv_heads():
    model = _sharded(tiny_model("llama", SHAPES["llama"]))
    cache = model.new_cache(n_rows=3, capacity=11)
    assert cache.shape == (3, 4, 11, 32 // 8)  # rows, this rank's kv heads, slots, head dim
    assert set(cache.k) == set(model.layers)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_matmuls_on_lent_casts_give_what_autocast_gives(family):
    """fp32 master weights under bf16 autocast: matmuls reading weights already cast to bf16
    give the same logits bit for bit; norms and the embedding lookup still read fp32."""
    from rayhf.models.precision import Numerics

    hf = tiny_model(family, SHAPES[family], seed=4)
    spec = model_spec(hf.config, False)
    model = ShardedModel(spec, single(), hf.state_dict(), Numerics("bf16", master=True))
    ids = torch.tensor([t for r in _rows() for t in r])
    names = model.matmul_weights()
    assert names and all(model.param(n).dim() == 2 for n in names)
    assert "transformer.wpe.weight" not in names and "model.norm.weight" not in names
    casts = {n: model.param(n).to(torch.bfloat16) for n in names}
    with torch.no_grad():
        plain = model(ids, TokenLayout.packed(LENGTHS))
        with model.reading_lent(casts):
            lent = model(ids, TokenLayout.packed(LENGTHS))
        casts[names[0]].zero_()  # the lent copy is what the matmul reads
        with model.reading_lent(casts):
            zeroed = model(ids, TokenLayout.packed(LENGTHS))
    assert torch.equal(lent, plain) and not torch.equal(zeroed, plain)
    assert model.lent is None  # lent for the block only
