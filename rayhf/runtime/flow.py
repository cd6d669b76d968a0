"""How a step's batch flows between calls (pure functions the workers and the driver share).

    dataset rows (the step input)
      + each source call's outputs, joined over its data-parallel replicas, in graph order
      -> the keys a call reads, under its interface's names
      -> this replica's token-balanced share

A call whose outputs are new samples (a generate call that samples several answers per prompt)
starts a new batch: keys made before it do not carry over to the calls that read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rayhf.data.batch import PackedBatch
from rayhf.parallel.pipeline import split_rows


def balance_key(batch: PackedBatch, preferred: Sequence[str]) -> str | None:
    """The key whose token counts balance a data-parallel split: the first of ``preferred``
    (the call's interface names them) in the batch, else its first key."""
    for key in preferred:
        if key in batch.tensors:
            return key
    return batch.keys()[0] if batch.tensors else None


def join_replicas(parts: list[PackedBatch], order: list[int]) -> PackedBatch | None:
    """One call's outputs over its replicas, in ``order`` when they are the same samples (else,
    new samples, in replica order); None when no replica had samples."""
    parts = [p for p in parts if p.n_samples]
    if not parts:
        return None
    joined = PackedBatch.concat(parts)
    if sorted(joined.sample_ids) == sorted(order):
        joined = joined.reorder(order)
    return joined


def assemble(base: PackedBatch, outputs: list[tuple[str, list[PackedBatch]]]) -> PackedBatch:
    """``base`` with each call's outputs (call name, one batch per replica, keys under graph
    names) added in the given order."""
    batch = PackedBatch(
        list(base.sample_ids), dict(base.tensors), dict(base.seqlens), dict(base.extras)
    )
    for _, parts in outputs:
        joined = join_replicas(parts, batch.sample_ids)
        if joined is None:
            continue
        if joined.sample_ids != batch.sample_ids:
            batch = PackedBatch(list(joined.sample_ids))  # new samples: a new batch
        batch.update(joined)
    return batch


def call_inputs(batch: PackedBatch, inputs: Mapping[str, str], call: str) -> PackedBatch:
    """The keys a call reads (``inputs``: interface name -> graph key), under interface names,
    and every extra (a reward reads the row's ground truth; a generate call passes it on)."""
    view = PackedBatch(list(batch.sample_ids), extras=dict(batch.extras))
    for iface_key, graph_key in inputs.items():
        if graph_key not in batch.tensors:
            raise RuntimeError(
                f"call '{call}' reads '{graph_key}', which is not in the batch: keys made "
                f"before a call that created new samples do not carry over"
            )
        view.add(iface_key, batch.tensors[graph_key], batch.seqlens[graph_key])
    return view


def rename_outputs(out: PackedBatch, outputs: Mapping[str, str], call: str) -> PackedBatch:
    """A call's outputs under the graph's key names (``outputs``: interface -> graph key); its
    extras as they are."""
    renamed = PackedBatch(list(out.sample_ids), extras=dict(out.extras))
    for iface_key, graph_key in outputs.items():
        if iface_key not in out.tensors:
            raise RuntimeError(f"call '{call}' did not produce '{iface_key}'")
        renamed.add(graph_key, out.tensors[iface_key], out.seqlens[iface_key])
    return renamed


def share_balance(
    batch: PackedBatch, n_shares: int, balance_keys: Sequence[str]
) -> dict[str, float]:
    """The largest share's tokens over the mean share's (1.0: even): ``tokens`` for the
    token-balanced split ``replica_share`` takes, ``by_rows`` for equal counts of consecutive
    rows (what a split by rows would give); empty with one share or no tokens."""
    key = balance_key(batch, balance_keys)
    if n_shares == 1 or key is None or not sum(batch.seqlens[key]):
        return {}
    lengths = batch.seqlens[key]
    mean = sum(lengths) / n_shares
    balanced = [p.n_tokens(key) for p in batch.split(n_shares, by_key=key)]
    by_rows = [sum(lengths[r.start : r.stop]) for r in split_rows(len(lengths), n_shares, True)]
    return {"tokens": max(balanced) / mean, "by_rows": max(by_rows) / mean}


def replica_share(
    batch: PackedBatch, dp_size: int, dp_rank: int, balance_keys: Sequence[str]
) -> PackedBatch:
    """The token-balanced share of data-parallel replica ``dp_rank`` (every rank computes the
    same split, so each takes its own without a coordinator)."""
    return batch.split(dp_size, by_key=balance_key(batch, balance_keys))[dp_rank]
