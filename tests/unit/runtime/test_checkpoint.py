import hashlib
import json

import pytest

from rayhf.runtime.checkpoint import (
    MANIFEST_FILE,
    damage,
    latest_checkpoint,
    list_checkpoints,
    usable_checkpoint,
    write_checkpoint,
)


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


def test_the_manifest_holds_every_file_s_size_and_checksum(tmp_path):
    ckpt = write_checkpoint(tmp_path, 1, _fill_ok, {"dataset": {}})
    files = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["actor/w.bin", "state.json"]
    assert files["actor/w.bin"] == {"size": 10, "sha256": hashlib.sha256(b"x" * 10).hexdigest()}
    assert damage(ckpt) is None


@pytest.mark.parametrize(
    "harm, problem",
    [
        (lambda p: p.write_bytes(b"x" * 4), "actor/w.bin has 4 bytes, the manifest says 10"),
        (lambda p: p.write_bytes(b"y" * 10), "actor/w.bin does not match its checksum"),
        (lambda p: p.unlink(), "actor/w.bin is missing"),
    ],
)
def test_a_damaged_checkpoint_is_skipped_in_one_line_for_the_previous_one(tmp_path, harm, problem):
    write_checkpoint(tmp_path, 1, _fill_ok, {})
    newest = write_checkpoint(tmp_path, 2, _fill_ok, {})
    harm(newest / "actor" / "w.bin")
    said: list[str] = []
    assert usable_checkpoint(tmp_path, said.append) == tmp_path / "checkpoints" / "step_000001"
    assert said == [f"checkpoint step_000002 is damaged ({problem}); using step_000001"]
    harm(tmp_path / "checkpoints" / "step_000001" / "actor" / "w.bin")
    said.clear()
    assert usable_checkpoint(tmp_path, said.append) is None
    assert said[-1].endswith("; no earlier checkpoint: starting over")


def test_a_checkpoint_without_a_manifest_is_trusted(tmp_path):
    ckpt = write_checkpoint(tmp_path, 3, _fill_ok, {})
    (ckpt / MANIFEST_FILE).unlink()  # written before manifests existed
    assert usable_checkpoint(tmp_path, print) == ckpt
