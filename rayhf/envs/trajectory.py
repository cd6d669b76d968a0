"""A multi-turn trajectory kept as tokens: the model's tokens exactly as sampled, the
environment's messages rendered by the chat template and appended as tokens, never a decode and
re-encode of what the model produced.

    start(messages)          prompt tokens: the template's rendering, generation prompt open
    add_model_turn(ids)      + the sampled ids (trained; their log-probs and policy version kept)
    add_messages(new)        + the template's text for ``new`` (not trained): the rendering of
                               the conversation with ``new`` and a generation prompt, minus the
                               rendering without them, plus what the template writes after the
                               model's last token that the model did not sample (ChatML's "\\n"
                               after <|im_end|>; "<|im_end|>\\n" itself if the turn was cut short)

That difference exists only if the template renders the earlier turns the same once later ones
follow; ``check_template`` runs a conversation with tool calls through these steps and compares
the tokens with the template's rendering of the whole conversation (``TemplateMismatch`` says
where they part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayhf.errors import RayhfError


class TemplateMismatch(RayhfError):
    """The chat template cannot be rendered incrementally, or the incremental tokens differ
    from the whole conversation's."""


@dataclass
class Trajectory:
    """One conversation as tokens; ``trained[i]``: token i was sampled by the model."""

    tokens: list[int]
    trained: list[bool]
    logprobs: list[float]  # the generator's, 0.0 where the token was not sampled
    versions: list[int]  # the policy version that sampled each token, -1 where none did
    messages: list[dict[str, Any]]  # the conversation as text (what the environment reads)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0  # model turns so far


def _render(tok: Any, messages: list[dict[str, Any]], tools: Any, gen: bool) -> str:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
    assert isinstance(text, str)
    return text


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def start(tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> Trajectory:
    """A trajectory at its first model turn: the prompt rendered with the generation prompt."""
    ids = _encode(tok, _render(tok, messages, tools, gen=True))
    n = len(ids)
    return Trajectory(ids, [False] * n, [0.0] * n, [-1] * n, list(messages), tools)


def add_model_turn(
    traj: Trajectory, tok: Any, ids: list[int], logprobs: list[float], version: int = 0
) -> str:
    """Append the model's sampled ``ids`` as they are; returns the turn's text (its content,
    without the eos that ends it), which joins ``traj.messages`` as the assistant's message."""
    assert len(ids) == len(logprobs), "a log-prob per sampled token"
    traj.tokens += ids
    traj.trained += [True] * len(ids)
    traj.logprobs += logprobs
    traj.versions += [version] * len(ids)
    body = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
    text = tok.decode(body, skip_special_tokens=False)
    traj.messages.append({"role": "assistant", "content": text})
    traj.turns += 1
    return text


def add_messages(traj: Trajectory, tok: Any, new: list[dict[str, Any]]) -> list[int]:
    """Append the environment's ``new`` messages and the next generation prompt as the
    template renders them; returns the ids appended (none of them trained)."""
    before = _render(tok, traj.messages, traj.tools, gen=False)
    after = _render(tok, traj.messages + new, traj.tools, gen=True)
    if not after.startswith(before):
        raise TemplateMismatch(
            f"the chat template renders earlier turns differently once later ones follow "
            f"(they part at character {_parting(before, after)}): it cannot be extended turn "
            "by turn"
        )
    so_far = tok.decode(traj.tokens, skip_special_tokens=False)
    if not before.startswith(so_far):
        raise TemplateMismatch(
            "the template's rendering of the conversation does not continue the tokens so far "
            f"(they part at character {_parting(so_far, before)})"
        )
    ids = _encode(tok, before[len(so_far) :] + after[len(before) :])
    traj.tokens += ids
    traj.trained += [False] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.versions += [-1] * len(ids)
    traj.messages += new
    return ids


def _parting(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(map(len, (a, b)))
    )


def check_template(tok: Any, tools: list[dict[str, Any]], turns: list[tuple[str, str]]) -> None:
    """Run a conversation through ``start``/``add_model_turn``/``add_messages``, each model turn
    its text's canonical tokens and the eos, each environment reply a ``tool`` message, and
    compare the tokens with the template's rendering of the whole conversation; raises
    ``TemplateMismatch`` where they differ. ``turns``: (model text, tool reply) pairs."""
    traj = start(tok, [{"role": "user", "content": "Begin."}], tools)
    for text, reply in turns:
        ids = [*_encode(tok, text), tok.eos_token_id]
        add_model_turn(traj, tok, ids, [0.0] * len(ids))
        add_messages(traj, tok, [{"role": "tool", "content": reply}])
    whole = _encode(tok, _render(tok, traj.messages, tools, gen=True))
    if whole != traj.tokens:
        at = next((i for i, (x, y) in enumerate(zip(whole, traj.tokens, strict=False)) if x != y),
                  min(len(whole), len(traj.tokens)))  # fmt: skip
        raise TemplateMismatch(
            f"incremental tokens part from the whole rendering at token {at} of {len(whole)}: "
            f"{tok.decode(whole[at : at + 8])!r} vs {tok.decode(traj.tokens[at : at + 8])!r}"
        )
