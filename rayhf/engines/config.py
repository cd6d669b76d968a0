"""Which backend runs a call: the experiment's ``engines:`` section, keyed by call name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from rayhf.errors import RayhfError

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

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["native", "vllm", "torch", "deepspeed"]
    zero_stage: Literal[1, 2, 3] = 2
    offload: bool = False

    @model_validator(mode="after")
    def _deepspeed_only(self) -> EngineConfig:
        if self.engine != "deepspeed" and ({"zero_stage", "offload"} & self.model_fields_set):
            raise ValueError("zero_stage and offload are settings of engine 'deepspeed'")
        return self

    @classmethod
    def default(cls, kind: str) -> EngineConfig:
        """The engine a call of ``kind`` runs on when ``engines:`` does not name one."""
        return cls(engine=ENGINES_BY_KIND[kind][0])  # type: ignore[arg-type]

    @property
    def whole_model_ranks(self) -> bool:
        """Whether every rank holds the whole model (tp = pp = 1 layouts only)."""
        return self.engine in ("vllm", "deepspeed")

    def zero_stage_for(self, zero1: bool) -> int:
        """What the optimizer shards over dp: DeepSpeed's stage, 1 for torch with ``zero1``."""
        if self.engine == "deepspeed":
            return self.zero_stage
        return 1 if zero1 and self.engine == "torch" else 0


def check_kind(call: str, kind: str, engine: EngineConfig) -> None:
    """Refuse an engine that cannot run a call of ``kind``, naming the field."""
    if engine.engine not in ENGINES_BY_KIND[kind]:
        allowed = ", ".join(ENGINES_BY_KIND[kind])
        article = "an" if kind[0] in "aeiou" else "a"
        raise RayhfError(
            f"engines.{call}.engine: {article} {kind} call runs on {allowed}, not '{engine.engine}'"
        )
