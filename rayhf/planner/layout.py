"""Manual layouts: a config's ``plan.<call>`` entry and its check against the cluster."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayhf.errors import RayhfError
from rayhf.parallel.layout import Layout


class LayoutSpec(BaseModel):
    """A manual layout for one call in the config's ``plan:`` section."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    mesh: list[int] | None = None
    """Device indices; None = all devices."""
    dp: int | None = Field(None, gt=0)
    """None = whatever mesh size / (tp * pp) leaves."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree."""
    pp: int = Field(1, gt=0)
    """Pipeline stages."""
    n_microbatches: int = Field(1, gt=0)
    """Micro-batches per forward (pipeline depth, memory)"""
    ep: int = Field(1, gt=0)
    """Expert parallelism: groups of ep data-parallel ranks split a Mixture-of-Experts model's
    experts and send each other their tokens (ep must divide dp)."""
    cp: int = Field(1, gt=0)
    """Context parallelism: groups of cp data-parallel ranks take one share of the batch and
    split each of its sequences, attention exchanging heads for tokens (cp must divide dp; an
    inference or train call's, not with ep)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "n_mbs" in data:
            raise ValueError("n_mbs was renamed: write n_microbatches")
        return data


def layout_from_spec(spec: LayoutSpec, n_devices: int, where: str) -> Layout:
    """Turn a config ``LayoutSpec`` into a ``Layout``; errors name ``where`` (``plan.<call>``)."""
    mesh = tuple(spec.mesh) if spec.mesh is not None else tuple(range(n_devices))
    bad = [d for d in mesh if not 0 <= d < n_devices]
    if bad or not mesh or len(set(mesh)) != len(mesh):
        raise RayhfError(
            f"{where}.mesh: {list(mesh)} must be distinct device indices in 0..{n_devices - 1}"
        )
    dp = spec.dp or len(mesh) // (spec.tp * spec.pp)
    if dp * spec.tp * spec.pp != len(mesh):
        raise RayhfError(f"{where}: dp*tp*pp = {dp}*{spec.tp}*{spec.pp} != mesh size {len(mesh)}")
    if dp % spec.ep:
        raise RayhfError(f"{where}.ep: {spec.ep} does not divide dp = {dp}")
    if dp % spec.cp:
        raise RayhfError(f"{where}.cp: {spec.cp} does not divide dp = {dp}")
    if spec.ep > 1 and spec.cp > 1:
        raise RayhfError(f"{where}: ep and cp both split dp, and rayhf splits by one; set one to 1")
    return Layout(mesh, dp, spec.tp, spec.pp, spec.n_microbatches, spec.ep, spec.cp)
