"""The shape of a small model created from scratch (``models.<role>.init``).

Kept apart from ``rayhf.models.hf``, which imports transformers' config classes: the run config
reads this in every process, role-group workers included, which never import transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, field_validator

from rayhf.models.families import FAMILIES

if TYPE_CHECKING:
    FamilyName = str
else:  # the table's names, as the configuration reference lists them
    FamilyName = Literal[tuple(FAMILIES)]


class ModelInit(BaseModel):
    """Shape of a small model created from scratch (random weights, seeded)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    family: FamilyName = "llama"
    """The architecture (Hugging Face model type) built from scratch."""
    hidden_size: int = Field(64, gt=0)
    """Model width."""
    n_layers: int = Field(2, gt=0)
    """Transformer blocks."""
    n_heads: int = Field(4, gt=0)
    """Query heads."""
    n_kv_heads: int | None = None
    """Grouped-query attention; None = n_heads."""
    intermediate_size: int | None = None
    """None = 4 * hidden_size (2.75x for llama-style)"""
    max_positions: int = Field(256, gt=0)
    """Longest sequence (prompt and response) the model takes."""
    rope_parameters: dict[str, Any] | None = None
    """RoPE settings as Hugging Face names them (rope_type, rope_theta, factor, ...), e.g. Llama
    3.x's {rope_type: llama3, factor: 8, ...}; None = plain RoPE, theta 10000."""
    sliding_window: int | None = None
    """Keys further back are masked (Mistral, Phi-3, Gemma)"""
    tied: bool = False
    """The LM head is the token embedding."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Any other Hugging Face config fields, e.g. Gemma 2's {final_logit_softcapping: 30.0}, or
    vocab_size to pad the vocabulary past the tokenizer's (Qwen2 pads 151,646 tokens to 151,936)"""
    seed: int = 0
    """Seeds the random initialisation (another seed: another model of the same shape)."""

    @field_validator("family", mode="wrap")
    @classmethod
    def _known_family(cls, name: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A row of the family table, registered ones too (the literal refuses the rest)."""
        return name if isinstance(name, str) and name in FAMILIES else handler(name)
