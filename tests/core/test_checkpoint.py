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


class _Planted:
    """What a crafted checkpoint would hold: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    from nemo_dapo.core.checkpoint import CheckpointError, checkpoint_path, load_checkpoint

    marker = tmp_path / "pwned"
    path = checkpoint_path(str(tmp_path), 3)
    torch.save({"loop": _Planted(marker)}, path)
    with pytest.raises(CheckpointError, match=r"step_00000003\.pt.*references posix\.system.* not loaded "
                                              r"\(nothing in it was run\)"):
        load_checkpoint(path)
    assert not marker.exists()


def test_safe_load_keeps_the_loop_state_exact(tmp_path):
    from nemo_dapo.core.checkpoint import load_checkpoint, rng_state, save_checkpoint
    from nemo_dapo.core.types import RolloutBatch

    batch = RolloutBatch(prompt_ids=torch.tensor([[0, 5]]), prompt_mask=torch.tensor([[0, 1]]),
                         response_ids=torch.tensor([[7, 2]]), response_mask=torch.ones(1, 2),
                         group_ids=torch.tensor([4]), truncated=torch.tensor([False]), pad_id=0)
    state = {"filler": {"groups": [{"uid": 4, "payload": batch, "age": 1}]}, "rng": rng_state(), "x": (1, 2.5, "a")}
    got = load_checkpoint(save_checkpoint(str(tmp_path), 1, state))
    assert got["rng"]["python"] == state["rng"]["python"] and torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    payload = got["filler"]["groups"][0]["payload"]
    assert isinstance(payload, RolloutBatch) and torch.equal(payload.response_ids, batch.response_ids)
    assert got["x"] == (1, 2.5, "a")


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_damaged_file_is_a_corrupt_checkpoint_naming_it(tmp_path, damage):
    d = str(tmp_path)
    path = ck.save_checkpoint(d, 4, {"w": torch.zeros(1000)})
    data = open(path, "rb").read()
    open(path, "wb").write({"empty": b"", "truncated": data[:len(data) // 2], "garbage": b"not a checkpoint" * 9}[
        damage])
    with pytest.raises(ck.CorruptCheckpoint, match=r"step_00000004\.pt.* (truncated or corrupt|is corrupt)"):
        ck.load_checkpoint(path)


def test_a_failed_write_names_the_checkpoint_it_was_writing(tmp_path, monkeypatch):
    import errno

    def full_disk(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")  # write() errors carry no file name

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(OSError) as info:
        ck.save_checkpoint(str(tmp_path), 7, {"x": 1})
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("step_00000007.pt")
    assert os.listdir(tmp_path) == []


# ---- atomic_directory: one writer of whole directories (saved models, the warm-up cache) ---------------------------
def _tree(d):
    return {os.path.relpath(os.path.join(here, n), d): open(os.path.join(here, n)).read()
            for here, _, names in os.walk(d) for n in names}


def _write(d, files):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, name)) or d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)


OLD, NEW = {"config.json": "old", "sub/w.bin": "old weights"}, {"config.json": "new", "tok.json": "new tok"}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "set-aside"])
def test_atomic_directory_keeps_the_old_content_whole_until_the_swap(tmp_path, monkeypatch, exchange):
    real, seen = ck._exchange, []
    # renameat2 RENAME_EXCHANGE swaps in one step; without it (another system) the old content is set aside
    monkeypatch.setattr(ck, "_exchange", lambda a, b: seen.append(real(a, b) if exchange else False) or seen[-1])
    d = str(tmp_path / "model")
    with ck.atomic_directory(d) as tmp:  # first write: nothing to keep
        _write(tmp, OLD)
    assert _tree(d) == OLD
    with ck.atomic_directory(d) as tmp:
        _write(tmp, NEW)
        assert _tree(d) == OLD  # the new content is complete, the old one still whole at its name
    assert _tree(d) == NEW and sorted(os.listdir(tmp_path)) == ["model"]  # the old content and tmp are gone
    assert seen == [exchange]


def test_atomic_directory_a_failed_writer_changes_nothing(tmp_path):
    d = str(tmp_path / "model")
    with ck.atomic_directory(d) as tmp:
        _write(tmp, OLD)
    with pytest.raises(OSError, match="disk full"):
        with ck.atomic_directory(d) as tmp:
            _write(tmp, {"config.json": "half"})
            raise OSError(28, "disk full")
    assert _tree(d) == OLD and sorted(os.listdir(tmp_path)) == ["model"]


KILLED_WRITER = """
import os, signal, sys
from nemo_dapo.core.checkpoint import atomic_directory
with atomic_directory(sys.argv[1]) as tmp:
    os.makedirs(tmp)
    open(os.path.join(tmp, "config.json"), "w").write("half")
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write: no cleanup code runs
"""


def test_atomic_directory_a_killed_writer_leaves_no_half_directory(tmp_path):
    import signal
    import subprocess
    import sys

    d = str(tmp_path / "model")
    with ck.atomic_directory(d) as tmp:
        _write(tmp, OLD)
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, d], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _tree(d) == OLD and os.path.isdir(d + ".tmp")  # the half-written one only under the temporary name
    os.rename(d + ".tmp", str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), d + ".tmp")  # a link planted at the temporary name: never followed
    with ck.atomic_directory(d) as tmp:
        _write(tmp, NEW)
    assert _tree(d) == NEW and _tree(str(tmp_path / "elsewhere")) == {"config.json": "half"}
    assert not os.path.lexists(d + ".tmp")


def test_safe_load_on_a_torch_without_scoped_allowlists(tmp_path, monkeypatch):
    """torch 2.4 (the trainer image's PyTorch 24.07) has add_safe_globals but not the safe_globals context: a
    checkpoint with the filler's dataclasses still loads, and a foreign class is still refused."""
    from nemo_dapo.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from nemo_dapo.core.dynamic_sampling import Group

    before = torch.serialization.get_safe_globals()
    monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)  # absent in a real torch 2.4
    try:
        group = Group(uid=3, acc=torch.tensor([1.0, 0.0]), rewards=torch.tensor([1.0, -1.0]))
        got = load_checkpoint(save_checkpoint(str(tmp_path), 2, {"groups": [group]}))["groups"][0]
        assert isinstance(got, Group) and got.uid == 3 and torch.equal(got.rewards, group.rewards)
        path = ck.checkpoint_path(str(tmp_path), 5)
        torch.save({"loop": _Planted(tmp_path / "pwned")}, path)
        with pytest.raises(CheckpointError, match="posix.system"):
            load_checkpoint(path)
        assert not (tmp_path / "pwned").exists()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
