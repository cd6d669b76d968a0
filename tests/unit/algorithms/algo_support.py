"""Small tensor helpers shared by the algorithm tests: rows of varied ``LENGTHS`` (one empty)
padded to ``T`` with ``GARBAGE``, so that any leak of padded values into a result shows up."""

import math

import torch

LENGTHS = [0, 1, 7, 3, 5]
T = 7
GARBAGE = 1234.5
LN = math.log


def _mask(lengths: list[int], t: int = T) -> torch.Tensor:
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _rand(seed: int, lengths: list[int] = LENGTHS, scale: float = 1.0) -> torch.Tensor:
    """Random float64 [B, T] with GARBAGE on padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * scale
    return torch.where(_mask(lengths), x, torch.full_like(x, GARBAGE))


def _vec(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * scale


def _valid(x: torch.Tensor, lengths: list[int] = LENGTHS) -> list[list[float]]:
    """Per row, the valid entries as Python floats."""
    return [row[:n] for row, n in zip(x.tolist(), lengths, strict=True)]


def _pad(rows: list[list[float]], t: int = T) -> list[list[float]]:
    return [row + [0.0] * (t - len(row)) for row in rows]


def _close(a: torch.Tensor | None, b, tol: float = 1e-9) -> None:
    assert a is not None  # e.g. a .grad that was never filled
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=tol, atol=tol)


def _softplus(z: float) -> float:
    """-logsigmoid(-z) = log(1 + e^z), the reference for the logistic losses."""
    return math.log1p(math.exp(z))


class ScoresFromForward:
    """What a fake engine whose ``forward`` gives whole logits (or values, from a 1-D
    ``table``) needs besides: ``value_head`` and ``score``, by the plain path."""

    table: torch.Tensor

    @property
    def value_head(self) -> bool:
        return self.table.dim() == 1

    def score(self, input_ids, attention_mask, targets, temperature=1.0):
        from rayhf.algorithms.lm import scores_from_logits

        logits = self.forward(input_ids, attention_mask)  # type: ignore[attr-defined]
        return scores_from_logits(logits, targets, temperature)
