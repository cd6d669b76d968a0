"""An LLM judge as a reward: ``JudgeConfig`` (the config's ``judge:`` section), its prompt and
verdict parsing as pure functions, and the ``judge`` interface.

The judge is a causal LM role (``models.judge``) with a generate call in the graph, so the
planner places it and moves its weights like any other call's:

    seq, prompt_lens (the policy's samples)
      -> decode the prompt and the response, fill ``judge.template``
         ({prompt}, {response}, and any dataset column by name, e.g. {answer})
      -> the judge generates greedily, ``judge.max_new_tokens`` tokens
      -> ``parse_verdict``: the first number (divided by ``scale``), the first word that is
         one of ``choices`` (mapped to its score), or the mean of its words' marks (each word a
         step of the judge's reasoning ending in a one-character key of ``choices``, as a
         process reward model scores each step)
      -> scores; a verdict that does not parse scores ``unparsable_score`` and is counted
         (``verdict_unparsable``, 1.0 per such sample: its batch mean is the share)

The judge reads and writes text with the run's tokenizer: a judge trained here (the SFT stage)
shares it.
"""

from __future__ import annotations

import re
import string
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayhf.algorithms.interface import (
    CallContext,
    CallEngine,
    Interface,
    WorkShape,
)
from rayhf.algorithms.reward import decode_samples
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.sampling import GenerationConfig


class JudgeConfig(BaseModel):
    """How a judge model is asked, and how its answer becomes a score."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    template: str | None = None
    """The judge's prompt: ``{prompt}`` and ``{response}`` are the sample's, any other
    ``{name}`` its dataset row's column (e.g. ``{answer}``). Required by a graph with a judge."""
    verdict: Literal["choice", "number", "marks"] = "choice"
    """``choice``: the first word of the verdict that is a key of ``choices``; ``number``: the
    first number in it; ``marks``: the mean score of its words' last characters, each a key of
    ``choices`` (``"331 140"`` over ``{"1": 1, "0": 0}`` scores 0.5)."""
    choices: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """Verdict word (matched without case; a marks verdict's characters as written) -> score."""
    scale: float = Field(1.0, gt=0)
    """A number verdict is divided by this (10 for a judge that grades 0-10)."""
    unparsable_score: float = 0.0
    """The score of a verdict that does not parse."""
    max_new_tokens: int = Field(8, gt=0)
    """Tokens the judge may write."""

    @model_validator(mode="after")
    def _usable(self) -> JudgeConfig:
        if self.template is not None and "{response}" not in self.template:
            raise ValueError("judge.template: it must show the judge the {response}")
        if self.verdict != "number" and not self.choices:
            raise ValueError(f"judge.choices: a {self.verdict} verdict needs at least one choice")
        long = [k for k in self.choices if len(k) != 1]
        if self.verdict == "marks" and long:
            raise ValueError(
                f"judge.choices: a marks verdict's keys are characters, not {long[0]!r}"
            )
        return self


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_verdict(text: str, cfg: JudgeConfig) -> float | None:
    """The score a verdict ``text`` gives, or None when it does not parse."""
    if cfg.verdict == "number":
        found = _NUMBER.search(text)
        return float(found.group()) / cfg.scale if found else None
    if cfg.verdict == "marks":
        words = text.split()
        if not words or any(w[-1] not in cfg.choices for w in words):
            return None
        return sum(cfg.choices[w[-1]] for w in words) / len(words)
    choices = {k.lower(): v for k, v in cfg.choices.items()}
    for word in text.split():
        word = word.strip(string.punctuation).lower()
        if word in choices:
            return choices[word]
    return None


def render_prompt(template: str, prompt: str, response: str, row: dict[str, Any]) -> str:
    """``template`` filled with the sample's prompt, response and row columns."""
    try:
        return template.format_map({**row, "prompt": prompt, "response": response})
    except KeyError as e:
        raise RayhfError(
            f"judge.template names {{{e.args[0]}}}, which is neither prompt, response nor a "
            f"dataset column (have: {', '.join(sorted(row)) or 'none'})"
        ) from None


class JudgeInterface(Interface):
    """A generate call on the judge role: ``scores`` and ``verdict_unparsable`` per sample."""

    name = "judge"

    balance_keys = ("seq",)
    needs_judge = True

    @classmethod
    def work_shape(cls, algorithm: Any, kind: str) -> WorkShape:
        """It reads each sample whole (``new_tokens`` comes from ``judge.max_new_tokens``)."""
        del algorithm, kind
        return WorkShape(reads_answers=True)

    def generate(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        cfg: JudgeConfig = self.settings.judge
        assert cfg is not None and cfg.template is not None, "checked before the run"
        prompts, responses, _ = decode_samples(engine, batch)
        tok = engine.tokenizer
        bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
        asks = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            row = {k: v[i] for k, v in batch.extras.items()}
            text = render_prompt(cfg.template, p, r, row)
            asks.append(bos + tok.encode(text, add_special_tokens=False))
        gen = GenerationConfig(greedy=True, max_new_tokens=cfg.max_new_tokens)
        out = engine.generate(asks, gen, seed=ctx.seed)
        parsed = [parse_verdict(tok.decode(t, skip_special_tokens=True), cfg) for t in out.tokens]
        scores = [cfg.unparsable_score if s is None else s for s in parsed]
        result = PackedBatch(list(batch.sample_ids))
        result.add("scores", torch.tensor(scores, dtype=torch.float32), [1] * len(scores))
        missed = [float(s is None) for s in parsed]
        result.add("verdict_unparsable", torch.tensor(missed), [1] * len(missed))
        return result
