"""Shared-memory weight buckets (nemo_dapo/engines/shm.py): the layout, the trainer's block and the engine's view."""
import os

import pytest
import torch

from nemo_dapo.engines import shm as S
from nemo_dapo.engines.protocol import ProtocolError


def test_weight_buffer_roundtrip_of_mixed_dtypes_and_reuse():
    buf = S.WeightBuffer()
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
               ("c", torch.randn(2, 2).to(torch.bfloat16)), ("d", torch.zeros(0, 4))]
    try:
        name, specs = buf.pack(tensors)
        assert os.path.exists(f"/dev/shm/{name}")
        peer = S.AttachedBuffer(name)
        assert not os.path.exists(f"/dev/shm/{name}")  # the engine removes the name as soon as it has mapped it
        got = dict(peer.tensors(specs))
        for n, t in tensors:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t)
        size = buf.size
        assert buf.pack([("a", torch.ones(2))])[0] == name and buf.size == size  # reused, not re-allocated
        assert torch.equal(dict(peer.tensors(specs[:1]))["a"][0, :2], torch.ones(2))  # both map the same memory
        del got
        peer.close()
    finally:
        buf.close()  # the name is gone already: closing must not fail


def _spec(shape, offset, dtype="float32"):
    return {"name": "w", "dtype": dtype, "shape": shape, "offset": offset}


def test_a_negative_offset_does_not_fit():
    assert S.spec_fits(_spec([4], 0), 64)
    assert not S.spec_fits(_spec([4], -4), 64)


def test_a_spec_one_byte_past_the_block_does_not_fit():
    assert S.spec_fits(_spec([16], 0, "uint8"), 16)  # ends exactly at the end
    assert not S.spec_fits(_spec([16], 1, "uint8"), 16)  # 1 + 16 = 17 > 16


def test_boolean_dimensions_are_refused():
    with pytest.raises(ProtocolError, match="shape"):
        S.spec_fits(_spec([True, 2], 0), 64)


def test_tensors_never_overlap_in_the_weight_layout():
    bucket = [("a", torch.zeros(65, dtype=torch.uint8)), ("b", torch.zeros(65, dtype=torch.uint8))]
    specs, size = S.weight_layout(bucket)
    assert [s["offset"] for s in specs] == [0, 128] and size == 256  # 65 bytes round up to 128


_FULL_SHM_CHILD = """
import os, torch
from nemo_dapo.engines import shm as S
from nemo_dapo.engines.base import EngineError
buf = S.WeightBuffer()
try:
    buf.pack([("w", torch.zeros(1 << 20))])  # a 4 MiB bucket
except EngineError as e:
    print("ERROR", e)
print("LEFT", os.listdir("/dev/shm"))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a /dev/shm of its own (mount namespace) needs root")
def test_a_bucket_larger_than_the_free_dev_shm_is_an_engine_error_not_a_sigbus(tmp_path):
    """A new block is a sparse file on tmpfs; filled past a full /dev/shm (Docker's default is 64 MiB, the recipes'
    buckets 64-512 MiB) it killed the trainer with SIGBUS. The block's pages are allocated when it is made, so the
    trainer gets an engine error (exit 4 and a checkpoint) naming the fixes, and the block is gone."""
    import subprocess
    import sys

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "child.py").write_text(_FULL_SHM_CHILD)
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "
                        f"{sys.executable} {tmp_path / 'child.py'}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]  # SIGBUS: -7
    assert "ERROR /dev/shm has no room for a weight bucket of 4 MiB (1 MiB free of 1 MiB" in r.stdout, r.stdout
    assert "bucket_mb" in r.stdout and "--shm-size" in r.stdout and "LEFT []" in r.stdout
