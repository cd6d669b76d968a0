"""Which backend runs a call: the experiment's ``engines:`` section, keyed by call name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

# call kind -> the engines that can run it (the first is the default)
ENGINES_BY_KIND: dict[str, tuple[str, ...]] = {
    "generate": ("native", "vllm"),
    "inference": ("torch",),
    "train": ("torch", "deepspeed"),
}


class EngineConfig(BaseModel):
    """The backend of one call: ``native`` or ``vllm`` for generate calls, ``torch`` or
    ``deepspeed`` (ZeRO ``zero_stage``, optimizer state ``offload``ed to CPU memory) for train
    calls, ``torch`` for inference calls."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["native", "vllm", "torch", "deepspeed"]
    zero_stage: Literal[1, 2, 3] = 2
    offload: bool = False

    @model_validator(mode="after")
    def _deepspeed_only(self) -> EngineConfig:
        if self.engine != "deepspeed" and ({"zero_stage", "offload"} & self.model_fields_set):
            raise ValueError("zero_stage and offload are settings of engine 'deepspeed'")
        return self

    def worker_fields(self) -> tuple[str, int, bool]:
        """(engine, zero_stage, offload) as a role-group worker receives them."""
        stage = self.zero_stage if self.engine == "deepspeed" else 0
        return self.engine, stage, self.offload
