"""The end-of-run plot: a PNG when there are rewards to plot, nothing otherwise."""

from __future__ import annotations

from rayhf.metrics.plot import plot_run


def test_writes_a_png_of_the_reward_rows(tmp_path):
    rows = [{"step": 0, "task_reward": 0.1}, {"step": 1, "seconds/gen": 2.0},
            {"step": 2, "task_reward": 0.4, "kl": 0.01}]  # fmt: skip
    out = tmp_path / "run.png"
    assert plot_run(rows, out, "ppo_tiny") == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.png"]  # no temporary file left
    first = out.read_bytes()
    assert plot_run(rows, out, "another title") == out
    assert out.read_bytes() != first  # replaced


def test_nothing_to_plot_writes_nothing(tmp_path):
    out = tmp_path / "run.png"
    assert plot_run([], out, "t") is None
    assert plot_run([{"step": 1, "kl": 0.1}], out, "t") is None
    assert not out.exists()
