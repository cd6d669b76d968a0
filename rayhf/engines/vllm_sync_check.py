"""Checking a weight sync into vLLM: after the reload, vLLM holds exactly what the rank sent.

    rank's Hugging Face tensors ------------------------------------> sent, kept for the compare
      [vLLM's worker] reload; then per vLLM parameter: the sent tensors it is made of (q/k/v
      fused into ``qkv_proj``, ...), the dtype it holds them in, its checksum over the rows
      they fill (vLLM pads the vocabulary)                          -> ``HeldWeights``
    per vLLM parameter: checksum of what vLLM holds == sum of its parts' checksums, cast to
      vLLM's dtype; a parameter no tensor reached or a tensor that reached none is an error too

The checksum is the sum of the values' bit patterns read as integers of the values' width,
wrapping at 2**32 (2**64 for 8-byte values). It is exact (any single changed value changes it),
blind to order and layout (a transposed or fused copy sums the same) and additive, so a fused
parameter's checksum is the sum of its parts'. fp32 bit patterns summed in int32 run at memory
speed; widening them to int64 inside the sum cost 13x more (docs/decisions/). 16-bit values do
widen, to int32: a sum wrapping at 2**16 would miss too many multi-value changes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from math import prod
from typing import Any, TypeVar

import torch

from rayhf.errors import RayhfError

T = TypeVar("T")
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def modulus(dtype: torch.dtype) -> int:
    """Where checksums of ``dtype`` values wrap: 2**32, or 2**64 for 8-byte values (whose high
    bits a 32-bit sum would drop)."""
    return 2**64 if dtype.itemsize == 8 else 2**32


def checksum(t: torch.Tensor) -> int:
    """The sum of ``t``'s values' bit patterns as integers, modulo ``modulus(t.dtype)``."""
    bits = (t if t.is_contiguous() else t.contiguous()).view(_INT_OF_SIZE[t.element_size()])
    acc = torch.int64 if t.element_size() == 8 else torch.int32  # int32 wraps in place
    return int(bits.sum(dtype=acc).item()) % modulus(t.dtype)


Rename = Callable[[str], str | None]  # a sent name -> vLLM's (None: vLLM drops the tensor)


@dataclass(frozen=True)
class Group:
    """A vLLM parameter and the sent tensors it is made of (vLLM's decision, made plain)."""

    name: str  # vLLM's parameter
    parts: tuple[str, ...]  # the sent tensors it holds (several when fused), in sent order
    rows: int | None = None  # compare its leading rows only (a padded vocabulary); None: all
    problem: str = ""  # why it cannot hold what was sent, e.g. "gets no tensor from the sync"


@dataclass(frozen=True)
class Matching:
    """Every vLLM parameter's group, and the sent tensors that no parameter takes."""

    groups: tuple[Group, ...]
    unused: tuple[str, ...]


def match(
    held: Mapping[str, Sequence[int]],
    packed: Mapping[str, Sequence[str]],
    sent: Mapping[str, Sequence[int]],
    rename: Rename | None = None,
) -> Matching:
    """Which ``sent`` tensors (name -> shape) each of vLLM's parameters (``held``: name ->
    shape) is made of; ``packed`` and ``rename``: as ``targets``."""
    parts, unused = targets(held, packed, sent, rename)
    groups = tuple(group_of(name, shape, parts.get(name, ()), sent) for name, shape in held.items())
    return Matching(groups, unused)


def targets(
    held: Collection[str],
    packed: Mapping[str, Sequence[str]],
    sent: Collection[str],
    rename: Rename | None = None,
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """vLLM parameter -> the ``sent`` tensors loaded into it, and the sent tensors that reach no
    parameter of ``held``. A sent name goes to the parameter of its own name, after ``rename``
    (the vLLM model's ``hf_to_vllm_mapper``), or else to the fused parameter that ``packed``
    (its ``packed_modules_mapping``, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``)
    puts it in."""
    parts: dict[str, list[str]] = {}
    unused = []
    for name in sent:
        target = rename(name) if rename is not None else name
        if target is None:  # vLLM drops it on purpose (e.g. a buffer saved as a weight)
            continue
        target = target if target in held else _fused(target, packed, held)
        if target is None:
            unused.append(name)
        else:
            parts.setdefault(target, []).append(name)
    return {k: tuple(v) for k, v in parts.items()}, tuple(unused)


def _fused(name: str, packed: Mapping[str, Sequence[str]], held: Collection[str]) -> str | None:
    for fused, components in packed.items():
        for c in components:
            candidate = name.replace(f".{c}.", f".{fused}.", 1)
            if candidate != name and candidate in held:
                return candidate
    return None


def group_of(
    name: str, shape: Sequence[int], parts: tuple[str, ...], sent: Mapping[str, Sequence[int]]
) -> Group:
    """vLLM's parameter ``name`` of ``shape`` made of the sent tensors ``parts`` (``sent``: name
    -> shape): which of its rows they fill, or why they cannot."""
    if not parts:
        return Group(name, (), problem="gets no tensor from the sync")
    n_sent, n_held = sum(prod(sent[p]) for p in parts), prod(shape)
    if n_sent == n_held:
        return Group(name, parts)
    row = prod(shape[1:])
    # vLLM pads a vocabulary with whole rows at the end; a fused parameter is never padded
    if n_sent > n_held or n_sent % row or len(parts) > 1:
        return Group(name, parts, problem=f"holds {n_held} values where {n_sent} were sent")
    return Group(name, parts, rows=n_sent // row)


@dataclass(frozen=True)
class Held:
    """One vLLM parameter after the sync: its group, the dtype it holds the sent tensors in and
    its checksum over the rows they fill (None when its group has a problem)."""

    group: Group
    dtype: torch.dtype
    checksum: int | None


@dataclass(frozen=True)
class HeldWeights:
    """What vLLM holds after a sync, as its worker reports it (``held_after``)."""

    model: str  # vLLM's model class
    params: tuple[Held, ...]
    unused: tuple[str, ...]  # sent tensors no vLLM parameter takes: vLLM did not load them


def held_after(
    model: torch.nn.Module,
    reload: Callable[[], None],
    sent: Mapping[str, Sequence[int]],
    skip: Collection[str],
) -> HeldWeights:
    """Run ``reload`` and report what ``model`` (vLLM's) holds of the ``sent`` tensors (name ->
    shape) afterwards; ``skip``: sent tensors vLLM need not hold (a head tied to the embedding).
    Runs inside vLLM's worker."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    rename = getattr(mapper, "map_name", None)
    names = [_plain(name) for name, _ in model.named_parameters()]
    parts, unused = targets(names, packed, sent, rename)

    def held(name: str, p: torch.Tensor) -> Held:
        name = _plain(name)
        group = group_of(name, p.shape, parts.get(name, ()), sent)
        if group.problem:
            return Held(group, p.dtype, None)
        return Held(group, p.dtype, checksum(p[: group.rows] if group.rows else p))

    def reading(name: str, p: torch.Tensor) -> Callable[[], Held]:
        """Start ``held(name, p)`` on the checksum thread; the call gives its result."""
        pending = checksum_thread().submit(held, name, p)
        return pending.result

    with _on_repacking(model, reading) as repacked:
        reload()
    params = []
    for name, p in model.named_parameters():
        if p.numel() > 0:
            params.append(held(name, p))
        elif name in repacked:  # what was loaded is what its kernel holds
            params.append(repacked[name]())
        else:  # emptied by an earlier load and not loaded again by this one
            params.append(Held(_unloaded(_plain(name), parts.get(_plain(name), ())), p.dtype, None))
    unused = tuple(n for n in unused if n not in skip)
    return HeldWeights(type(model).__name__, tuple(params), unused)


def _plain(name: str) -> str:
    """vLLM's parameter ``name`` without the wrapper a LoRA layer puts around its layer."""
    return name.replace(".base_layer.", ".")


def _unloaded(name: str, parts: tuple[str, ...]) -> Group:
    problem = "was not loaded by the sync" if parts else "gets no tensor from the sync"
    return Group(name, parts, problem=problem)


@contextmanager
def _on_repacking(
    model: torch.nn.Module, read: Callable[[str, torch.Tensor], T]
) -> Iterator[dict[str, T]]:
    """Give ``read(name, loaded)`` of each parameter that vLLM's processing of a freshly loaded
    layer leaves empty, by name: vLLM's CPU GEMMs repack linear weights into their own format
    and drop the parameter. ``read`` is called on each of the layer's parameters just before
    the processing (which reads them too, so a thread reading beside it finds them in cache);
    a parameter that keeps its values drops its reading and is read after the reload, once:
    what vLLM's kernels use is what it holds then."""
    names = {layer: prefix for prefix, layer in model.named_modules()}
    repacked: dict[str, T] = {}
    restore: dict[int, tuple[Any, Any]] = {}  # id -> a layer's quant_method, its own attribute
    for layer in names:
        method: Any = getattr(layer, "quant_method", None)
        original = getattr(method, "process_weights_after_loading", None)
        if original is None or id(method) in restore:  # layers may share one
            continue

        def hook(module: torch.nn.Module, *args: Any, _original: Any = original, **kw: Any) -> Any:
            prefix = names.get(module, "")
            loaded = {
                f"{prefix}.{pname}" if prefix else pname: (pname, p)
                for pname, p in module.named_parameters(recurse=False)
                if p.numel() > 0
            }
            reads = {name: read(name, p) for name, (_, p) in loaded.items()}
            out = _original(module, *args, **kw)
            for name, (pname, _) in loaded.items():
                now = getattr(module, pname, None)
                if now is None or now.numel() == 0:
                    repacked[name] = reads[name]
            return out

        restore[id(method)] = (method, vars(method).get("process_weights_after_loading"))
        method.process_weights_after_loading = hook
    try:
        yield repacked
    finally:
        for method, own in restore.values():
            if own is None:
                del method.process_weights_after_loading  # the class's method again
            else:
                method.process_weights_after_loading = own


@cache
def checksum_thread() -> ThreadPoolExecutor:
    """The process's one thread for checksums, beside the thread that loads vLLM (the rank's
    sums and vLLM's share it: a third thread on two cores cost more than it hid)."""
    return ThreadPoolExecutor(1, thread_name_prefix="rayhf-checksum")


SentSums = dict[tuple[str, torch.dtype], int]  # (sent tensor, vLLM's dtype) -> its checksum


def sent_checksums(sent: Mapping[str, torch.Tensor], dtype: torch.dtype) -> SentSums:
    """Each ``sent`` tensor's checksum as vLLM holds it in ``dtype`` (a thread can compute them
    while vLLM loads)."""
    return {(n, dtype): checksum(t if t.dtype == dtype else t.to(dtype)) for n, t in sent.items()}


def verify(
    held: HeldWeights,
    sent: Mapping[str, torch.Tensor],
    skip_hint: str,
    sums: SentSums | None = None,
) -> None:
    """Raise a one-line ``RayhfError`` naming the first vLLM parameter that does not hold what
    was ``sent`` (or a sent tensor vLLM did not take); ``skip_hint`` ends it. ``sums``: the
    sent tensors' checksums, where already computed."""
    sums = dict(sums or {})

    def sent_sum(name: str, dtype: torch.dtype) -> int:
        if (name, dtype) not in sums:  # vLLM keeps this parameter in another dtype
            sums[name, dtype] = checksum(sent[name].to(dtype))
        return sums[name, dtype]

    problems = []
    for h in held.params:
        g = h.group
        source = f" (from {', '.join(g.parts)})" if g.parts not in ((), (g.name,)) else ""
        if g.problem:
            problems.append(f"{g.name}{source} {g.problem}")
            continue
        want = sum(sent_sum(p, h.dtype) for p in g.parts) % modulus(h.dtype)
        if want != h.checksum:
            problems.append(
                f"{g.name}{source} differs from the rank's weights after the sync "
                f"(checksum {h.checksum} != {want} sent)"
            )
    problems += [f"{n} is sent but no parameter of {held.model} takes it" for n in held.unused]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RayhfError(f"vLLM weight sync: {problems[0]}{more}; {skip_hint}")
