"""What the parity tests share (CPU layouts and CUDA): the bounds the harness's rows
(``rayhf.checks.parity``) are held to, per precision."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    logits: float  # max abs error over max abs reference, logits and critic values
    values: float
    grads: float
    step_off: float  # share of weights whose first step went another way than the reference's
    same_tokens: float  # least mean share of greedy tokens equal to Hugging Face's


TOLERANCES = {
    "fp32": Tolerance(1e-5, 1e-5, 1e-5, 0.0, 1.0),
    # measured, the largest over layouts: logits 1.2e-2 (Gemma 3: 1.9e-2), values 1.8e-2 (Gemma
    # 3: 4.8e-2), grads 1.1e-2 (Gemma 2: 3.1e-2), steps off 0.6%, greedy tokens 95% (Mistral)
    "bf16": Tolerance(3e-2, 6e-2, 4e-2, 0.01, 0.8),
}
