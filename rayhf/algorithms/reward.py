"""The ``reward`` interface: scores from a Python function over decoded text, or a reward model.

It also holds ``resolve_function`` (imports a ``module:function`` reference) and
``decode_samples`` (a batch's prompts and responses as text).

A reward function is named ``module:function`` in the config and called as
``function(prompts: list[str], responses: list[str]) -> list[float]``; responses are decoded
without the EOS token. A reward model is a value-head model whose score is its value at the last
token of the sequence.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from rayhf.algorithms.interface import CallContext, Interface, ModelEngine, register
from rayhf.algorithms.rm import final_token_scores
from rayhf.algorithms.seqs import padded_inputs
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError

RewardFn = Callable[[list[str], list[str]], list[float]]


def resolve_function(ref: str, field: str) -> Callable[..., Any]:
    """Import ``module:function``; errors name the config ``field``."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RayhfError(f"{field}: '{ref}' must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RayhfError(f"{field}: cannot import '{ref}': {e}") from None
    if not callable(fn):
        raise RayhfError(f"{field}: '{ref}' is not callable")
    return fn


def decode_samples(engine: ModelEngine, batch: PackedBatch) -> tuple[list[str], list[str]]:
    """Prompts (without BOS) and responses (without EOS) as text."""
    tok, prompts, responses = engine.tokenizer, [], []
    plens = batch.tensors["prompt_lens"].tolist()
    for i in range(batch.n_samples):
        ids = batch.sample("seq", i).tolist()
        prompt, resp = ids[: plens[i]], ids[plens[i] :]
        if resp and resp[-1] == engine.eos_id:
            resp = resp[:-1]
        prompts.append(tok.decode(prompt, skip_special_tokens=True))
        responses.append(tok.decode(resp, skip_special_tokens=True))
    return prompts, responses


@register("reward")
class RewardInterface(Interface):
    """``scores``: one float per sample, from the function or the reward model.

    Call args: ``no_eos_score`` (float): the score of a response cut off before EOS. A reward
    model only ever saw finished answers, so its value at a cut-off answer's last token is
    an extrapolation a policy learns to exploit (measured: runs of one digit, never finished,
    scored above the correct answers).
    """

    takes_function = True

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.fn = (
            resolve_function(settings.function, "reward function") if settings.function else None
        )

    def inference(self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        if self.fn is not None:
            prompts, responses = decode_samples(engine, batch)
            scores = torch.tensor([float(s) for s in self.fn(prompts, responses)])
            assert len(scores) == batch.n_samples, "reward function returned the wrong count"
        else:
            ids, attn = padded_inputs(batch, engine.pad_id)
            with torch.no_grad():
                values = engine.forward(ids, attn)
            scores = final_token_scores(values.cpu(), torch.tensor(batch.seqlens["seq"]))
        if "no_eos_score" in ctx.args:
            ends = torch.tensor([int(batch.sample("seq", i)[-1]) for i in range(batch.n_samples)])
            unfinished = ends != engine.eos_id
            scores = torch.where(unfinished, float(ctx.args["no_eos_score"]), scores.float())
        result = PackedBatch(list(batch.sample_ids))
        result.add("scores", scores.float(), [1] * batch.n_samples)
        return result
