"""``rayhf serve`` (``rayhf.serve.cli``): a wrong checkpoint fails before Ray starts, and the
options reach ``serve_checkpoint`` (replaced here by a recorder)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import rayhf.serve.app
from rayhf.errors import RayhfError
from rayhf.serve.cli import app


@pytest.fixture
def served(monkeypatch) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        rayhf.serve.app, "serve_checkpoint", lambda ckpt, **kw: calls.append((ckpt, kw))
    )
    return calls


def test_a_wrong_checkpoint_is_an_error_before_anything_starts(tmp_path: Path, served):
    result = CliRunner().invoke(app, [str(tmp_path / "nope")])
    assert isinstance(result.exception, RayhfError) and "is not a directory" in str(
        result.exception
    )
    assert served == []


def test_the_options_reach_the_server(tmp_path: Path, served):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    args = [str(tmp_path), "--port", "8123", "--max-batch-size", "4", "--model-id", "policy"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output == f"serving {tmp_path} at http://127.0.0.1:8123/v1 (Ctrl-C stops)\n"
    ((checkpoint, options),) = served
    assert checkpoint == str(tmp_path)
    assert options["port"] == 8123 and options["max_batch_size"] == 4
    assert options["model_id"] == "policy" and options["engine"] == "native"
    assert options["default_max_tokens"] == 16 and options["num_cpus"] == 1.0
    assert options["adapters"] == {}


def test_adapters_are_name_equals_directory(tmp_path: Path, served):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    args = [str(tmp_path), "--adapter", "a=/x/a", "--adapter", "b=rel/b"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert served[0][1]["adapters"] == {"a": "/x/a", "b": str(Path("rel/b").resolve())}
    result = CliRunner().invoke(app, [str(tmp_path), "--adapter", "no-directory"])
    assert isinstance(result.exception, RayhfError)
    assert str(result.exception).startswith("--adapter no-directory: give NAME=DIR")


def test_vllm_checkpoints_are_left_to_ray_serve_llm(tmp_path: Path, served):
    result = CliRunner().invoke(app, ["org/model", "--engine", "vllm"])
    assert result.exit_code == 0, result.output
    assert served[0][0] == "org/model" and served[0][1]["engine"] == "vllm"
