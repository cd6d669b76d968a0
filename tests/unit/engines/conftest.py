"""What the engines' tests share: the LM head's inputs as a model runs, and the head computed
apart in a chosen dtype (the ``fp32_lm_head`` checks of test_score.py and test_native.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from rayhf.parallel.model import ShardedModel


@pytest.fixture
def head_inputs(monkeypatch) -> Callable[[ShardedModel], list[torch.Tensor]]:
    """``record(module)``: a list that fills with what ``module``'s LM head gets (normed hidden
    states), call by call, from then on."""

    def record(module: ShardedModel) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []
        head = module.lm_logits

        def recorded(x: torch.Tensor, *args) -> torch.Tensor:
            seen.append(x.detach().clone())
            return head(x, *args)

        monkeypatch.setattr(module, "lm_logits", recorded)
        return seen

    return record


def _head_logits(module: ShardedModel, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = module.w(module.head_name).detach()
    logits = F.linear(h.to(dtype), w.to(dtype)).float()
    cap = module.spec.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


@pytest.fixture
def head_logits() -> Callable[[ShardedModel, torch.Tensor, torch.dtype], torch.Tensor]:
    """``logits(module, h, dtype)``: ``module``'s LM head over ``h`` computed apart in ``dtype``
    (soft-capped as the family caps it), returned in fp32."""
    return _head_logits
