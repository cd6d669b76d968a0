"""The ``reward`` interface: scores from a Python function over decoded text, or a reward model.

It also holds ``resolve_function`` (imports a ``module:function`` reference) and
``decode_samples`` (a batch's prompts and responses as text).

A reward function is named ``module:function`` in the config and called as
``function(prompts: list[str], responses: list[str], **more) -> list[float]``; responses are
decoded without the EOS token. ``more`` holds what the function's signature names beyond the two
lists, one list entry per sample:

* a dataset column by its name (``answer``, ``data_source``, ...): the sample's row value;
* ``finished``: whether the response ended with EOS (it was not cut off at the length limit).

A function with ``**kwargs`` receives every column and ``finished``. A reward model is a
value-head model whose score is its value at the last token of the sequence.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rayhf.algorithms.interface import CallContext, CallEngine, Interface
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


FINISHED = "finished"  # the keyword that receives whether each response ended with EOS
_LISTS = ("prompts", "responses")


def wanted_columns(fn: Callable[..., Any]) -> tuple[list[str], list[str], bool]:
    """What ``fn`` takes beyond the two lists: (required names, optional names, takes all)."""
    required: list[str] = []
    optional: list[str] = []
    takes_all = False
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if p.kind is p.VAR_KEYWORD:
            takes_all = True
        elif i >= len(_LISTS) and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            (required if p.default is p.empty else optional).append(p.name)
    return required, optional, takes_all


def check_columns(fn: Callable[..., Any], ref: str, columns: list[str], path: str) -> None:
    """Refuse, before a run starts, a reward function that needs a column the dataset lacks."""
    required, _, _ = wanted_columns(fn)
    missing = [name for name in required if name != FINISHED and name not in columns]
    if missing:
        raise RayhfError(
            f"reward function {ref} needs column {missing[0]!r}, which dataset file {path} "
            f"does not have (it has {columns or 'only the prompt'}); add the column to the "
            "file or set the role's function to one that does not need it"
        )


def function_kwargs(
    fn: Callable[..., Any], extras: dict[str, list[Any]], finished: list[bool]
) -> dict[str, list[Any]]:
    """The keyword arguments ``fn`` takes, each one list over the batch's samples."""
    required, optional, takes_all = wanted_columns(fn)
    given = {**extras, FINISHED: finished}
    if takes_all:
        return given
    return {name: given[name] for name in required + optional if name in given}


def decode_samples(
    engine: CallEngine, batch: PackedBatch
) -> tuple[list[str], list[str], list[bool]]:
    """Prompts (without BOS), responses (without EOS) as text, and whether each ended in EOS."""
    tok, prompts, responses, finished = engine.tokenizer, [], [], []
    plens = batch.tensors["prompt_lens"].tolist()
    for i in range(batch.n_samples):
        ids = batch.sample("seq", i).tolist()
        prompt, resp = ids[: plens[i]], ids[plens[i] :]
        finished.append(bool(resp) and resp[-1] == engine.eos_id)
        if finished[-1]:
            resp = resp[:-1]
        prompts.append(tok.decode(prompt, skip_special_tokens=True))
        responses.append(tok.decode(resp, skip_special_tokens=True))
    return prompts, responses, finished


class RewardInterface(Interface):
    """``scores``: one float per sample, from the function or the reward model.

    Call args: ``no_eos_score`` (float): the score of a response cut off before EOS. A reward
    model only ever saw finished answers, so its value at a cut-off answer's last token is
    an extrapolation a policy learns to exploit (measured: runs of one digit, never finished,
    scored above the correct answers).
    """

    name = "reward"

    takes_function = True

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.fn = (
            resolve_function(settings.function, "reward function") if settings.function else None
        )

    def inference(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        if self.fn is not None:
            prompts, responses, finished = decode_samples(engine, batch)
            more = function_kwargs(self.fn, batch.extras, finished)
            scores = torch.tensor([float(s) for s in self.fn(prompts, responses, **more)])
            assert len(scores) == batch.n_samples, "reward function returned the wrong count"
        else:
            scores = torch.cat([self._model_scores(engine, p) for p in engine.micro_batches(batch)])
        if "no_eos_score" in ctx.args:
            ends = torch.tensor([int(batch.sample("seq", i)[-1]) for i in range(batch.n_samples)])
            unfinished = ends != engine.eos_id
            scores = torch.where(unfinished, float(ctx.args["no_eos_score"]), scores.float())
        result = PackedBatch(list(batch.sample_ids))
        result.add("scores", scores.float(), [1] * batch.n_samples)
        return result

    @staticmethod
    def _model_scores(engine: CallEngine, batch: PackedBatch) -> torch.Tensor:
        """The reward model's value at each sequence's last token."""
        ids, attn = padded_inputs(batch, engine.pad_id)
        with torch.no_grad():
            values = engine.forward(ids, attn)
        return final_token_scores(values.cpu(), torch.tensor(batch.seqlens["seq"]))
