"""Which backend runs a call: the experiment's ``engines:`` section, keyed by call name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# call kind -> the engines that can run it (the first is the default)
ENGINES_BY_KIND: dict[str, tuple[str, ...]] = {
    "generate": ("native", "vllm"),
    "inference": ("torch",),
    "train": ("torch",),
}


class EngineConfig(BaseModel):
    """The backend of one call: ``native`` or ``vllm`` for generate calls, ``torch`` otherwise."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["native", "vllm", "torch"]
