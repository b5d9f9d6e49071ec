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
from nonstop.orchestrator.recovery import ROLLED_BACK, set_aside_rolled_back


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


def test_a_resume_sets_the_rolled_back_steps_aside_and_loses_no_line(tmp_path):
    """Resumed from step 4 of a session that reached step 6 (and was cut mid-line): metrics.jsonl
    keeps steps 1-4, the side file gets 5, 6 and the cut line as they were; a second fallback, to
    step 2, appends 3 and 4."""
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in range(1, 7)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(lines) + '\n{"step": 7, "rew')
    assert set_aside_rolled_back(tmp_path, 4) == 3
    assert metrics.read_text().splitlines() == lines[:4]
    assert (tmp_path / ROLLED_BACK).read_text().splitlines() == [*lines[4:], '{"step": 7, "rew']
    assert set_aside_rolled_back(tmp_path, 4) == 0  # nothing after step 4 now
    assert set_aside_rolled_back(tmp_path, 2) == 2
    assert metrics.read_text().splitlines() == lines[:2]
    assert (tmp_path / ROLLED_BACK).read_text().splitlines() == [*lines[4:], '{"step": 7, "rew', *lines[2:4]]
    assert set_aside_rolled_back(tmp_path / "no-run", 2) == 0
