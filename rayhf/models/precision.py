"""The numeric precision of a role: what its weights are stored in and what its matmuls run in.

    precision   stored weights                       compute                  grads, optimizer
    fp32        fp32                                 fp32                     fp32
    bf16/fp16   trained or blended (EMA): fp32       autocast to bf16/fp16    fp32 (master)
                frozen copies: bf16/fp16             bf16/fp16 (as Hugging Face's own model)

Norms, the RoPE tables and log-probs are computed in fp32 in every case, and logits and values
leave the model in fp32. With ``fp32_lm_head`` the LM head's matmul itself runs in fp32 too
(fp32 hidden states times fp32 weights, outside autocast), so the generator's log-probs and the
trainer's agree more closely. ``auto`` is bf16 on a GPU and fp32 on CPU (where bf16 matmuls are
emulated and slower).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from rayhf.models.spec import ModelSpec

Precision = Literal["auto", "fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def resolve(precision: Precision, device: str) -> str:
    """``precision`` with ``auto`` decided for ``device`` ("cuda..." or "cpu")."""
    if precision == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    return precision


@dataclass(frozen=True)
class Numerics:
    """How one rank's copy of a role computes: ``precision`` (fp32, bf16, fp16), whether it
    keeps fp32 ``master`` weights (it trains them, or blends into them) and whether its LM head
    runs in fp32 at a lower precision (``fp32_lm_head``)."""

    precision: str = "fp32"
    master: bool = False
    fp32_lm_head: bool = False

    @property
    def compute(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def storage(self) -> torch.dtype:
        """What the weights are kept in."""
        return torch.float32 if self.master else self.compute

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype matmuls are cast to, when it is not the weights' own."""
        return self.compute if self.storage != self.compute else None

    @property
    def head_in_fp32(self) -> bool:
        """Whether the LM head runs apart from the rest, in fp32 (asked for, and the rest
        computes in a lower dtype)."""
        return self.fp32_lm_head and self.compute != torch.float32

    @property
    def storage_name(self) -> str:
        return "fp32" if self.master else self.precision


def priced(spec: ModelSpec, precision: Precision, moving_average: bool) -> ModelSpec:
    """``spec`` with the role's numerics for the planner: its compute dtype's bytes (``auto``:
    0, the cluster device's own) and fp32 weights for a moving-average role."""
    nbytes = 0 if precision == "auto" else DTYPES[precision].itemsize
    return dataclasses.replace(spec, dtype_bytes=nbytes, master=moving_average)
