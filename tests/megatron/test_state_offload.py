"""nemo_dapo.megatron.state_offload in one process, on plain torch objects shaped like megatron-core's: a DDP-like
chunk whose parameters and main grads are views into one ``param_data`` / ``grad_data`` buffer, fp32 main params
behind a wrapper (their own grads and Adam states) and a chained (dense + expert) optimizer. What is checked is the
contract the trainer relies on, with the expected bytes counted from the storages built here: a staged offload moves
exactly the parts named, each storage once; every storage is freed; onload brings back the same objects bit for bit;
a second cycle moves the same bytes again. (The multi-process round trip through megatron-core's DDP and optimizer
is tests/aligner/test_training_offload.py.)"""
from types import SimpleNamespace

import torch

from nemo_dapo.megatron.state_offload import PARTS, StateOffload


class DDPLikeChunk(torch.nn.Module):
    """Two parameters viewed into one ``param_data`` and their ``main_grad`` views into one ``grad_data``, as
    megatron-core's DistributedDataParallel lays them out (its ``buffers`` attribute hides nn.Module's method)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        buf = SimpleNamespace(param_data=torch.randn(20, generator=g), grad_data=torch.randn(20, generator=g))
        self.w = torch.nn.Parameter(torch.empty(0))
        self.b = torch.nn.Parameter(torch.empty(0))
        self.w.data = buf.param_data[:12].view(3, 4)
        self.b.data = buf.param_data[12:16]
        self.w.main_grad = buf.grad_data[:12].view(3, 4)
        self.b.main_grad = buf.grad_data[12:16]
        self.b.grad = torch.randn(4, generator=g)  # a plain .grad of its own storage
        self.buffers = [buf]


def mixed_precision_optimizer(chunk: DDPLikeChunk, seed: int):
    """A wrapper (``.optimizer``) around Adam over fp32 main-param copies, stepped once so that it has states."""
    main = [torch.nn.Parameter(p.detach().clone()) for p in (chunk.w, chunk.b)]
    adam = torch.optim.Adam(main, lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for p in main:
        p.grad = torch.randn(p.shape, generator=g)
    adam.step()
    return SimpleNamespace(optimizer=adam), main


def build():
    chunks = [DDPLikeChunk(1), DDPLikeChunk(2)]
    (dense, main0), (expert, main1) = mixed_precision_optimizer(chunks[0], 3), mixed_precision_optimizer(chunks[1], 4)
    optimizer = SimpleNamespace(chained_optimizers=[dense, expert])  # megatron-core's ChainedOptimizer
    nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
    # the distinct storages of each part, listed by hand from what was built above
    states = [t for opt in (dense, expert) for s in opt.optimizer.state.values() for t in s.values()
              if t.device.type == "cpu"]
    want = {"weights": nbytes([c.buffers[0].param_data for c in chunks]),
            "grads": nbytes([c.buffers[0].grad_data for c in chunks] + [c.b.grad for c in chunks]
                            + [p.grad for p in main0 + main1]),
            "optimizer": nbytes(main0 + main1 + states)}
    every = [c.buffers[0].param_data for c in chunks] + [c.buffers[0].grad_data for c in chunks] \
        + [c.b.grad for c in chunks] + [t for p in main0 + main1 for t in (p, p.grad)] + states
    return chunks, optimizer, want, every


def test_staged_offload_moves_each_part_once_and_onload_restores_every_byte():
    chunks, optimizer, want, every = build()
    snapshot = [t.clone() for t in every]
    views = [(c.w, c.b, c.w.main_grad, c.b.main_grad) for c in chunks]
    off = StateOffload(chunks, optimizer, device="cpu", pin=False)

    # before a refit: grads and optimizer only; the weights must stay readable for the gather
    assert off.offload(["grads", "optimizer"]) == want["grads"] + want["optimizer"]
    assert off.offloaded_parts == ("grads", "optimizer")
    assert all(c.buffers[0].param_data.untyped_storage().nbytes() > 0 for c in chunks)
    assert torch.equal(chunks[0].w, snapshot[0][:12].view(3, 4))
    assert off.offload(["grads"]) == 0  # already offloaded: nothing moves twice
    # after the refit: the weights
    assert off.offload(["weights"]) == want["weights"]
    assert off.offloaded_bytes == sum(want.values())
    assert all(t.untyped_storage().nbytes() == 0 for t in every)  # every storage freed

    assert off.onload() == sum(want.values())
    assert off.offloaded_parts == () and off.onload() == 0
    assert all(torch.equal(t, s) for t, s in zip(every, snapshot))
    for c, (w, b, gw, gb) in zip(chunks, views):  # the same objects, still views into the buffers
        assert c.w is w and c.b is b and c.w.main_grad is gw and c.b.main_grad is gb
        assert c.w.untyped_storage()._cdata == c.buffers[0].param_data.untyped_storage()._cdata
        assert c.b.main_grad.untyped_storage()._cdata == c.buffers[0].grad_data.untyped_storage()._cdata


def test_a_second_cycle_moves_the_same_bytes_again():
    chunks, optimizer, want, every = build()
    off = StateOffload(chunks, optimizer, device="cpu", pin=False)
    for _ in range(2):
        with torch.no_grad():  # training between the cycles changes the values in place
            for t in every:
                t.add_(1.0)
        snapshot = [t.clone() for t in every]
        assert off.offload(PARTS) == sum(want.values())
        assert all(t.untyped_storage().nbytes() == 0 for t in every)
        assert off.onload() == sum(want.values())
        assert all(torch.equal(t, s) for t, s in zip(every, snapshot))


def test_only_storages_on_the_device_move():
    chunks, optimizer, want, every = build()
    off = StateOffload(chunks, optimizer, device="meta", pin=False)  # nothing lives there
    assert off.offload(PARTS) == 0 and all(t.untyped_storage().nbytes() > 0 for t in every)
