import json

import pytest

from rayhf.runtime.checkpoint import latest_checkpoint, list_checkpoints, write_checkpoint


def _fill_ok(tmp):
    (tmp / "actor").mkdir()
    (tmp / "actor" / "w.bin").write_bytes(b"x" * 10)


def test_checkpoints_are_renamed_only_when_whole(tmp_path):
    write_checkpoint(tmp_path, 2, _fill_ok, {"dataset": {"epoch": 0}})

    def fill_dies(tmp):
        _fill_ok(tmp)
        raise KeyboardInterrupt  # killed in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 4, fill_dies, {})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and json.loads((latest / "state.json").read_text())["step"] == 2
    # the next save of the same step replaces the leftover temporary directory
    write_checkpoint(tmp_path, 4, _fill_ok, {})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_directory_without_state_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "step_000009").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) is None
