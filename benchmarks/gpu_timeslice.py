"""What a kernel that waits on the GPU in another process costs the work beside it: a trainer rank waiting inside an
NCCL collective runs a kernel that spins until its peers arrive, on the GPU a colocated engine computes on. Without
MPS the GPU runs one process's context at a time and switches between them by time slice, so the engine's kernels
take turns with the spinning one. This is why the NeMo-Aligner path's ranks wait for engines on the CPU
(nemo_dapo/core/collective.py); here it is measured on one GPU.

    python benchmarks/gpu_timeslice.py           # CUDA: 5 rounds of 100 bf16 4096^2 matmuls, alone and beside
    python benchmarks/gpu_timeslice.py --quick   # checks the arguments and exits on a machine without CUDA

  baseline  the matmul rounds alone on the GPU
  ours      the same rounds while a second process keeps ``torch.cuda._sleep`` kernels (a spin of the GPU's clock, as
            a waiting NCCL kernel spins on a flag) queued on the same GPU
Ends with one line ``RESULT key=value ...``: the median seconds of a round each way and their ratio (1.0: no cost;
``skipped=no_cuda`` without CUDA).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

SPIN_CYCLES = 20_000_000  # one spin kernel: ~10-20 ms at the GPU's clock


def spin(stop, ready) -> None:
    """Keep two spin kernels queued on GPU 0 until ``stop`` is set (no gap for the other process to run alone)."""
    torch.cuda.set_device(0)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    ready.set()
    queued = []
    while not stop.is_set():
        torch.cuda._sleep(SPIN_CYCLES)
        done = torch.cuda.Event()
        done.record()
        queued.append(done)
        if len(queued) > 2:
            queued.pop(0).synchronize()
    torch.cuda.synchronize()


def rounds(n_rounds: int, matmuls: int, width: int) -> list:
    """Seconds of each round of ``matmuls`` bf16 [width, width] products on GPU 0."""
    a = torch.randn(width, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(width, width, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()  # warm-up: cuBLAS handles and kernels
    out = []
    for _ in range(n_rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(matmuls):
            c = a @ b
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
        del c
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--matmuls", type=int, default=100)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="exit 0 without CUDA (what the smoke test runs)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("RESULT device=cpu skipped=no_cuda")
        return 0 if args.quick else 2
    alone = statistics.median(rounds(args.rounds, args.matmuls, args.width))
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    spinner = ctx.Process(target=spin, args=(stop, ready))
    spinner.start()
    try:
        if not ready.wait(120):
            print("the spinning process did not start within 120 s", file=sys.stderr)
            return 1
        beside = statistics.median(rounds(args.rounds, args.matmuls, args.width))
    finally:
        stop.set()
        spinner.join(60)
    print(f"{torch.cuda.get_device_name(0)}: a round of {args.matmuls} bf16 {args.width}^2 matmuls, median of "
          f"{args.rounds}: {alone:.4f} s alone, {beside:.4f} s beside a spinning kernel of another process")
    print(f"RESULT device=cuda alone_s={alone:.4f} beside_spin_s={beside:.4f} ratio={beside / alone:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
