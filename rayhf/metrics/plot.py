"""The end-of-run plot: task reward and KL against step."""

from __future__ import annotations

from pathlib import Path


def plot_run(rows: list[dict[str, float]], out: Path, title: str) -> Path | None:
    """Write a PNG with reward (left) and KL (right) per step; None if there is nothing to plot."""
    rows = [r for r in rows if "task_reward" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "task_reward", "task reward"), (axes[1], "kl", "KL to ref")):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
