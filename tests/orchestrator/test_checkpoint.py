"""Checkpoint folders: atomic commit, verification, fallback to the previous intact one."""

from __future__ import annotations

import json

import pytest

from nonstop.checkpoint import (
    CheckpointError,
    commit,
    latest_valid,
    list_checkpoints,
    staging_dir,
    verify,
    write_policy_version,
)
from nonstop.hf import load_model


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


def test_every_file_of_a_checkpoint_and_a_saved_model_has_one_mode(tiny_dir, tmp_path):
    """save_pretrained's model.safetensors comes out 0600 (safetensors writes a private temporary
    file and renames it) beside 0644 neighbours; the trainer's save (write_policy_version after
    save_pretrained) and the commit give every file the mode a plain write gets."""
    probe = tmp_path / "probe"
    probe.write_text("")
    plain = probe.stat().st_mode & 0o777
    model = load_model(str(tiny_dir))
    final = tmp_path / "final"  # a run's final/: saved the way the trainer saves
    model.save_pretrained(str(final))
    write_policy_version(final, 3)
    assert {p.name: p.stat().st_mode & 0o777 for p in final.iterdir()} == {p.name: plain for p in final.iterdir()}
    root = tmp_path / "checkpoints"
    tmp = staging_dir(root, 3)
    model.save_pretrained(str(tmp / "model"))  # its mode not yet shared: the commit shares it too
    (tmp / "trainer.pt").write_bytes(b"optimizer")
    ckpt = commit(root, tmp, 3, {"step": 3, "policy_version": 3}, keep=2)
    modes = {str(p.relative_to(ckpt.path)): p.stat().st_mode & 0o777 for p in ckpt.path.rglob("*") if p.is_file()}
    assert "model/model.safetensors" in modes and set(modes.values()) == {plain}, modes
    assert verify(ckpt) is None
