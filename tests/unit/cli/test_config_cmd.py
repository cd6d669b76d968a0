"""``rayhf config show`` and ``rayhf config schema``: the resolved config a run would use, and
a JSON schema every example config validates against. Nothing here starts Ray."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

import rayhf
from rayhf.cli.main import app
from rayhf.errors import RayhfError

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.yaml") if "plans" not in p.parts)


def test_show_prints_the_config_a_run_would_use_with_every_default():
    result = CliRunner().invoke(app, ["config", "show", str(EXAMPLE), "steps=3", "seed=9"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["steps"] == 3 and shown["seed"] == 9
    assert shown["generation"]["top_p"] == 1.0, "a default the file does not set"
    want = rayhf.load_config(EXAMPLE, ["steps=3", "seed=9"])
    assert rayhf.config.experiment.validate_config(shown, "shown") == want  # a round trip


def test_show_refuses_a_bad_override_in_one_line():
    result = CliRunner().invoke(app, ["config", "show", str(EXAMPLE), "stepz=3"])
    assert isinstance(result.exception, RayhfError)
    assert "config field stepz: unknown key" in str(result.exception)
    assert "\n" not in str(result.exception)


def test_the_schema_is_written_and_every_example_config_validates_against_it(tmp_path):
    out = tmp_path / "schema" / "rayhf.json"
    result = CliRunner().invoke(app, ["config", "schema", "--out", str(out)])
    assert result.exit_code == 0, result.output
    schema = json.loads(out.read_text())
    assert json.loads(CliRunner().invoke(app, ["config", "schema"]).output) == schema
    assert len(EXAMPLES) >= 8
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and "graph" in doc:
            jsonschema.validate(doc, schema)
    with pytest.raises(jsonschema.ValidationError, match="stepz"):
        jsonschema.validate({**yaml.safe_load(EXAMPLE.read_text()), "stepz": 3}, schema)
