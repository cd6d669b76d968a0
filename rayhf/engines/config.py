"""Which backend runs a call: the experiment's ``engines:`` section, keyed by call name."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    calls, ``torch`` for inference calls. ``max_tokens_per_microbatch`` cuts a torch train or
    inference call's batches into micro-batches of at most that many tokens (the gradients of
    a minibatch's micro-batches accumulate into one optimizer step), so long responses do not
    run out of memory; None runs each minibatch whole. ``check_sync`` (vLLM) compares, after
    every weight sync into vLLM, a checksum of each of vLLM's parameters with the rank's
    weights, and stops the run naming any that differs. The native generator's settings
    (``max_rows``, ``cuda_graphs``, ``compile``, ``release_memory``) say how its decode engine
    runs (``rayhf.parallel.decode``)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    engine: Literal["native", "vllm", "torch", "deepspeed"]
    """The backend: native or vllm for generate calls, torch or deepspeed for train calls, torch for
    inference calls."""
    zero_stage: Literal[1, 2, 3] = 2
    """deepspeed: the ZeRO stage."""
    offload: bool = False
    """deepspeed: keep the optimizer state in CPU memory."""
    max_tokens_per_microbatch: int | None = Field(None, gt=0)
    """torch: cut a call's batch into micro-batches of at most this many tokens (None: one)."""
    check_sync: bool = True
    """VLLM: check every weight sync by checksums (false: skip)"""
    max_rows: int = Field(256, gt=0)
    """native: rows decoded at once; a call's further prompts wait for a row that has ended."""
    cuda_graphs: bool = True
    """native: on CUDA, replay the decode step from a CUDA graph per batch bucket."""
    compile: bool = False
    """native: ``torch.compile`` the decode step first (a minute or more of compiling per
    process on CPUs; pays in long runs of small models)."""
    release_memory: bool = False
    """native: free the KV cache and graphs after each call, for a role sharing the device
    (the next call allocates and captures again)."""

    @model_validator(mode="after")
    def _deepspeed_only(self) -> EngineConfig:
        # by value, not by the fields set: a re-validated dump (with_overrides) sets them all
        if self.engine != "deepspeed" and (self.zero_stage != 2 or self.offload):
            raise ValueError("zero_stage and offload are settings of engine 'deepspeed'")
        if self.engine != "torch" and self.max_tokens_per_microbatch is not None:
            raise ValueError("max_tokens_per_microbatch is a setting of engine 'torch'")
        if self.engine != "vllm" and not self.check_sync:
            raise ValueError("check_sync is a setting of engine 'vllm'")
        native = {"max_rows": 256, "cuda_graphs": True, "compile": False, "release_memory": False}
        for name, default in native.items():
            if self.engine != "native" and getattr(self, name) != default:
                raise ValueError(f"{name} is a setting of engine 'native'")
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
