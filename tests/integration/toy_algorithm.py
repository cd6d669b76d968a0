"""A toy algorithm added by the checklist (``docs``: "Where to add an algorithm"), for
``test_algorithm_graphs``: GRPO's config and actor under the name ``toygrpo``.

Its module holds the config (``name`` selects it), the interface (``name`` is what graphs call
it) and the registration row, ``ALGORITHM``; the test adds the row to the registry and writes
the graph. The test sends this module to Ray's workers by value (they cannot import it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig
from rayhf.algorithms.interface import Algorithm


class ToyGRPOConfig(GRPOConfig):
    """GRPO's hyper-parameters, under another name."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["toygrpo"] = "toygrpo"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""


class ToyGRPOActorInterface(GRPOActorInterface):
    """GRPO's actor, for ``toygrpo``."""

    name = "toygrpo_actor"
    config_type = ToyGRPOConfig


ALGORITHM = Algorithm(ToyGRPOConfig, (ToyGRPOActorInterface,))
