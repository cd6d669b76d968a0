"""pass@k on held-out prompts: the chance that at least one of k answers to a prompt is correct.

Each held-out prompt gets ``n`` answers (``eval_samples`` copies of the prompt, times a generate
call's own group), ``c`` of them correct (score at least ``eval_correct_at``); pass@k is
estimated without bias from all ``n`` (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, averaged over prompts. Drawing k of the n
answers once instead would be unbiased too, but noisier.
"""

from __future__ import annotations

from collections import defaultdict

from rayhf.data.batch import PackedBatch


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` answers of which ``c`` are correct."""
    assert 0 <= c <= n and 1 <= k <= n, f"need 0 <= c <= n and 1 <= k <= n (n={n} c={c} k={k})"
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n - c, k) / C(n, k) as a product: no huge binomials
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def reported_ks(n: int) -> list[int]:
    """The k reported for ``n`` answers per prompt: 1, the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def pass_at_k_metrics(batch: PackedBatch, copies: int, correct_at: float) -> dict[str, float]:
    """``pass@k`` for every reported k and ``task_reward`` (the mean score), from a held-out
    batch's ``scores``.

    A sample's prompt is its row: held-out row ``r``'s copy ``j`` has sample id ``r * copies +
    j``, and a generate call that samples a group gives each answer ``group_ids`` = that id.
    Returns nothing when the batch has no ``scores`` (the graph scores nothing).
    """
    if "scores" not in batch.tensors:
        return {}
    prompt_ids = (
        batch.tensors["group_ids"].tolist() if "group_ids" in batch.tensors else batch.sample_ids
    )
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # row -> [answers, correct]
    for pid, score in zip(prompt_ids, batch.tensors["scores"].tolist(), strict=True):
        counts[int(pid) // copies][0] += 1
        counts[int(pid) // copies][1] += int(score >= correct_at)
    n = min(total for total, _ in counts.values())
    out = {
        f"pass@{k}": sum(pass_at_k(total, c, k) for total, c in counts.values()) / len(counts)
        for k in reported_ks(n)
    }
    out["task_reward"] = batch.tensors["scores"].float().mean().item()
    return out
