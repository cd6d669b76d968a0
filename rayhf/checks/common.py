"""What the harnesses share: tiny models of every family and a stand-in tokenizer."""

from __future__ import annotations

from typing import Any

VOCAB, PAD, BOS, EOS = 37, 0, 2, 1


class Tok:
    """The special ids a rank's engine reads of a tokenizer."""

    pad_token_id, eos_token_id = PAD, EOS


def tiny_model(family: str, shape: dict[str, Any], value_head: bool = False, seed: int = 0):
    """A 4-layer, 32-wide model of ``family`` (``shape``: its heads and sizes), seeded, eval."""
    import torch

    from rayhf.models.families import family_traits
    from rayhf.models.hf import build_model, hf_config
    from rayhf.models.init import ModelInit

    init = ModelInit(family=family, hidden_size=32, n_layers=4, **shape)
    model = build_model(hf_config(init, VOCAB, PAD, BOS, EOS), value_head, seed=seed).eval()
    randomized = family_traits(family).check_randomized  # zeros at first: made to bite
    gen = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if name.endswith(randomized):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
    return model
