"""Rate of the training-state offload (``nemo_dapo.megatron.state_offload``) against one raw copy of the same bytes.

    python benchmarks/state_offload.py                 # CUDA if present: an 8 GB training state, 5 repeats
    python benchmarks/state_offload.py --gb 32         # a larger state
    python benchmarks/state_offload.py --quick         # 0.05 GB on the CPU (what the smoke test runs)

The colocated step frees the trainer's weights, gradients and Adam states while the engine generates and brings them
back before the update (``model.dapo.offload_training_state``); the planner charges both moves at
``plan.assume.pcie_gb_per_s``. The state here: fp32 Linear layers of 64 MiB each after one Adam step (weights 4,
grads 4, Adam moments 8 bytes a parameter), so ``--gb`` is the whole state.
  ours      ``StateOffload.offload()`` (every storage to its own host buffer, pinned on CUDA, then freed) and
            ``onload()``; the first offload also allocates (and pins) the host buffers, so it is reported apart and
            the medians are of the later repeats, which reuse them (as every step after the first does)
  baseline  one copy of one flat device buffer of the same bytes to one pinned host buffer and back
            (``copy_(non_blocking=True)`` + synchronize): the link's rate for this machine, measured in the same run
Checked each repeat: the state is bit-identical after the round trip; on CUDA, ``memory_allocated`` falls by at
least the state's bytes while it is offloaded. Ends with one line ``RESULT key=value ...`` (rates in GB/s, 1e9 B).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nemo_dapo.megatron.state_offload import StateOffload  # noqa: E402

LAYER = 4096  # a 4096 x 4096 fp32 Linear: 64 MiB of weights, 256 MiB of state with its grad and Adam moments
BYTES_PER_PARAM = 16


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_state(gb: float, device):
    """(model, optimizer) whose weights + grads + Adam moments hold about ``gb`` GB, after one Adam step."""
    params = gb * 1e9 / BYTES_PER_PARAM
    width = LAYER if params >= 4 * LAYER * LAYER else max(8, int((params / 4) ** 0.5))
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def snapshot(model, opt) -> list:
    return [t.detach().cpu().clone() for p in model.parameters() for t in (p, p.grad, *opt.state[p].values())
            if t.is_floating_point()]


def timed(device, fn) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def raw_rates(nbytes: int, device, repeats: int) -> tuple:
    """Median seconds of one device -> host and one host -> device copy of ``nbytes`` (pinned host on CUDA)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    nb = device.type == "cuda"
    d2h = [timed(device, lambda: host.copy_(dev, non_blocking=nb)) for _ in range(repeats)]
    h2d = [timed(device, lambda: dev.copy_(host, non_blocking=nb)) for _ in range(repeats)]
    return statistics.median(d2h), statistics.median(h2d)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="0.05 GB on the CPU, 3 repeats")
    p.add_argument("--gb", type=float, default=None, help="training-state size in GB (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    gb = 0.05 if args.quick else (args.gb or (8.0 if device.type == "cuda" else 1.0))
    repeats = 3 if args.quick else args.repeats
    model, opt = build_state(gb, device)
    off = StateOffload([model], opt, device=device)
    before = snapshot(model, opt)
    state_bytes = sum(s.nbytes() for items in off.storages().values() for _, s in items)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, training state {state_bytes / 1e9:.2f} GB in {len(list(model))} layers, "
          f"{repeats} repeats (medians of repeats 2..n)", flush=True)

    first_off, outs, ins, drops, exact = None, [], [], [], True
    for i in range(repeats):
        alloc0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t_off = timed(device, off.offload)
        if device.type == "cuda":
            drops.append(alloc0 - torch.cuda.memory_allocated(device))
        t_on = timed(device, off.onload)
        exact = exact and all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))
        if i == 0:
            first_off = t_off
        else:
            outs.append(t_off)
            ins.append(t_on)
        print(f"  repeat {i + 1}: offload {t_off:.3f} s, onload {t_on:.3f} s", flush=True)
    d2h, h2d = raw_rates(state_bytes, device, max(2, repeats - 1))
    rate = lambda s: state_bytes / 1e9 / s  # noqa: E731
    t_out, t_in = statistics.median(outs), statistics.median(ins)
    print(f"offload {rate(t_out):.1f} GB/s (first, allocating its host buffers: {rate(first_off):.1f}), onload "
          f"{rate(t_in):.1f} GB/s; one raw copy of the same bytes: {rate(d2h):.1f} / {rate(h2d):.1f} GB/s")
    fields = dict(device=device.type, state_gb=f"{state_bytes / 1e9:.3f}", bit_identical=str(exact).lower(),
                  offload_gb_per_s=f"{rate(t_out):.2f}", onload_gb_per_s=f"{rate(t_in):.2f}",
                  first_offload_gb_per_s=f"{rate(first_off):.2f}", raw_d2h_gb_per_s=f"{rate(d2h):.2f}",
                  raw_h2d_gb_per_s=f"{rate(h2d):.2f}", offload_vs_raw=f"{d2h / t_out:.3f}",
                  onload_vs_raw=f"{h2d / t_in:.3f}",
                  min_allocated_drop_gb=f"{min(drops) / 1e9:.3f}" if drops else "nan")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
    if not exact or (drops and min(drops) < state_bytes):
        print("FAILED: the state changed over a round trip, or its device memory was not freed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
