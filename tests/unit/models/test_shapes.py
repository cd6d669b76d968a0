"""Public model shapes for planning: the published sizes, as LM or critic, and unknown names."""

from __future__ import annotations

import pytest

from rayhf.errors import RayhfError
from rayhf.models.shapes import PUBLIC_SHAPES, public_shape
from rayhf.models.sharding import param_shards


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama2-7b", 6.74),
        ("llama2-13b", 13.02),
        ("codellama-34b", 33.74),
        ("llama2-70b", 68.98),
        ("qwen2.5-0.5b", 0.494),
        ("qwen2.5-1.5b", 1.544),
        ("qwen2.5-7b", 7.616),
        ("qwen3-30b-a3b", 30.532),  # the model card's 30.5B, of which 3.3B a token uses
        ("glm-4.5-air", 106.852),  # the model card's 106B (12B a token), its MTP layer aside
    ],
)
def test_parameter_counts_are_the_published_ones(name, billions):
    count = sum(p.numel for p in param_shards(public_shape(name)))
    close = 0.001 if name.startswith(("qwen", "glm")) else 0.01
    assert count / 1e9 == pytest.approx(billions, abs=close)


def test_grouped_query_attention_of_the_large_models():
    assert public_shape("llama2-70b").n_kv_heads == 8 and public_shape("llama2-70b").n_heads == 64
    assert public_shape("llama2-7b").n_kv_heads == public_shape("llama2-7b").n_heads == 32
    assert all(s.head_dim == 128 for n, s in PUBLIC_SHAPES.items() if n != "qwen2.5-0.5b")
    small = public_shape("qwen2.5-0.5b")
    assert (small.head_dim, small.n_heads, small.n_kv_heads, small.tied) == (64, 14, 2, True)


def test_a_critic_shape_swaps_the_head():
    lm, critic = public_shape("llama2-7b"), public_shape("llama2-7b", value_head=True)
    assert not lm.value_head and critic.value_head
    assert critic.head_name == "score.weight"
    lm_count = sum(p.numel for p in param_shards(lm))
    critic_count = sum(p.numel for p in param_shards(critic))
    assert lm_count - critic_count == (32000 - 1) * 4096  # a 1-wide head instead of the vocab
    assert not PUBLIC_SHAPES["llama2-7b"].value_head  # the table itself is unchanged


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(RayhfError) as info:
        public_shape("llama3-8b")
    assert str(info.value) == (
        "model shape 'llama3-8b' is unknown; use one of llama2-7b, llama2-13b, codellama-34b, "
        "llama2-70b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-32b, qwen3-30b-a3b, "
        "glm-4.5-air"
    )
