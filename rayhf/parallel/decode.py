"""The native generator's decode step and the loop around it, on a rank's pipeline stage.

    prompts --prefill (each distinct prompt once; its repeats copy its keys and values)
      --> first tokens in slots (rows of buffers allocated once: KV cache, tokens, positions,
          per-row steps, live mask, uniforms, outputs)
      --> decode_step x up to CHECK_EVERY: one token per slot, fixed shapes, sampling inside,
          no host sync (compiled and/or replayed from a CUDA graph per (rows, keys) bucket)
      --> one look at which rows ended: their outputs are kept, freed slots take waiting
          prompts (refill) or the live rows move down into a smaller bucket (compact)
      --> ... until every prompt has ended -> per-prompt tokens and log-probs up to EOS
          (and, with ``rules.top_logprobs`` k > 0, the k most likely tokens at each position;
          with ``rules.routes``, the experts each token went to, prompt and response)

A slot's row is sampled with the uniforms of its prompt (``rayhf.sampling.uniforms``), so what a
prompt gets does not depend on its slot, its neighbours or when it was refilled. Rows that have
ended (and empty slots of a bucket) keep stepping until the next look: they feed pad tokens,
write their keys at a position they no longer use and their outputs to a spare column.

With pp > 1 each stage runs its own part of the step (its layers; the last stage also chooses),
hidden states go point to point between the parts, and the last stage's choice is broadcast to
the pipeline, where every stage advances its own copy of the slots.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rayhf.errors import RayhfError
from rayhf.parallel.attention import KVCache, TokenLayout
from rayhf.parallel.buckets import CHECK_EVERY, cache_capacity, key_bucket, row_bucket
from rayhf.parallel.lent import lent_weights, packable, refresh_lent
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.moe import Routes
from rayhf.parallel.pipeline import Pipeline
from rayhf.sampling import (
    DecodeRules,
    Feed,
    GenerateOutput,
    GenerationConfig,
    check_prompts,
    choose,
    cut_row,
    top_logprobs,
    uniforms,
)

# Top log-probs slots hold per token whenever a call asks for any (the most the policy server
# takes, as vLLM's default max_logprobs): each k a client asks for then fits the same buffers,
# and a new k reallocates nothing (on CUDA: keeps the captured graphs).
TOP_LOGPROBS_SLOTS = 20


@dataclass(frozen=True)
class DecodeOptions:
    """How the engine runs the step (resolved for the device: ``capture`` only on CUDA)."""

    max_rows: int = 256  # slots decoded at once; further prompts wait for a slot
    capture: bool = False  # replay the step from a CUDA graph per bucket
    compile: bool = False  # torch.compile(fullgraph=True) the step (before capturing it)
    compact: bool = True  # move live rows into a smaller bucket once they fit one
    pack: bool = True  # on CPUs, multiply oneDNN-packed copies of the fp32 weights
    share_prompts: bool = True  # prefill a repeated prompt once
    # lend LoRA-adapted weights with their adapters merged in, made at each weight update
    # (False: the step adds each adapter's two products at every token); docs/decisions/
    merge_adapters: bool = True


class Slots:
    """Per-slot decode state on the device: ``n`` slots of up to ``max_new`` tokens each, with
    room for ``k`` top log-probs per token (0: none, empty tensors; a call asking for fewer,
    ``DecodeRules.top_logprobs``, uses the first ones) and, with ``routes`` ``(L, k)``, each
    fed token's experts in L MoE layers."""

    def __init__(
        self,
        n: int,
        max_new: int,
        hidden: int,
        dtype: torch.dtype,
        device,
        k: int = 0,
        routes: tuple[int, int] | None = None,
    ) -> None:
        self.n, self.max_new, self.k, self.routes = n, max_new, k, routes
        long = {"dtype": torch.long, "device": device}
        self.tokens = torch.zeros(n, **long)  # the token each slot feeds next
        self.positions = torch.zeros(n, **long)  # where that token sits in its row
        self.steps = torch.zeros(n, **long)  # tokens the row has chosen
        self.live = torch.zeros(n, dtype=torch.bool, device=device)
        self.u = torch.full((n, max_new), 0.5, device=device)  # the row's uniform per token
        self.out_tokens = torch.zeros(n, max_new + 1, **long)  # column max_new: spare
        self.out_logprobs = torch.zeros(n, max_new + 1, device=device)
        self.chosen = torch.zeros(n, **long)  # pp > 1: the last stage's choice, broadcast
        self.chosen_logprobs = torch.zeros(n, device=device)
        self.out_top_ids = torch.zeros(n, max_new + 1, k, **long)
        self.out_top_logprobs = torch.zeros(n, max_new + 1, k, device=device)
        self.chosen_top_ids = torch.zeros(n, k, **long)  # pp > 1, as ``chosen``
        self.chosen_top_logprobs = torch.zeros(n, k, device=device)
        self.hidden_in = torch.zeros(n, hidden, dtype=dtype, device=device)  # pp > 1
        self.hidden_out = torch.zeros(n, hidden, dtype=dtype, device=device)
        # the experts of the token each slot fed (this stage's MoE layers; 0 in the others'),
        # and per slot those of each response token fed (column max_new: spare)
        self.step_routes: torch.Tensor | None = None
        self.out_routes: torch.Tensor | None = None
        if routes is not None:
            short = {"dtype": torch.int16, "device": device}
            self.step_routes = torch.zeros(n, *routes, **short)
            self.out_routes = torch.zeros(n, max_new + 1, *routes, **short)

    def fits(self, n: int, max_new: int, k: int, routes: tuple[int, int] | None) -> bool:
        return n <= self.n and max_new <= self.max_new and k <= self.k and routes == self.routes

    def recording(self, b: int) -> Routes | None:
        """What a step over the first ``b`` slots records its tokens' experts in."""
        return None if self.step_routes is None else Routes(record=self.step_routes[:b])

    def draws(self, b: int) -> torch.Tensor:
        """Each of the first ``b`` slots' uniform for the token it chooses next."""
        col = self.steps[:b].clamp(max=self.max_new - 1)
        return self.u[:b].gather(1, col[:, None]).squeeze(1)

    def mutable(self) -> list[torch.Tensor]:
        """What a step writes (saved around a warm-up run before a capture)."""
        routes = [] if self.out_routes is None else [self.out_routes]
        return [self.tokens, self.positions, self.steps, self.live, self.out_tokens,
                self.out_logprobs, self.chosen, self.chosen_logprobs, self.out_top_ids,
                self.out_top_logprobs, self.chosen_top_ids, self.chosen_top_logprobs,
                *routes]  # fmt: skip

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Slots ``dst`` take the state of slots ``src``."""
        for t in (*self.mutable(), self.u):
            t[dst] = t[src]


Top = tuple[torch.Tensor, torch.Tensor]  # ``top_logprobs``: ids and log-probs, [rows, k] each


def advance(
    slots: Slots,
    rules: DecodeRules,
    b: int,
    new: torch.Tensor,
    lp: torch.Tensor,
    top: Top | None = None,
):
    """Record the first ``b`` slots' chosen tokens: live rows write their step's column and move
    on; ended rows write pad to the spare column and stay."""
    live, steps = slots.live[:b], slots.steps[:b]
    rows = torch.arange(b, device=new.device)
    new = torch.where(live, new, rules.pad)
    col = torch.where(live, steps, slots.max_new)
    slots.out_tokens[rows, col] = new
    slots.out_logprobs[rows, col] = lp
    if top is not None:
        k = top[0].shape[-1]
        slots.out_top_ids[rows, col, :k], slots.out_top_logprobs[rows, col, :k] = top
    if slots.out_routes is not None:  # the experts of the token fed: the one chosen before
        assert slots.step_routes is not None
        slots.out_routes[rows, torch.where(live, steps - 1, slots.max_new)] = slots.step_routes[:b]
    still = live & (new != rules.eos) & (steps + 1 < rules.max_new_tokens)
    grew = live.long()
    slots.tokens[:b] = new
    slots.positions[:b] += grew
    slots.steps[:b] += grew
    slots.live[:b] = still


def decode_step(
    model: ShardedModel, cache: KVCache, slots: Slots, rules: DecodeRules, b: int, n_keys: int
) -> None:
    """One token for each of the first ``b`` slots of a whole model (pp = 1), attending over
    the first ``n_keys`` key slots: forward, choose, advance."""
    where = TokenLayout.decode_step(slots.positions[:b], n_keys, cache)
    logits = model(slots.tokens[:b], where, cache, routes=slots.recording(b))
    new, lp, top = choose_with_top(logits, rules, slots.draws(b), slots.steps[:b])
    advance(slots, rules, b, new, lp, top)


def choose_with_top(
    logits: torch.Tensor, rules: DecodeRules, u: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Top | None]:
    """``choose``, and with ``rules.top_logprobs`` k > 0 the k most likely tokens first (from
    the raw logits ``choose`` then consumes), one logsumexp over the vocabulary serving both."""
    if not rules.top_logprobs:
        return (*choose(logits, rules, u, steps), None)
    lse = logits.logsumexp(-1)
    top = top_logprobs(logits, rules.top_logprobs, lse)
    return (*choose(logits, rules, u, steps, lse), top)


def stage_step(
    model: ShardedModel, cache: KVCache, slots: Slots, rules: DecodeRules, b: int, n_keys: int
) -> None:
    """One pipeline stage's part of a decode step (pp > 1): tokens (first stage) or received
    hidden states through its layers, into ``hidden_out``, or (last stage) into ``chosen``."""
    where = TokenLayout.decode_step(slots.positions[:b], n_keys, cache)
    first = model.groups.is_first_stage
    x = slots.tokens[:b] if first else slots.hidden_in[:b]
    out = model(x, where, cache, routes=slots.recording(b))
    if not model.groups.is_last_stage:
        slots.hidden_out[:b] = out
        return
    new, lp, top = choose_with_top(out, rules, slots.draws(b), slots.steps[:b])
    if top is not None:
        k = rules.top_logprobs
        slots.chosen_top_ids[:b, :k], slots.chosen_top_logprobs[:b, :k] = top
    slots.chosen[:b] = new
    slots.chosen_logprobs[:b] = lp


def advance_chosen(slots: Slots, rules: DecodeRules, b: int) -> None:
    """``advance`` with the broadcast choice (pp > 1)."""
    k = rules.top_logprobs
    top = (slots.chosen_top_ids[:b, :k], slots.chosen_top_logprobs[:b, :k]) if k else None
    advance(slots, rules, b, slots.chosen[:b], slots.chosen_logprobs[:b], top)


@dataclass
class _Row:
    """What the host knows of an occupied slot, without asking the device."""

    prompt: int  # index of its prompt in the call
    length: int  # prompt tokens
    started: int  # the engine's step count when its prefill chose its first token


@dataclass
class _Call:
    """One generate call's prompts (growing when fed), their results so far and its rules."""

    prompts: list[list[int]]
    results: list[tuple[list[int], list[float], bool] | None]
    rules: DecodeRules
    seed: int
    feed: Feed | None
    tops: dict[int, tuple[list[list[int]], list[list[float]]]]  # prompt -> its top log-probs
    # with ``rules.routes``: prompt -> its tokens' experts (filled as it is prefilled), then
    # those of its tokens and response's (as its row ends)
    routes: dict[int, torch.Tensor]


class DecodeEngine:
    """Generates on one rank's pipeline stage; keeps its buffers (and graphs) between calls
    while they fit, until ``release``."""

    def __init__(
        self,
        pipe: Pipeline,
        options: DecodeOptions | None = None,
        compiler: Callable[[Callable], Callable] | None = None,
    ) -> None:
        """``compiler`` (with ``options.compile``): how a part of the step is compiled
        (default ``torch.compile(fullgraph=True)``; a test counts compilations with its own)."""
        self.pipe, self.model = pipe, pipe.model
        self.options = options or DecodeOptions()
        self.cache: KVCache | None = None
        self.slots: Slots | None = None
        self.graphs: dict[Any, Any] = {}  # bucket key -> torch.cuda.CUDAGraph
        self.captured_weights: tuple[int, ...] = ()
        self.lent: dict[str, torch.Tensor] | None = None  # see ``lend_weights``
        self.lent_of: tuple[int, ...] = ()  # the weights' fingerprint when they were made
        self.pool: Any = None
        self.n_steps = 0  # decode steps run by this engine
        self.buckets: set[tuple[str, int, int]] = set()  # the (part, rows, keys) steps ran at
        step_fns: tuple[Callable[..., None], ...] = (decode_step, stage_step, advance_chosen)
        if self.options.compile:
            _allow_recompiles()
            compiler = compiler or functools.partial(torch.compile, fullgraph=True)
            step_fns = tuple(compiler(f) for f in step_fns)
        self._decode, self._stage, self._advance = step_fns

    # buffers -----------------------------------------------------------------------------

    def _ensure(
        self, n_rows: int, capacity: int, max_new: int, k: int, routes: tuple[int, int] | None
    ) -> None:
        m = self.model
        if self.cache is None or not self.cache.fits(n_rows, capacity):
            self.release()
            self.cache = m.new_cache(n_rows, capacity)
        if self.slots is None or not self.slots.fits(self.cache.n_rows, max_new, k, routes):
            self._forget_graphs()
            dtype, hidden = m.numerics.storage, m.spec.hidden_size
            self.slots = Slots(self.cache.n_rows, max_new, hidden, dtype, m.device, k, routes)

    def lend_weights(self) -> None:
        """The copies of the matmul weights the step multiplies, kept between calls and made
        again (or refreshed in place) when the weights change: cast to the autocast dtype for a
        model kept in fp32 that computes in bf16 (a trained role's master weights: else every
        weight is cast at every token), oneDNN-packed on CPUs (faster matmuls at decode's few
        rows: docs/decisions/), an fp32 LM head (``Numerics.fp32_lm_head``) in fp32, each
        LoRA-adapted weight with its adapter merged in (``DecodeOptions.merge_adapters``, while
        the adapters are on), none otherwise."""
        m = self.model
        low = m.numerics.autocast
        pack = low is None and m.device.type == "cpu" and packable()
        pack = pack and self.options.pack and not self.options.compile  # inductor packs its own
        merge = self.merges
        if low is None and not pack and not m.numerics.head_in_fp32 and not merge:
            self.lent, self.lent_of = None, ()
            return
        fingerprint = (merge, *m.weights_fingerprint())
        if self.lent is not None and fingerprint == self.lent_of:
            return
        with torch.no_grad():
            in_place = self.lent is not None and self.lent_of[:1] == (merge,) and not pack
            if in_place:  # a captured graph reads them
                assert self.lent is not None
                refresh_lent(self.lent, m, merge)
            else:
                self.lent = lent_weights(m, low, pack, merge)
                self._forget_graphs()
        self.lent_of = fingerprint

    @property
    def merges(self) -> bool:
        """Whether the lent weights hold the LoRA adapters merged in (see ``lend_weights``)."""
        m = self.model
        return self.options.merge_adapters and bool(m.adapters) and m.adapters_on

    def release(self) -> None:
        """Free the KV cache, the slots, the lent weights and the captured graphs (a colocated
        role needs the memory); the next call allocates them again."""
        self._forget_graphs()
        self.cache = self.slots = self.lent = None
        self.lent_of = ()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _forget_graphs(self) -> None:
        self.graphs.clear()
        self.pool = None

    # the call ----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], rules: DecodeRules, seed: int, feed: Feed | None = None
    ) -> GenerateOutput:
        """One response per prompt; every rank of the pipeline returns the same output. With a
        ``feed`` (pp = tp = 1), prompts it hands over at each look take free slots, every
        response goes to it as its row ends, and the output holds the fed prompts' too."""
        prompts = list(prompts)
        n, m = len(prompts), rules.max_new_tokens
        ep = self.model.groups.ep_group  # experts split over replicas: they step together
        if ep is not None and self.pipe.groups.pp > 1:
            raise RayhfError("a generate call with experts split over replicas needs pp = 1")
        if n == 0:  # (with ep > 1: the group's others generate; serve their exchanges)
            assert ep is not None, "a generate call of no prompts"
            with torch.inference_mode():
                self._loop([], deque(), None, rules)
            return GenerateOutput()
        if feed is not None and self.pipe.groups.pp * self.pipe.groups.tp > 1:
            raise RayhfError("a fed generate call (multi-turn rollouts) needs tp = pp = 1")
        rows_wanted = n if feed is None else max(n, feed.rows)
        longest = (
            max(len(p) for p in prompts) if feed is None else max(feed.longest, *map(len, prompts))
        )
        n_slots = self._bucket(min(rows_wanted, self.options.max_rows))
        capacity = cache_capacity(longest, m, self._bucketed)
        k = rules.top_logprobs and max(rules.top_logprobs, TOP_LOGPROBS_SLOTS)
        self._ensure(n_slots, capacity, m, k, self._routes_shape(rules))
        assert self.slots is not None and self.cache is not None
        self.slots.live.zero_()  # slots a previous call left are empty
        pointers = tuple(p.data_ptr() for p in self.model.parameters())
        if pointers != self.captured_weights:  # new storage (a release, a move): recapture
            self._forget_graphs()
            self.captured_weights = pointers
        self.lend_weights()
        results: list[tuple[list[int], list[float], bool] | None] = [None] * n
        waiting = deque(range(n))
        rows: list[_Row | None] = [None] * n_slots
        call = _Call(prompts, results, rules, seed, feed, {}, {})
        with torch.inference_mode(), self.model.reading_lent(self.lent, self.merges):
            self._loop(rows, waiting, call, rules)
        out = GenerateOutput()
        for i, r in enumerate(results):
            assert r is not None
            out.tokens.append(r[0])
            out.logprobs.append(r[1])
            out.finished.append(r[2])
            if rules.top_logprobs:
                out.top_ids.append(call.tops[i][0])
                out.top_logprobs.append(call.tops[i][1])
            if self.slots.routes is not None:
                out.routes.append(call.routes[i])
        return out

    def _loop(
        self, rows: list[_Row | None], waiting: deque, call: _Call | None, rules: DecodeRules
    ) -> None:
        """Decode until every prompt has ended: fill, steps, a look, fill or compact. With
        experts split over the replicas (ep > 1) every MoE layer exchanges tokens, so the ep
        group's ranks agree at each look whether any is still busy, fills and how many steps
        run; a rank with nothing of its own runs passes of no tokens beside the others'."""
        m, feed = rules.max_new_tokens, call.feed if call is not None else None
        self._fill(rows, waiting, call)
        while self._agree(int(any(r is not None for r in rows) or bool(waiting))):
            live = any(r is not None for r in rows)
            steps = b = 0
            if live:
                b = self._bucket(max(i for i, r in enumerate(rows) if r is not None) + 1)
                left = max(m - 1 - (self.n_steps - r.started) for r in rows if r is not None)
                steps = min(CHECK_EVERY, left)
            for _ in range(self._agree(steps)):  # (past a row's end: its spare column)
                if live:
                    self._step(rules, b, self._n_keys(rows, m))
                else:
                    self._idle_pass()
            if live:
                assert call is not None
                self._collect(rows, b, call)
            if feed is not None and call is not None:
                assert self.cache is not None
                free = sum(r is None for r in rows) - len(waiting)
                for p in feed.more(max(free, 0), self.cache.capacity - m):
                    waiting.append(len(call.prompts))
                    call.prompts.append(p)
                    call.results.append(None)
            filling = bool(waiting)
            if filling or self.model.groups.ep > 1:
                self._fill(rows, waiting, call)
            if not filling and self.options.compact:
                self._compact(rows)

    def _agree(self, value: int) -> int:
        """``value``'s largest over the ep group (this rank's without one)."""
        group = self.model.groups.ep_group
        if group is None:
            return value
        t = torch.tensor([value], device=self.model.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def _idle_pass(self) -> None:
        """A forward of no tokens, beside the ep group's others' prefill or step."""
        empty = torch.zeros(0, dtype=torch.long, device=self.model.device)
        self.model(empty, TokenLayout.packed([]))

    def _routes_shape(self, rules: DecodeRules) -> tuple[int, int] | None:
        """``(L, k)`` of the experts a call records per token: its MoE layers, the experts
        each token goes to; None when it records none."""
        moe = self.model.spec.moe
        if not rules.routes or moe is None:
            return None
        return len(self.model.spec.moe_layers), moe.top_k

    def _bucket(self, n_rows: int) -> int:
        return row_bucket(n_rows, self._bucketed)

    @property
    def _bucketed(self) -> bool:
        return self.options.capture or self.options.compile

    def _n_keys(self, rows: list[_Row | None], max_new: int) -> int:
        """Key slots the next step's rows can see: the furthest position a row can have
        reached (its prompt plus the steps since its prefill, at most its last token's) + 1."""
        far = max(
            r.length + min(self.n_steps - r.started, max_new - 1) for r in rows if r is not None
        )
        assert self.cache is not None
        return key_bucket(far + 1, self.cache.capacity, self._bucketed)

    def _fill(self, rows: list[_Row | None], waiting: deque, call: _Call | None) -> None:
        """Prefill waiting prompts into free slots and choose their first tokens (with ep > 1:
        a pass of no tokens if another rank of the group prefills and this one has none)."""
        free = [i for i, r in enumerate(rows) if r is None]
        taken = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if not self._agree(len(taken)):
            return
        if not taken:
            self._idle_pass()
            return
        assert call is not None
        prompts, rules = call.prompts, call.rules
        slots, cache = self.slots, self.cache
        assert slots is not None and cache is not None
        where = free[: len(taken)]
        first: dict[tuple[int, ...], int] = {}  # a distinct prompt -> its place in the prefill
        source: list[int] = []  # per taken prompt: the place of its prefill
        heads: list[int] = []  # per prefill: its prompt
        head_slots: list[int] = []  # per prefill: its slot
        for p, s in zip(taken, where, strict=True):
            key = tuple(prompts[p]) if self.options.share_prompts else (p,)
            if key not in first:
                first[key] = len(heads)
                heads.append(p)
                head_slots.append(s)
            source.append(first[key])
        routes = self._routes_shape(rules)
        head_lengths = [len(prompts[p]) for p in heads]
        record = None
        if routes is not None:
            record = torch.zeros(
                sum(head_lengths), *routes, dtype=torch.int16, device=self.model.device
            )
        logits = self._prefill([prompts[p] for p in heads], head_slots, record)
        if record is not None:  # each prompt's experts, its repeats' too
            parts = self._whole_routes(record).split(head_lengths)
            for p, j in zip(taken, source, strict=True):
                call.routes[p] = parts[j]
        device = self.model.device
        repeats = [(s, head_slots[j]) for s, j in zip(where, source, strict=True)]
        repeats = [(s, h) for s, h in repeats if s != h]
        if repeats:
            dst, src = (torch.tensor(x, device=device) for x in zip(*repeats, strict=True))
            cache.copy_rows(dst, src, max(len(prompts[p]) for p in taken))
        idx = torch.tensor(where, device=device)
        lengths = torch.tensor([len(prompts[p]) for p in taken], device=device)
        draws = uniforms(call.seed, torch.tensor(taken, device=device), rules.max_new_tokens)
        slots.u[idx, : rules.max_new_tokens] = draws
        slots.steps[idx] = 0
        slots.live[idx] = True
        slots.positions[idx] = lengths
        k = rules.top_logprobs
        new = torch.zeros(len(taken), dtype=torch.long, device=device)
        lp = torch.zeros(len(taken), device=device)
        rows_k = (slice(len(taken)), slice(k))  # where a stage before the last receives top
        top: Top | None = (slots.chosen_top_ids[rows_k], slots.chosen_top_logprobs[rows_k])
        if logits is not None:
            per_slot = logits[torch.tensor(source, device=device)]
            new, lp, top = choose_with_top(per_slot, rules, slots.u[idx, 0], slots.steps[idx])
        new, lp = self.pipe.broadcast(new), self.pipe.broadcast(lp)
        # the prefill's choice is each row's step 0; ``advance`` over the taken slots only
        slots.out_tokens[idx, 0] = new
        slots.out_logprobs[idx, 0] = lp
        if k and top is not None:
            slots.out_top_ids[idx, 0, :k] = self.pipe.broadcast(top[0].contiguous())
            slots.out_top_logprobs[idx, 0, :k] = self.pipe.broadcast(top[1].contiguous())
        slots.tokens[idx] = new
        slots.steps[idx] = 1
        slots.live[idx] = (new != rules.eos) & (rules.max_new_tokens > 1)
        for s, p in zip(where, taken, strict=True):
            rows[s] = _Row(p, len(prompts[p]), self.n_steps)

    def _prefill(
        self, prompts: list[list[int]], cache_rows: list[int], record: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The prompts' forward into their cache rows; last-token logits on the last stage
        (``record``: their tokens' experts, written)."""
        device = self.model.device
        lengths = [len(p) for p in prompts]
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
        where = TokenLayout.packed(lengths, cache_rows=cache_rows)
        assert self.cache is not None
        routes = None if record is None else Routes(record=record)
        return self.pipe.step(ids, where, self.cache, last, routes)

    def _whole_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """Experts recorded on this stage (its layers' columns) joined with the other stages',
        on the host."""
        return self.pipe.sum_stages(routes.int()).to(torch.int16).cpu()

    def _collect(self, rows: list[_Row | None], b: int, call: _Call) -> None:
        """The one host sync per look: rows that ended hand their outputs over."""
        assert self.slots is not None
        live = self.slots.live[:b].tolist()
        ended = [i for i in range(b) if rows[i] is not None and not live[i]]
        if not ended:
            return
        idx = torch.tensor(ended, device=self.model.device)
        m = call.rules.max_new_tokens
        tokens = self.slots.out_tokens[idx, :m].tolist()
        logprobs = self.slots.out_logprobs[idx, :m].tolist()
        k = call.rules.top_logprobs
        top_ids = self.slots.out_top_ids[idx, :m, :k].tolist() if k else [[]] * len(ended)
        top_lps = self.slots.out_top_logprobs[idx, :m, :k].tolist() if k else [[]] * len(ended)
        out_routes = self.slots.out_routes
        routes = None if out_routes is None else self._whole_routes(out_routes[idx, :m])
        for j, (i, t, lp, ti, tl) in enumerate(
            zip(ended, tokens, logprobs, top_ids, top_lps, strict=True)
        ):
            row = rows[i]
            assert row is not None
            cut = call.results[row.prompt] = cut_row(t, lp, call.rules.eos)
            if k:
                call.tops[row.prompt] = (ti[: len(cut[0])], tl[: len(cut[0])])
            if routes is not None:  # the last token chosen was never fed
                answer = routes[j, : len(cut[0])].clone()
                answer[-1] = -1
                call.routes[row.prompt] = torch.cat([call.routes[row.prompt], answer])
            if call.feed is not None:
                call.feed.ended(row.prompt, *cut)
            rows[i] = None

    def _compact(self, rows: list[_Row | None]) -> None:
        """Move live rows from the top of the slots into free ones below, when that lets the
        step run over a smaller bucket."""
        used = [i for i, r in enumerate(rows) if r is not None]
        if not used or self._bucket(len(used)) >= self._bucket(used[-1] + 1):
            return
        target = len(used)
        movers = [i for i in used if i >= target]
        holes = [i for i in range(target) if rows[i] is None]
        assert self.slots is not None and self.cache is not None
        device = self.model.device
        dst, src = torch.tensor(holes, device=device), torch.tensor(movers, device=device)
        far = max(rows[i].length + self.n_steps - rows[i].started for i in movers)  # type: ignore[union-attr]
        self.cache.copy_rows(dst, src, min(far + 1, self.cache.capacity))
        self.slots.move(dst, src)
        self.slots.live[src] = False
        for d, s in zip(holes, movers, strict=True):
            rows[d], rows[s] = rows[s], None

    # one step ----------------------------------------------------------------------------

    def _step(self, rules: DecodeRules, b: int, n_keys: int) -> None:
        assert self.cache is not None and self.slots is not None
        args = (self.model, self.cache, self.slots, rules, b, n_keys)
        self.n_steps += 1
        pipe = self.pipe
        if pipe.groups.pp == 1:
            self._run(("step", b, n_keys, rules), lambda: self._decode(*args))
            return
        slots = self.slots
        assert slots is not None
        if pipe.prev is not None:
            slots.hidden_in[:b] = pipe.recv_hidden(b)
        self._run(("stage", b, n_keys, rules), lambda: self._stage(*args))
        if pipe.next is not None:
            pipe.send_hidden(slots.hidden_out[:b])
        slots.chosen[:b] = pipe.broadcast(slots.chosen[:b].contiguous())
        slots.chosen_logprobs[:b] = pipe.broadcast(slots.chosen_logprobs[:b].contiguous())
        if rules.top_logprobs:
            k = rules.top_logprobs
            for t in (slots.chosen_top_ids, slots.chosen_top_logprobs):
                t[:b, :k] = pipe.broadcast(t[:b, :k].contiguous())
        self._run(("advance", b, 0, rules), lambda: self._advance(slots, rules, b))

    def _run(self, key: tuple, fn: Callable[[], None]) -> None:
        """Run a part of the step: directly, or by replaying its graph (captured on first use)."""
        self.buckets.add(key[:3])
        if not self.options.capture:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(fn)
        graph.replay()

    def _capture(self, fn: Callable[[], None]) -> Any:
        """A CUDA graph of ``fn``, after one warm-up run on a side stream whose writes to the
        slots are undone (the cache's are rewritten identically by the replay). Off CUDA (the
        tests of this path on CPUs) the "graph" calls ``fn`` again at each replay."""
        assert self.slots is not None
        saved = [t.clone() for t in self.slots.mutable()]
        cuda = self.model.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            fn()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        for t, before in zip(self.slots.mutable(), saved, strict=True):
            t.copy_(before)
        if not cuda:
            return _Replay(fn)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph


# Compilations of a step function a process may keep: one per (model, sampling rules, bucket
# shape) until dynamo makes the shapes symbolic. Past dynamo's default of 8 a fullgraph compile
# fails outright (seen with three models in one process).
RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


@dataclass(frozen=True)
class _Replay:
    """What stands for a CUDA graph off CUDA: replaying calls the function again."""

    fn: Callable[[], None]

    def replay(self) -> None:
        self.fn()


def generate(
    pipe: Pipeline,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    seed: int = 0,
    options: DecodeOptions | None = None,
) -> GenerateOutput:
    """One response per prompt with a new engine (a generator keeps its engine instead); every
    rank of the pipeline returns the same output."""
    if not prompts:
        return GenerateOutput()
    check_prompts(prompts)
    rules = DecodeRules.of(cfg, eos_token_id, pad_token_id)
    return DecodeEngine(pipe, options).generate(prompts, rules, seed)
