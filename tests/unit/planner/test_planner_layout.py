"""Manual layouts from the config's ``plan:`` entries (``rayhf.planner.layout``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.errors import RayhfError
from rayhf.parallel.layout import Layout
from rayhf.planner.layout import LayoutSpec, layout_from_spec


def test_the_mesh_defaults_to_every_device_and_dp_to_what_is_left():
    assert layout_from_spec(LayoutSpec(), 4, "plan.x") == Layout((0, 1, 2, 3), 4)
    assert layout_from_spec(LayoutSpec(tp=2), 4, "plan.x") == Layout((0, 1, 2, 3), 2, 2)
    spec = LayoutSpec(mesh=[3, 1], pp=2, n_microbatches=4)
    assert layout_from_spec(spec, 4, "plan.x") == Layout((3, 1), 1, 1, 2, 4)
    assert layout_from_spec(LayoutSpec(cp=2), 4, "plan.x") == Layout((0, 1, 2, 3), 4, cp=2)


@pytest.mark.parametrize(
    "spec,message",
    [
        (LayoutSpec(mesh=[0, 4]), r"plan\.x\.mesh: \[0, 4\] must be distinct device .* 0\.\.3$"),
        (LayoutSpec(mesh=[1, 1]), r"plan\.x\.mesh: \[1, 1\] must be distinct"),
        (LayoutSpec(mesh=[]), r"plan\.x\.mesh: \[\] must be distinct"),
        (LayoutSpec(tp=3), r"plan\.x: dp\*tp\*pp = 1\*3\*1 != mesh size 4"),
        (LayoutSpec(dp=4, tp=2), r"plan\.x: dp\*tp\*pp = 4\*2\*1 != mesh size 4"),
        (LayoutSpec(tp=2, cp=4), r"plan\.x\.cp: 4 does not divide dp = 2$"),
        (LayoutSpec(ep=2, cp=2), r"plan\.x: ep and cp both split dp, .* set one to 1$"),
    ],
)  # fmt: skip
def test_a_layout_that_does_not_fit_the_devices_names_its_entry(spec, message):
    with pytest.raises(RayhfError, match=message):
        layout_from_spec(spec, 4, "plan.x")


def test_entries_are_checked_as_config():
    with pytest.raises(ValidationError):
        LayoutSpec(tp=0)
    with pytest.raises(ValidationError):
        LayoutSpec(tensor_parallel=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="n_mbs was renamed: write n_microbatches"):
        LayoutSpec.model_validate({"pp": 2, "n_mbs": 2})
