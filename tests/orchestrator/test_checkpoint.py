"""Checkpoint folders: atomic commit, verification, fallback to the previous intact one."""

from __future__ import annotations

import json

import pytest

from nonstop.checkpoint import CheckpointError, commit, latest_valid, list_checkpoints, staging_dir, verify


def _write(root, step, keep=3, payload=b"weights"):
    tmp = staging_dir(root, step)
    (tmp / "model").mkdir()
    (tmp / "model" / "model.safetensors").write_bytes(payload * 100)
    (tmp / "trainer.pt").write_bytes(b"optimizer")
    return commit(root, tmp, step, {"step": step, "policy_version": step}, keep)


def test_commit_is_complete_verified_and_keeps_the_newest(tmp_path):
    for step in (2, 4, 6, 8):
        ckpt = _write(tmp_path, step)
    assert [c.step for c in list_checkpoints(tmp_path)] == [4, 6, 8]
    assert verify(ckpt) is None
    assert ckpt.state == {"step": 8, "policy_version": 8}
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model/model.safetensors", "trainer.pt", "state.json"}
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_a_staging_folder_left_by_a_crash_is_never_a_checkpoint(tmp_path):
    _write(tmp_path, 2)
    tmp = staging_dir(tmp_path, 4)  # the writer died before commit
    (tmp / "trainer.pt").write_bytes(b"half")
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    assert latest_valid(tmp_path).step == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "no_manifest"])
def test_a_corrupted_checkpoint_is_reported_and_the_previous_one_used(tmp_path, damage):
    _write(tmp_path, 2)
    newest = _write(tmp_path, 4)
    weights = newest.path / "model" / "model.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[10] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "delete":
        weights.unlink()
    else:
        (newest.path / "manifest.json").unlink()
    reports = []
    assert latest_valid(tmp_path, report=reports.append).step == 2
    assert len(reports) == 1 and "step_00000004" in reports[0] and "corrupted" in reports[0]


def test_no_usable_checkpoint_is_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="none written yet"):
        latest_valid(tmp_path)
    ckpt = _write(tmp_path, 2)
    (ckpt.path / "trainer.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"step_00000002: trainer.pt has 1 bytes"):
        latest_valid(tmp_path, report=lambda m: None)
