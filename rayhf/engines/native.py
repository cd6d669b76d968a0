"""The native generator: sampling on the rank's own sharded model (any dp x tp x pp layout)
with the decode engine of ``rayhf.parallel.decode`` (buffers and captured graphs kept between
calls) and the rules of ``rayhf.sampling``. It reads the rank's weights directly, so new
weights need no hand-over."""

from __future__ import annotations

import torch.distributed as dist

from rayhf.engines.config import NativeEngineConfig
from rayhf.engines.rank_model import RankModel
from rayhf.parallel.decode import DecodeEngine, DecodeOptions
from rayhf.sampling import DecodeRules, Feed, GenerateOutput, GenerationConfig, check_prompts


def decode_options(engine: NativeEngineConfig | None, model: RankModel) -> DecodeOptions:
    """The decode engine's options for a call's ``engines:`` entry (None: the defaults): CUDA
    graphs only on CUDA, and with tp > 1 only over NCCL (a graph captures NCCL's all-reduces;
    gloo's stage CUDA tensors through host memory, which a graph cannot hold); neither graphs
    nor compilation with experts split over ranks (each MoE layer reads its exchange's sizes
    on the host)."""
    engine = engine or NativeEngineConfig()
    tp = model.groups.tp_group
    capturable = (tp is None or dist.get_backend(tp) == "nccl") and model.groups.ep == 1
    return DecodeOptions(
        max_rows=engine.max_rows,
        capture=engine.cuda_graphs and model.device.type == "cuda" and capturable,
        compile=engine.compile and model.groups.ep == 1,
        merge_adapters=engine.merge_adapters,
    )


class NativeGenerator:
    name = "native"

    def __init__(self, model: RankModel, engine: NativeEngineConfig | None = None) -> None:
        self.model = model
        self.engine = DecodeEngine(model.pipe, decode_options(engine, model))
        self.release_memory = engine is not None and engine.release_memory

    streams = True  # takes a ``Feed`` (rayhf.sampling): prompts join while it decodes

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int, feed: Feed | None = None
    ) -> GenerateOutput:
        if not prompts and self.model.groups.ep == 1:  # (with ep > 1 it serves the others)
            return GenerateOutput()
        check_prompts(prompts)
        m = self.model
        rules = DecodeRules.of(cfg, m.eos_id, m.pad_id)
        out = self.engine.generate(prompts, rules, seed, feed)
        if self.release_memory:
            self.engine.release()
        return out

    def release(self) -> None:
        """Free the engine's KV cache and graphs until the next call."""
        self.engine.release()
