"""Role groups on Ray, the driver that runs the graph, checkpoints."""

from rayhf.envs import agent  # noqa: F401  (registers the multi-turn interface, grpo_agent)
