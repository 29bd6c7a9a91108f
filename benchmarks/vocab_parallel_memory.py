"""Peak memory of the vocab-parallel log-prob + entropy at TP=2, against gathering the vocabulary.

    python benchmarks/vocab_parallel_memory.py            # 2048 tokens, hidden 1024, vocab 151,936, bf16
    python benchmarks/vocab_parallel_memory.py --quick    # 512 tokens, 2 repeats

Launches itself on 2 local ranks (torchrun; gloo on CPU, NCCL on CUDA) with megatron's TP group of size 2. Each rank
holds hidden states [N, H] (replicated) and its half of the output layer [V/2, H]; every variant computes the
taken-token log-prob and the entropy, then backward of a loss that uses both. Variants:
  gather          ColumnParallelLinear-style logits shard -> megatron's gather_from_tensor_model_parallel_region
                  (full [N, V] logits on every rank) -> fp32 log_softmax (what NeMo-Aligner's entropy does)
  sharded_logits  the same logits shard [N, V/2], combined with max/sum all-reduces (no gather), chunked
  fused           from hidden states and the weight shard, chunked over tokens; logits never exist beyond a chunk

Peak memory, per rank, in excess of what exists before the call (inputs and weights), max over the 2 ranks:
  CPU: (a) torch allocator peak: running sum of the torch profiler's allocation/free events (exact tensor bytes,
       deterministic; measured once per variant); (b) resident-set high-water mark: VmHWM after resetting it via
       /proc/self/clear_refs, minus VmRSS before; glibc is told to mmap every allocation above 64 KiB so that freed
       tensors leave the RSS (MALLOC_MMAP_THRESHOLD_); median of the repeats. (b) includes allocator and library
       overheads, (a) does not.
  CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before.
Ends with one line `RESULT key=value ...`; ratios are against the gather baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _memory import proc_status_kib, profiled_peak

ROOT = Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="512 tokens, 2 repeats (about a minute)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936, help="full vocabulary; must be even (TP=2)")
    p.add_argument("--chunks", default="256,1024", help="comma-separated chunk sizes for the chunked variants")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.repeats = 512, 2
    return args


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch():
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env).returncode)


# ---------------------------------------------------------------------------------------------------------------
# worker (one per rank)
# ---------------------------------------------------------------------------------------------------------------

def variants(chunks):
    import torch
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_tensor_model_parallel_region)

    from nemo_dapo.megatron.vocab_parallel import (vocab_parallel_logits_logprobs_entropy,
                                                   vocab_parallel_logprobs_entropy)

    def gather(h, w, t):
        logits = gather_from_tensor_model_parallel_region(copy_to_tensor_model_parallel_region(h) @ w.t())
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        return logp_all.gather(1, t[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)

    out = {"gather": gather}
    for c in chunks:
        out[f"sharded_logits@{c}"] = lambda h, w, t, c=c: vocab_parallel_logits_logprobs_entropy(
            copy_to_tensor_model_parallel_region(h) @ w.t(), t, chunk_size=c)
        out[f"fused@{c}"] = lambda h, w, t, c=c: vocab_parallel_logprobs_entropy(h, w, t, chunk_size=c)
    return out


def step(fn, h, w, t, a, b):
    logp, ent = fn(h, w, t)
    ((logp * a).sum() + (ent * b).sum()).backward()
    return logp.detach(), ent.detach()


def measure_rss(fn, inputs, device):
    import torch
    import torch.distributed as dist
    h, w = inputs[0], inputs[1]
    gc.collect()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = proc_status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    out = step(fn, *inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else proc_status_kib("VmHWM") * 1024) - base
    h.grad = w.grad = None
    dist.barrier()
    return peak, seconds, out


def measure_allocator(fn, inputs):
    import torch.distributed as dist
    h, w = inputs[0], inputs[1]
    dist.barrier()
    peak, _ = profiled_peak(lambda: step(fn, *inputs))
    h.grad = w.grad = None
    dist.barrier()
    return peak


def worker(args):
    if not __import__("torch").cuda.is_available():
        import tests.support.megatron_cpu_shim  # noqa: F401  megatron's gather asks torch.cuda for its device
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, dtype = dist.get_rank(), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    n, hid, v_local = args.tokens, args.hidden, args.vocab // 2

    g = torch.Generator().manual_seed(0)  # the same hidden states and targets on both ranks
    h = torch.randn(n, hid, generator=g).to(device, dtype).requires_grad_()
    t = torch.randint(0, args.vocab, (n,), generator=g).to(device)
    a, b = (torch.randn(n, generator=g).to(device) for _ in range(2))
    w = (torch.randn(v_local, hid, generator=torch.Generator().manual_seed(1 + rank)) / hid ** 0.5)
    w = w.to(device, dtype).requires_grad_()
    inputs = (h, w, t, a, b)

    fns = variants([int(c) for c in args.chunks.split(",")])
    rss, secs, outs = {k: [] for k in fns}, {k: [] for k in fns}, {}
    for _ in range(args.repeats):
        for name, fn in fns.items():  # interleaved, so that drift in the machine's load hits every variant alike
            peak, s, outs[name] = measure_rss(fn, inputs, device)
            rss[name].append(peak)
            secs[name].append(s)
    alloc = {k: measure_allocator(fn, inputs) for k, fn in fns.items()} if not on_cuda else {}
    diffs = {k: max((o[0] - outs["gather"][0]).abs().max().item(), (o[1] - outs["gather"][1]).abs().max().item())
             for k, o in outs.items()}
    mine = dict(rss={k: statistics.median(v) for k, v in rss.items()}, secs={k: statistics.median(v) for k, v in
                                                                            secs.items()}, alloc=alloc, diffs=diffs)
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(args, fns, everyone, on_cuda)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def report(args, fns, ranks, on_cuda):
    gib = 2 ** 30
    worst = lambda kind, k: max(r[kind][k] for r in ranks) if ranks[0][kind] else float("nan")  # noqa: E731
    print(f"vocab-parallel log-prob + entropy, TP=2, fwd+bwd: tokens={args.tokens} hidden={args.hidden} "
          f"vocab={args.vocab} dtype={args.dtype} repeats={args.repeats} device={'cuda' if on_cuda else 'cpu'}")
    print("peak extra memory per rank (max over ranks); time = median wall of fwd+bwd")
    mem_label = "cuda alloc GiB" if on_cuda else "rss GiB"
    print(f"{'variant':<22}{'alloc GiB':>11}{'x gather':>10}{mem_label:>16}{'x gather':>10}{'seconds':>10}"
          f"{'x gather':>10}{'max|diff|':>11}")
    for k in fns:
        al, rs, s = worst("alloc", k), worst("rss", k), worst("secs", k)
        print(f"{k:<22}{al / gib:>11.3f}{al / worst('alloc', 'gather'):>10.3f}{rs / gib:>16.3f}"
              f"{rs / worst('rss', 'gather'):>10.3f}{s:>10.2f}{s / worst('secs', 'gather'):>10.2f}"
              f"{max(r['diffs'][k] for r in ranks):>11.2e}")
    fields = [f"tokens={args.tokens}", f"vocab={args.vocab}", f"dtype={args.dtype}"]
    for k in fns:
        if k == "gather":
            continue
        key = k.replace("@", "_c")
        if not on_cuda:
            fields.append(f"{key}_alloc_ratio={worst('alloc', k) / worst('alloc', 'gather'):.3f}")
        fields.append(f"{key}_{'cuda' if on_cuda else 'rss'}_ratio={worst('rss', k) / worst('rss', 'gather'):.3f}")
        fields.append(f"{key}_time_ratio={worst('secs', k) / worst('secs', 'gather'):.2f}")
    print("RESULT " + " ".join(fields), flush=True)


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        launch()
    else:
        worker(parse_args())
