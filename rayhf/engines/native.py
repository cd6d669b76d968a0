"""The native generator: sampling on the rank's own sharded model (any dp x tp x pp layout)
with the decode engine of ``rayhf.parallel.decode`` (buffers and captured graphs kept between
calls) and the rules of ``rayhf.sampling``. It reads the rank's weights directly, so new
weights need no hand-over."""

from __future__ import annotations

from rayhf.engines.rank_model import RankModel
from rayhf.parallel.decode import DecodeEngine, DecodeOptions, default_options
from rayhf.sampling import DecodeRules, GenerateOutput, GenerationConfig, check_prompts


class NativeGenerator:
    name = "native"

    def __init__(self, model: RankModel, options: DecodeOptions | None = None) -> None:
        self.model = model
        self.engine = DecodeEngine(model.pipe, options or default_options(model.device.type))

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        if not prompts:
            return GenerateOutput()
        check_prompts(prompts)
        m = self.model
        return self.engine.generate(prompts, DecodeRules.of(cfg, m.eos_id, m.pad_id), seed)

    def release(self) -> None:
        """Free the engine's KV cache and graphs until the next call."""
        self.engine.release()
