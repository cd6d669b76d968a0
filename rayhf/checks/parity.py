"""Parity check of the small layouts against the single-process Hugging Face model.

``python -m rayhf.checks.parity OUT.json [--world 4] [--precision fp32 bf16] [--device cuda]
[--every-layout]`` starts ``world`` processes (gloo, one thread each, as emulated devices; NCCL
and one GPU each with ``--device cuda``) and, for each precision, each case (one per family of
``rayhf.models.families``, in the tiny shape its row gives, and ``EXTRA_CASES``) and the
``dp x tp x pp`` layouts ``covering`` gives it (with ``--every-layout``: every layout that
fits), compares with a single-process Hugging Face model built from the same seed, in the same
precision:

- ``logits``: forward logits (and critic ``values``) of a padded batch from a frozen copy (its
  weights stored in the precision; Hugging Face's model cast to it), max abs error / max abs ref;
- ``scores``: the same copy's next-token log-probs and entropies from the sliced LM head
  (``score``, ``SCORE_SLICE`` tokens a slice) against those of Hugging Face's logits;
- ``grads``: a trained copy's gradient shards (its loss from ``score``, Hugging Face's from
  logits) (fp32 master weights; at bf16/fp16 the forward
  under autocast, and Hugging Face's fp32 model under the same autocast) against the same
  slices of the reference gradients;
- ``step``: parameters after one AdamW step (global-norm clipping on) on the same batch, max abs
  difference, with the gathered shards compared against the Hugging Face parameters (and
  ``zero1_step``, the same with ZeRO-1 optimizer sharding, for layouts with dp > 1 of the
  case flagged ``zero1``: Llama's);
- ``generate``: the share of greedy tokens identical to Hugging Face's (1.0: all); with experts
  split over the replicas, the last replica generates nothing and serves the others' exchanges
  (None in its row; None on every rank of a layout with pp > 1 too, which the decode engine
  refuses with split experts).
- ``replay`` (a Mixture-of-Experts case): scores with half the tokens sent to other experts than
  their router's (routing replay) against one process's with the same replay, and
  ``replay_moved`` what the replay changed; ``routes``, the share of the experts a greedy
  generate records that equal one process's (None where it does not generate).

A Mixture-of-Experts case splits its experts over its dp ranks (``expert_split``: ``ep`` in
each row), which send each other their tokens.

It writes one row per (case, layout, rank) to OUT.json (its ``family`` key: the case's name);
``tests/integration/test_parallel_parity.py`` asserts on it, and the same rows are useful when
a new family or layout is added.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.checks.common import EOS, PAD, VOCAB, Tok, tiny_model
from rayhf.models.families import FAMILIES, FamilyTraits, register_family
from rayhf.models.precision import DTYPES
from rayhf.parallel.groups import host_store, join_store, leave_spawned


@dataclass(frozen=True)
class Case:
    """One model the harness checks: a family of the table, built tiny (hidden 32, 4 layers)."""

    family: str
    shape: dict[str, Any] = field(default_factory=dict)  # ModelInit fields: heads, options
    zero1: bool = False  # layouts with dp > 1 also take a ZeRO-1 step


# Beside one case per family (its row's ``check_shape``): Llama 3.x's scaled RoPE, over
# positions past the original context.
EXTRA_CASES = {
    "llama3": Case("llama", {
        "n_heads": 8, "n_kv_heads": 4,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 4},
    }),
}  # fmt: skip


def all_cases() -> dict[str, Case]:
    """One case per row of the family table, named after it, then ``EXTRA_CASES``."""
    cases = {name: Case(name, dict(t.check_shape)) for name, t in FAMILIES.items()}
    # ZeRO-1 shards optimizer state whatever the family: one case covers it
    cases["llama"] = replace(cases["llama"], zero1=True)
    return cases | EXTRA_CASES


CASES = all_cases()  # what this process checks (a worker: what ``run`` sent it)


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with each in {1, 2, 4} and product <= world."""
    sizes = (1, 2, 4)
    return [(d, t, p) for d in sizes for t in sizes for p in sizes if d * t * p <= world]


# Every case runs these layouts in every precision: dp alone (and, for the ZeRO-1 case, its
# sharded step), then tp and pp together (each rank a shard of a stage).
BASE_LAYOUTS = ((2, 1, 1), (1, 2, 2))

Size = tuple[int, ...]  # (dp, tp, pp), or (dp, tp, pp, cp) with sequences split
Check = tuple[str, str, Size]  # (precision, case, size)
PRECISIONS = ("fp32", "bf16")  # in this order: ``covering`` rotates the layouts by it


# A Mixture-of-Experts case also runs two of these, rotating, in each precision: with its
# experts split over 4 replicas (``expert_split``), and ep beside tp and beside pp.
EXPERT_LAYOUTS = ((4, 1, 1), (2, 2, 1), (2, 1, 2))

# With ``context``, every case whose family can split its sequences also runs one of these
# (dp, tp, pp, cp), rotating: cp alone (one group of 2 and of 4), beside tp, beside pp, and two
# groups of 2 (``rayhf.parallel.context``).
CONTEXT_LAYOUTS = ((2, 1, 1, 2), (4, 1, 1, 4), (2, 2, 1, 2), (2, 1, 2, 2), (4, 1, 1, 2))


def covering(
    world: int, cases: Sequence[str], precisions: Sequence[str], context: bool = False
) -> list[Check]:
    """The checks of a run: not every case on every layout, but every case on ``BASE_LAYOUTS``
    and on one more layout, which rotates over the cases so that in each precision every
    layout of ``world`` is checked for some case (with fewer cases than layouts: every case on
    every layout); a Mixture-of-Experts case on two of ``EXPERT_LAYOUTS`` more, rotating over
    those cases so that each precision runs all of them (with two such cases or more); with
    ``context``, a case whose family has no linear-attention layer on one of
    ``CONTEXT_LAYOUTS`` more, rotating likewise."""
    every = layouts(world)
    base = [s for s in BASE_LAYOUTS if s in every]
    rest = [s for s in every if s not in base]
    if len(cases) < len(rest):
        return [(p, c, s) for p in precisions for c in cases for s in every]
    moe = [c for c in cases if FAMILIES[CASES[c].family].moe is not None]
    out: list[Check] = []
    for j, p in enumerate(precisions):
        for i, c in enumerate(cases):
            sizes = [*base, rest[(i + j) % len(rest)]]
            if c in moe:
                m = moe.index(c) + j
                turn = [
                    EXPERT_LAYOUTS[(m + k) % len(EXPERT_LAYOUTS)]
                    for k in range(len(EXPERT_LAYOUTS))
                ]
                sizes += [x for x in turn if x not in sizes and x in every][:2]  # two new ones
            out += [(p, c, s) for s in dict.fromkeys(sizes) if s in every]
            fits = [s for s in CONTEXT_LAYOUTS if s[0] * s[1] * s[2] <= world]
            if context and fits and FAMILIES[CASES[c].family].delta_net is None:
                out.append((p, c, fits[(i + j) % len(fits)]))
    return out


def _model(case: str, value_head: bool, device: str = "cpu"):
    """The tiny model of case ``case`` of ``CASES``: a fresh copy (a copy costs a third of a
    build)."""
    return copy.deepcopy(_pristine(case, value_head)).to(device)


@functools.cache
def _pristine(case: str, value_head: bool):
    c = CASES[case]
    return tiny_model(c.family, dict(c.shape), value_head, seed=7)


@functools.cache
def _shared(case: str, value_head: bool, precision: str = "fp32", device: str = "cpu"):
    """``_model`` in ``precision``, built once per process for what only reads it (references,
    frozen copies): building models is half a check's time. Never train it."""
    return _model(case, value_head, device).to(DTYPES[precision])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (4, 10), generator=gen)
    ids[0, 3] = ids[2, 1] = PAD  # a pad id inside a row: Llama's embedding gives it no gradient
    mask = torch.ones_like(ids)
    for row, n in enumerate((10, 7, 4, 9)):
        mask[row, n:] = 0
        ids[row, n:] = PAD
    return ids, mask


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # a greedy generate's, one per row
SCORE_SLICE = 3  # tokens per slice of the scoring head here: every row spans several


def _targets(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each position's next token where it is in the row, else -1 (``score``'s targets)."""
    targets = torch.full_like(ids, -1)
    targets[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], -1)
    return targets


def _score_loss(scored: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``_loss`` from ``score``'s log-probs."""
    m = mask[:, 1:].float()
    return (-(scored[:, :-1, 0] * m).sum(1) / m.sum(1)).mean()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over rows of each row's mean next-token cross-entropy."""
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].float()
    return (-(logp * m).sum(1) / m.sum(1)).mean()


def _grad_error(engine, ref_params: dict[str, Any]) -> float:
    """Max abs difference of this rank's (clipped, dp-averaged) gradient shards from the same
    slices of the reference gradients, over the largest reference gradient."""
    from rayhf.models.sharding import take_shard

    groups, module = engine.model.groups, engine.model.module
    tp, tp_rank = groups.tp, groups.coords.tp_rank
    worst, scale = 0.0, max(float(p.grad.abs().max()) for p in ref_params.values())
    for name, p in module.local_state().items():
        shard = module.shards[name]
        if not shard.trained:  # a router's bias: Hugging Face's buffer, no gradient
            continue
        want = take_shard(ref_params[name].grad, shard, tp, tp_rank, groups.ep, groups.ep_rank)
        worst = max(worst, float((p.grad - want).abs().max()))
    return worst / scale


def _train_step(engine, ids: torch.Tensor, mask: torch.Tensor) -> None:
    from rayhf.data.batch import PackedBatch

    rows = PackedBatch(list(range(len(ids))))
    targets = _targets(ids, mask)
    engine.train([rows], lambda _: (_score_loss(engine.score(ids, mask, targets), mask), {}))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].to(v.device) - v).abs().max()) for k, v in b.items())


def _share_off(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> float:
    """The share of parameter elements that differ by more than ``tol``."""
    off = sum(int(((a[k].to(v.device) - v).abs() > tol).sum()) for k, v in b.items())
    return off / sum(v.numel() for v in b.values())


def _value_error(case: str, groups, rows: Rows, precision: str, device: str) -> float:
    """A frozen critic's per-token values against the Hugging Face model's, on this rank's
    ``rows``, both in ``precision``."""
    from rayhf.engines.build import standalone_engine

    ids, mask = _rows(rows, device)
    critic = standalone_engine(
        _shared(case, True), Tok(), True, None, groups, device=device, precision=precision
    )
    keep = mask.bool()
    want = _reference_values(case, precision, device, rows)
    with torch.no_grad():
        return _rel(critic.forward(ids, mask)[keep], want[keep])


def _autocast(precision: str, device: str):
    """Hugging Face's reference under the autocast a trained copy runs in (none in fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[precision])


# Hugging Face's side of a check does not depend on the layout: each process works it out once
# per case, precision and rows (cached as ``_shared`` is), and every layout it runs is held to it.
Rows = tuple[int, int]  # a replica's rows of ``_batch``: [start, stop)


def _rows(rows: Rows, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of ``_batch``, ids and mask, on ``device``."""
    ids, mask = _batch()
    return ids[slice(*rows)].to(device), mask[slice(*rows)].to(device)


@functools.cache
def _reference_logits(case: str, precision: str, device: str, rows: Rows) -> torch.Tensor:
    """Hugging Face's logits of ``rows`` (fp32) from its model in ``precision``."""
    ids, mask = _rows(rows, device)
    with torch.no_grad():
        return _shared(case, False, precision, device)(ids, attention_mask=mask).logits.float()


@functools.cache
def _reference_values(case: str, precision: str, device: str, rows: Rows) -> torch.Tensor:
    """Hugging Face's critic's per-token values of ``rows`` (fp32), in ``precision``."""
    from rayhf.models.hf import per_token_values

    ids, mask = _rows(rows, device)
    with torch.no_grad():
        return per_token_values(_shared(case, True, precision, device), ids, mask).float()


@functools.cache
def _reference_tokens(case: str, precision: str, device: str, rows: Rows) -> list[list[int]]:
    """Hugging Face's greedy tokens for the ``PROMPTS`` of ``rows``, its model in ``precision``."""
    from rayhf.sampling import generate

    model = _shared(case, False, precision, device)
    return generate(model, PROMPTS[slice(*rows)], _greedy(), EOS, PAD).tokens


@functools.cache
def _reference_step(case: str, precision: str, device: str, rows: Rows):
    """Hugging Face's model after one AdamW step on ``rows`` (its forward under ``precision``'s
    autocast), its gradients kept. Read it, never train it."""
    from rayhf.engines.torch_trainer import OptimizerConfig

    ids, mask = _rows(rows, device)
    opt, ref = OptimizerConfig(), _model(case, False, device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps)
    with _autocast(precision, device):
        logits = ref(input_ids=ids, attention_mask=mask).logits.float()
    _loss(logits, ids, mask).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), opt.grad_clip)
    ref_opt.step()
    return ref


def _greedy(routes: bool = False):
    """Six greedy tokens (recording each one's experts with ``routes``)."""
    from rayhf.sampling import GenerationConfig

    return GenerationConfig(max_new_tokens=6, greedy=True, expert_routes=routes)


def _same_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of token positions where two batches of sequences agree."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)]
    longest = sum(max(len(ra), len(rb)) for ra, rb in zip(a, b, strict=True))
    return sum(x == y for x, y in pairs) / max(1, longest)


def expert_split(case: str, dp: int, precision: str) -> int:
    """The ep a Mixture-of-Experts case runs a layout of ``dp`` replicas with: its experts
    split over all of them in fp32, over pairs of them in bf16 (dp = 4: ep 4 and ep 2, the
    latter summing expert gradients over 2 ranks); 1 for a dense case."""
    if FAMILIES[CASES[case].family].moe is None:
        return 1
    return dp if precision == "fp32" else min(dp, 2)


def _check(
    case: str, size: Size, rank: int, precision: str = "fp32", device: str = "cpu"
) -> dict[str, Any] | None:
    from rayhf.algorithms.lm import scores_from_logits
    from rayhf.engines.build import standalone_engine as engine_of
    from rayhf.engines.torch_trainer import OptimizerConfig
    from rayhf.parallel.groups import build_groups

    dp, tp, pp, cp = (*size, 1)[:4]
    ep = expert_split(case, dp, precision) if cp == 1 else 1
    groups = build_groups(dp, tp, pp, rank, ep=ep, cp=cp)
    if groups.coords.dp_rank < 0:
        return None
    ids, mask = (t.to(device) for t in _batch())
    shares, share = dp // cp, groups.batch_rank  # a cp group's ranks split its rows' tokens
    bounds = (share * 4 // shares, (share + 1) * 4 // shares)
    rows = slice(*bounds)
    my_ids, my_mask, keep = ids[rows], mask[rows], mask[rows].bool()
    opt = OptimizerConfig()  # lr 1e-4, AdamW, clip at norm 1
    frozen = engine_of(
        _shared(case, False), Tok(), False, None, groups, device=device, precision=precision
    )
    targets = _targets(my_ids, my_mask)
    want = _reference_logits(case, precision, device, bounds)
    with torch.no_grad():
        logit_err = _rel(frozen.forward(my_ids, my_mask)[keep], want[keep])
        scored = targets >= 0
        score_err = _rel(
            frozen.score(my_ids, my_mask, targets)[scored],
            scores_from_logits(want, targets)[scored],
        )
    value_err = (  # a family with no sequence-classification class has no critic
        _value_error(case, groups, bounds, precision, device)
        if FAMILIES[CASES[case].family].value_head_class
        else None
    )
    prompts = PROMPTS[rows]
    # with experts split over the replicas they decode in step; the last has no prompts of its
    # own and serves the others' exchanges (pp = 1 only: the decode engine refuses more)
    decodes = (ep == 1 or pp == 1) and cp == 1  # (the decode engine splits no row)
    mine = [] if ep > 1 and groups.coords.dp_rank == dp - 1 else prompts
    same_tokens = None
    if decodes:
        got = frozen.generate(mine, _greedy(), 0).tokens
        if mine:
            same_tokens = _same_share(got, _reference_tokens(case, precision, device, bounds))
    engine = engine_of(
        _model(case, False), Tok(), False, opt, groups, device=device, precision=precision
    )
    model = engine.model
    assert model is not None
    # One optimizer step: the engine on its rows; the reference on all rows (dp averages).
    _train_step(engine, my_ids, my_mask)
    ref = _reference_step(case, precision, device, (0, len(ids)))
    grad_err = _grad_error(engine, dict(ref.named_parameters()))
    full = engine.full_state()
    step_err = _max_diff(full, ref.state_dict())
    # AdamW's first step moves each weight by about lr: a gradient of the other sign (a tiny
    # one, rounded at bf16) moves it 2 lr away from the reference's. How many did.
    step_off = _share_off(full, ref.state_dict(), opt.lr / 2)
    zero1_err = None
    if dp > 1 and CASES[case].zero1:  # ZeRO-1: optimizer state sharded over the replicas
        zero1 = OptimizerConfig(zero1=True)
        zero = engine_of(
            _model(case, False), Tok(), False, zero1, groups, device=device, precision=precision
        )
        _train_step(zero, my_ids, my_mask)
        zero1_err = _max_diff(zero.full_state(), ref.state_dict())
    replay: tuple[float | None, float | None, float | None] = (None, None, None)
    if FAMILIES[CASES[case].family].moe is not None:
        replay = _replayed(case, frozen, bounds, decodes, precision, device)
    fp32_split = ep > 1 and precision == "fp32"
    turns = _uneven_turns(case, groups, device) if fp32_split else (None, None)
    before = _shared(case, False, "fp32", device).state_dict()
    moved = _max_diff(full, before)
    return {
        "precision": precision,
        "device": device,
        "family": case,
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "cp": cp,
        "rank": rank,
        "logits": logit_err,
        "scores": score_err,
        "values": value_err,
        "grads": grad_err,
        "step": step_err,
        "step_off": step_off,
        "zero1_step": zero1_err,
        "moved": moved,
        "generate": same_tokens,
        "replay": replay[0],
        "replay_moved": replay[1],
        "routes": replay[2],
        "turns_logits": turns[0],
        "turns_step": turns[1],
        "bytes": model.local_bytes(),
        "frozen_bytes": frozen.model.local_bytes() if frozen.model is not None else 0,
    }


def _replayed(
    case: str, frozen, rows: Rows, generate: bool, precision: str, device: str
) -> tuple[float, float, float | None]:
    """Routing replay under this layout on ``rows``, against one process of the same precision:
    the scores' error with every other token sent to k random experts, what that changed, and
    (with ``generate``) the share of a greedy generate's recorded experts that are one
    process's."""
    ids, mask = _rows(rows, device)
    given, want, own, theirs = _one_process_replay(case, rows, generate, precision, device)
    targets = _targets(ids, mask)
    with torch.no_grad():
        got = frozen.score(ids, mask, targets, 1.0, given, True)[targets >= 0]
    routes = None
    if generate:
        assert theirs is not None
        mine = torch.cat(frozen.generate(PROMPTS[slice(*rows)], _greedy(True), 0).routes)
        routes = float((mine == theirs).float().mean()) if mine.shape == theirs.shape else 0.0
    return _rel(got, want), _rel(want, own), routes


@functools.cache
def _one_process_replay(
    case: str, rows: Rows, generate: bool, precision: str, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``_replayed``'s one process: the experts given (every other token keeps its router's),
    its scores with them and with its router's own, and (with ``generate``) the experts a
    greedy generate of the rows' prompts records."""
    from rayhf.engines.build import standalone_engine as engine_of

    ids, mask = _rows(rows, device)
    one = engine_of(_shared(case, False), Tok(), False, None, device=device, precision=precision)
    assert one.model is not None and one.model.spec.moe is not None
    spec, moe = one.model.spec, one.model.spec.moe
    gen = torch.Generator().manual_seed(7)
    draw = torch.rand(*ids.shape, len(spec.moe_layers), moe.n_experts, generator=gen)
    given = draw.argsort(dim=-1)[..., : moe.top_k].to(torch.int16)
    given[:, ::2] = -1  # these keep their router's
    given = given.to(device)
    targets = _targets(ids, mask)
    scored = targets >= 0
    with torch.no_grad():
        want = one.score(ids, mask, targets, 1.0, given, True)[scored]
        own = one.score(ids, mask, targets)[scored]
    theirs = None
    if generate:
        theirs = torch.cat(one.generate(PROMPTS[slice(*rows)], _greedy(True), 0).routes)
    return given, want, own, theirs


def _uneven_turns(case: str, groups, device: str) -> tuple[float, float]:
    """With the experts split over ep ranks, ranks that run their model unequally often (fp32):
    rank ``i`` of the ep group runs ``i + 1`` forwards of its rows, then serves the others'
    (``RankModel.ep_drain``); then the last replica trains on an empty minibatch beside the
    others' rows. The worst logits error, and the step's largest difference from Hugging
    Face's model trained on the other replicas' rows."""
    from rayhf.data.batch import PackedBatch
    from rayhf.engines.build import standalone_engine as engine_of
    from rayhf.engines.torch_trainer import OptimizerConfig

    dp, r, n = groups.dp, groups.coords.dp_rank, len(_batch()[0])
    bounds = (r * n // dp, (r + 1) * n // dp)
    ids, mask = _rows(bounds, device)
    frozen = engine_of(_shared(case, False), Tok(), False, None, groups, device=device)
    keep = mask.bool()
    worst = 0.0
    want = _reference_logits(case, "fp32", device, bounds)
    with torch.no_grad():
        for _ in range(groups.ep_rank + 1):
            worst = max(worst, _rel(frozen.forward(ids, mask)[keep], want[keep]))
    assert frozen.model is not None
    frozen.model.ep_drain()
    engine = engine_of(_model(case, False), Tok(), False, OptimizerConfig(), groups, device=device)
    idle = r == dp - 1
    batch = PackedBatch([] if idle else list(range(len(ids))))
    targets = _targets(ids, mask)
    engine.train([batch], lambda _: (_score_loss(engine.score(ids, mask, targets), mask), {}))
    # the reference trains on every replica's rows but the last's
    ref = _reference_step(case, "fp32", device, (0, (dp - 1) * n // dp))
    return worst, _max_diff(engine.full_state(), ref.state_dict())


def _worker(
    rank: int,
    world: int,
    address: str,
    out: str,
    checks: list[Check],
    device: str,
    cases: dict[str, Case],
    rows: dict[str, FamilyTraits],
) -> None:
    torch.set_num_threads(1)
    import rayhf.parallel.model
    from rayhf.models.files import quiet_transformers

    rayhf.parallel.model.LOGIT_CHUNK = SCORE_SLICE * VOCAB
    for name, traits in rows.items():  # rows the parent registered (a test's family)
        if name not in FAMILIES:
            register_family(name, traits)
    CASES.clear()
    CASES.update(cases)

    quiet_transformers()
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=join_store(address), rank=rank, world_size=world)
    rows_out = []
    for precision, case, size in checks:
        row = _check(case, size, rank, precision, device)
        if row is not None:
            rows_out.append(row)
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows_out)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([r for part in gathered for r in part], f, indent=1)
    leave_spawned()


def run(
    out: str,
    world: int = 4,
    precisions: Sequence[str] = PRECISIONS,
    device: str = "cpu",
    cases: dict[str, Case] | None = None,
    sizes: list[tuple[int, int, int]] | None = None,
) -> None:
    """Check ``cases`` (default: ``CASES``) with ``world`` spawned ranks, writing the rows to
    ``out``: each case on each of ``sizes`` (dp, tp, pp) in each precision, or with no
    ``sizes`` the ``covering`` set of layouts. The cases' family rows go with them: a family
    registered in this process is checked too."""
    cases = CASES if cases is None else cases
    rows = {c.family: FAMILIES[c.family] for c in cases.values()}
    if sizes is None:
        checks = covering(world, list(cases), precisions, context=True)
    else:
        checks = [(p, c, s) for p in precisions for c in cases for s in sizes]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _store, address = host_store()  # open here while the ranks meet through it
    spawn_args = (world, address, out, checks, device, dict(cases), rows)
    mp.spawn(_worker, args=spawn_args, nprocs=world, join=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=list(DTYPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--every-layout", action="store_true", help="every case on every layout (default: a cover)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        parser.error(f"--world {args.world} needs as many GPUs; {torch.cuda.device_count()} seen")
    sizes = layouts(args.world) if args.every_layout else None
    run(args.out, args.world, args.precision, args.device, sizes=sizes)


if __name__ == "__main__":
    main(sys.argv[1:])
