"""Typed experiment config: YAML plus dotted overrides, unknown keys rejected."""

from rayhf.config.experiment import (
    ExperimentConfig,
    RoleConfig,
    dump_config,
    load_config,
)

__all__ = ["ExperimentConfig", "RoleConfig", "dump_config", "load_config"]
