import os
import random

import pytest
import torch

from nemo_dapo.core import checkpoint as ck


def test_save_load_roundtrip_and_keep_last(tmp_path):
    d = str(tmp_path / "ckpt")
    for step in (2, 4, 6, 8):
        ck.save_checkpoint(d, step, {"step": step, "w": torch.full((3,), float(step))}, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(d)] == [6, 8]
    assert ck.latest_checkpoint(d).endswith("step_00000008.pt")
    state = ck.load_checkpoint(ck.latest_checkpoint(d))
    assert state["step"] == 8 and torch.equal(state["w"], torch.full((3,), 8.0))
    assert sorted(os.listdir(d)) == ["step_00000006.pt", "step_00000008.pt"]  # no temporary files left


def test_a_failed_write_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    d = str(tmp_path)
    ck.save_checkpoint(d, 1, {"ok": 1}, keep_last=1)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(d, 2, {"ok": 2}, keep_last=1)
    assert os.listdir(d) == ["step_00000001.pt"]
    assert ck.load_checkpoint(ck.latest_checkpoint(d)) == {"ok": 1}


def test_stray_temporary_files_are_ignored_and_cleaned(tmp_path):
    d = str(tmp_path)
    open(os.path.join(d, ".tmp_step_abc.pt"), "wb").write(b"half a checkpoint")
    assert ck.latest_checkpoint(d) is None
    ck.save_checkpoint(d, 3, {"x": 3})
    assert os.listdir(d) == ["step_00000003.pt"]


def test_rng_state_roundtrip():
    state = ck.rng_state()
    a = (torch.rand(3), random.random())
    torch.rand(5), random.random()
    ck.set_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load_checkpoint(str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="keep_last"):
        ck.save_checkpoint(str(tmp_path), 1, {}, keep_last=0)
    assert ck.list_checkpoints(str(tmp_path / "nowhere")) == []
