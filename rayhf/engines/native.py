"""The native generator: sampling on the rank's own sharded model (any dp x tp x pp layout),
with the KV cache of ``rayhf.parallel.generate`` and the rules of ``rayhf.sampling``. It reads
the rank's weights directly, so new weights need no hand-over."""

from __future__ import annotations

import torch

from rayhf.engines.rank_model import RankModel
from rayhf.parallel.generate import generate
from rayhf.sampling import GenerateOutput, GenerationConfig


class NativeGenerator:
    name = "native"

    def __init__(self, model: RankModel) -> None:
        self.model = model

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        m = self.model
        gen = torch.Generator(device=m.device).manual_seed(seed)  # where multinomial samples
        return generate(m.pipe, prompts, cfg, m.eos_id, m.pad_id, gen)
