"""Gated DeltaNet's torch form (``rayhf.parallel.delta_net``): the chunked rule against the
rule written token by token, and against Hugging Face's torch path; packed rows of different
lengths against the rows run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayhf.parallel.attention import TokenLayout, by_rows, by_tokens
from rayhf.parallel.delta_net import CHUNK, causal_conv, gated_delta_rule


def _inputs(rows: int, length: int, heads: int = 2, dk: int = 8, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, length, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, length, heads, dv, generator=gen)
    g = -torch.rand(rows, length, heads, generator=gen) * 0.5  # log decays, <= 0
    beta = torch.rand(rows, length, heads, generator=gen)
    return q, k, v, g, beta


def _token_by_token(q, k, v, g, beta, state=None):
    """The rule as its definition reads: decay, correct towards v, read with q."""
    rows, length, heads, dk = k.shape
    q, k = F.normalize(q, dim=-1, eps=1e-3) * dk**-0.5, F.normalize(k, dim=-1, eps=1e-3)
    s = torch.zeros(rows, heads, dk, v.shape[-1]) if state is None else state.clone()
    out = []
    for t in range(length):
        s = s * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("rhkv,rhk->rhv", s, k[:, t])
        s = s + torch.einsum("rhk,rhv->rhkv", k[:, t], beta[:, t, :, None] * error)
        out.append(torch.einsum("rhkv,rhk->rhv", s, q[:, t]))
    return torch.stack(out, dim=1), s


@pytest.mark.parametrize("length", [1, CHUNK, 2 * CHUNK + 13])
def test_the_chunked_rule_is_the_rule_token_by_token(length):
    q, k, v, g, beta = _inputs(2, length)
    start = torch.randn(2, 2, 8, 4) * 0.1
    out, state = gated_delta_rule(q, k, v, g, beta, start)
    want, want_state = _token_by_token(q, k, v, g, beta, start)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=1e-4)


def test_the_chunked_rule_gives_hugging_face_s_torch_path():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(3, 2 * CHUNK + 5)
    out, state = gated_delta_rule(q, k, v, g, beta)
    want, want_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert (out - want).abs().max() < 1e-5 and (state - want_state).abs().max() < 1e-5


def test_packed_rows_of_different_lengths_are_the_rows_one_by_one():
    """A row's outputs and final state do not depend on the rows beside it or on the padding
    after it: slots past its end change no state, the convolution starts from zeros."""
    lengths = [CHUNK + 7, 3, 2 * CHUNK + 1]
    where = TokenLayout.packed(lengths)
    n, channels = sum(lengths), 6
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, 1, 4, generator=gen)
    mixed = causal_conv(by_rows(x, where), weight)
    q, k = mixed[..., :2].reshape(3, -1, 1, 2), mixed[..., 2:4].reshape(3, -1, 1, 2)
    v = mixed[..., 4:].reshape(3, -1, 1, 2)
    g = -torch.rand(n, 1, generator=gen)
    beta = torch.rand(n, 1, generator=gen)
    out, state = gated_delta_rule(q, k, v, by_rows(g, where), by_rows(beta, where))
    packed = by_tokens(out, where)
    lo = 0
    for row, length in enumerate(lengths):
        alone = TokenLayout.packed([length])
        part = slice(lo, lo + length)
        m = causal_conv(by_rows(x[part], alone), weight)
        q1, k1, v1 = (m[..., i : i + 2].reshape(1, length, 1, 2) for i in (0, 2, 4))
        o1, s1 = gated_delta_rule(q1, k1, v1, g[part][None], beta[part][None])
        torch.testing.assert_close(packed[part], o1[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state[row], s1[0], atol=1e-6, rtol=1e-5)
        lo += length


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_linear_attention_s_kernel_over_packed_sequences_matches_the_torch_form():
    """On a GPU with flash-linear-attention installed, prefills and training run its kernel over
    the packed tokens (``packed_rule``): the outputs and final states equal the torch form's
    over the same sequences scattered into rows."""
    from rayhf.parallel.delta_net import fla_kernel, packed_rule

    kernel = fla_kernel()
    if kernel is None:
        pytest.skip("flash-linear-attention is not installed")
    lengths = [70, 5, 130, 64]
    where = TokenLayout.packed(lengths).to(torch.device("cuda"))
    q, k, v, g, beta = (t.cuda() for t in _inputs(len(lengths), max(lengths), heads=4, dk=64,
                                                   dv=32))  # fmt: skip
    for t in (g, beta):  # slots past a row's end change nothing
        for r, n in enumerate(lengths):
            t[r, n:] = 0.0
    want, want_state = gated_delta_rule(q, k, v, g, beta)
    packed = [by_tokens(t, where) for t in (q, k, v, g, beta)]
    out, state = packed_rule(kernel, *packed, torch.tensor(lengths, device="cuda"))
    torch.testing.assert_close(out, by_tokens(want, where), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(state, want_state, atol=2e-3, rtol=2e-3)


def test_no_tokens_read_nothing_and_leave_the_state():
    """A rank with no rows of its own still runs its layers beside its ep group's (an idle
    pass): the rule over no tokens gives no outputs and leaves the state as it was."""
    q, k, v, g, beta = _inputs(3, 0)
    state = torch.randn(3, 2, 8, 4)
    out, after = gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (3, 0, 2, 4) and torch.equal(after, state)
