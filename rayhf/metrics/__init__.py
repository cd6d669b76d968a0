"""Step metrics: console, JSONL, progress bar, Ray metrics, experiment trackers (TensorBoard,
wandb, MLflow), and the end-of-run plot."""

from rayhf.metrics.plot import plot_run
from rayhf.metrics.tracker import MetricsConfig, Tracker, make_tracker, read_metrics

__all__ = ["MetricsConfig", "Tracker", "make_tracker", "plot_run", "read_metrics"]
