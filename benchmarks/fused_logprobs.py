"""Time and peak memory of the fused chunked log-prob + entropy against materialising the logits (CPU, fp32).

    python benchmarks/fused_logprobs.py            # 3 sizes up to vocab 151,936, 3 repeats
    python benchmarks/fused_logprobs.py --quick    # one small size, 2 repeats (a few seconds plus 2 interpreters)
    python benchmarks/fused_logprobs.py --sizes 8192x896x151936    # tokens x hidden x vocab (reference: ~21 GiB)

For hidden states h [N, H], an output layer W [V, H] and targets t [N], each variant computes the taken-token
log-prob and the entropy, then backward of ``(logp * a).sum() + (entropy * b).sum()`` (random a, b [N]) into
h.grad and W.grad:
  reference  ``core.logprobs.reference_logprobs_entropy``: log_softmax of the full [N, V] logits
  fused      ``core.logprobs.linear_logprobs_entropy`` with chunk_size N/8 (the library default 1024 is N/8 at
             T = 8192 tokens), logits recomputed chunk by chunk in backward
Memory, in excess of what exists before the call (inputs); both variants produce the same gradients
(N*H + V*H floats), which are included, and also subtracted in the "working" columns:
  alloc  torch allocator peak: running sum of the torch profiler's allocation/free events during one fwd+bwd in this
         process (exact tensor bytes, deterministic)
  rss    resident-set high-water mark of a FRESH interpreter per variant that builds the inputs and runs one
         fwd+bwd: VmHWM after the call minus VmRSS before it, with the high-water mark reset via
         /proc/self/clear_refs after the inputs exist (glibc told to mmap allocations above 64 KiB so
         freed tensors leave the RSS); includes allocator and library overheads
Time: fwd+bwd in this process, variants interleaved in every repeat (after one untimed profiled run each), median
wall seconds and median CPU seconds (process_time; one thread). Ratios are fused / reference from the same run.
Ends with one line ``RESULT key=value ...`` (ratios at the last size).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _memory import proc_status_kib, profiled_peak  # noqa: E402
SIZES = ((1024, 512, 32000), (4096, 512, 32000), (1024, 896, 151936))  # (tokens N, hidden H, vocab V)
QUICK_SIZES = ((256, 128, 8192),)
VARIANTS = ("reference", "fused")
GIB = 2 ** 30


def make_inputs(n: int, hid: int, vocab: int, seed: int = 0):
    """Seeded fp32 inputs, built in place (no transient copies that would raise the RSS high-water mark)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = torch.randn(vocab, hid, generator=g).div_(hid ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return h, w, t, a, b


def step(variant: str, chunk: int, h, w, t, a, b):
    """One forward + backward; returns the detached outputs and gradients, and clears the gradients."""
    from nemo_dapo.core.logprobs import linear_logprobs_entropy, reference_logprobs_entropy
    if variant == "reference":
        logp, ent = reference_logprobs_entropy(h, w, t)
    else:
        logp, ent = linear_logprobs_entropy(h, w, t, chunk_size=chunk)
    ((logp * a).sum() + (ent * b).sum()).backward()
    out = (logp.detach(), ent.detach(), h.grad, w.grad)
    h.grad = w.grad = None
    return out


def allocator_peak(variant: str, chunk: int, inputs) -> tuple[int, tuple]:
    """Peak bytes of live tensors allocated during one fwd+bwd (profiler memory events), and its outputs."""
    return profiled_peak(lambda: step(variant, chunk, *inputs))


def rss_child(args) -> None:
    """Entry of the fresh interpreter: one fwd+bwd, prints {"rss_extra": bytes} as JSON."""
    import torch
    torch.set_num_threads(1)
    inputs = make_inputs(args.n, args.hidden, args.vocab)
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current RSS (torch's import may have peaked higher)
    except OSError:
        pass
    before = proc_status_kib("VmRSS")
    step(args.variant, args.chunk, *inputs)
    # VmHWM, not getrusage's ru_maxrss: after exec the latter also remembers the parent's RSS at fork time.
    after = proc_status_kib("VmHWM")
    print(json.dumps({"rss_extra": (after - before) * 1024}))


def fresh_rss(n: int, hid: int, vocab: int, variant: str, chunk: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--rss-child", "--n", str(n), "--hidden", str(hid), "--vocab", str(vocab),
           "--variant", variant, "--chunk", str(chunk)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"RSS child {variant} at {(n, hid, vocab)} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["rss_extra"]


def measure_size(n: int, hid: int, vocab: int, repeats: int, fresh: bool) -> dict:
    import torch
    chunk = max(n // 8, 1)
    inputs = make_inputs(n, hid, vocab)
    alloc, outs = {}, {}
    for v in VARIANTS:  # also the warm-up of each variant
        alloc[v], outs[v] = allocator_peak(v, chunk, inputs)
    diff = max(float((x - y).abs().max()) for x, y in zip(outs["fused"], outs["reference"]))
    scale = max(float(y.abs().max()) for y in outs["reference"])
    del outs
    wall, cpu = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for v in VARIANTS:
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            step(v, chunk, *inputs)
            wall[v].append(time.perf_counter() - w0)
            cpu[v].append(time.process_time() - c0)
    del inputs
    gc.collect()
    rss = {v: fresh_rss(n, hid, vocab, v, chunk) if fresh else float("nan") for v in VARIANTS}
    grads = (n * hid + vocab * hid) * torch.finfo(torch.float32).bits // 8
    return dict(chunk=chunk, alloc=alloc, rss=rss, grads=grads, diff=diff, scale=scale,
                wall={v: statistics.median(x) for v, x in wall.items()},
                cpu={v: statistics.median(x) for v, x in cpu.items()})


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one small size, 2 repeats")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-interpreter RSS measurement")
    p.add_argument("--sizes", help="NxHxV[,NxHxV...] instead of the built-in sizes, e.g. 8192x896x151936")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--n", "--hidden", "--vocab", "--chunk"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.repeats = 2
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        args.sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        p.error(f"--sizes must look like 1024x512x32000[,2048x896x151936], got {args.sizes!r}")
    if args.sizes and any(len(s) != 3 or min(s) < 1 for s in args.sizes):
        p.error(f"--sizes: each size is tokens x hidden x vocab, all positive; got {args.sizes}")
    return args


def working(d: dict, grads: int, v: str) -> float:
    return d[v] - grads


def print_size(n: int, hid: int, vocab: int, r: dict) -> None:
    for v in VARIANTS:
        print(f"{n:>6}{hid:>6}{vocab:>8}{r['chunk']:>7} {v:<10}{r['alloc'][v] / GIB:>8.3f}"
              f"{working(r['alloc'], r['grads'], v) / GIB:>9.3f}{r['rss'][v] / GIB:>8.3f}"
              f"{working(r['rss'], r['grads'], v) / GIB:>9.3f}{r['wall'][v]:>9.2f}{r['cpu'][v]:>8.2f}")
    cells = [ratio(r["alloc"]), working_ratio(r, "alloc"), ratio(r["rss"]), working_ratio(r, "rss"),
             ratio(r["wall"]), ratio(r["cpu"])]
    print(f"{'':>27} {'fused/ref':<10}" + "".join(f"{c:>{w}.3f}" for c, w in zip(cells, (8, 9, 8, 9, 9, 8))))
    print(f"{'':>27} max |fused - reference| over logp, entropy and both gradients: {r['diff']:.2e} "
          f"(largest reference value {r['scale']:.2e}); gradients {r['grads'] / GIB:.3f} GiB")


def ratio(d: dict) -> float:
    return d["fused"] / d["reference"]


def working_ratio(r: dict, kind: str) -> float:
    return working(r[kind], r["grads"], "fused") / working(r[kind], r["grads"], "reference")


def main() -> int:
    args = parse_args()
    if args.rss_child:
        rss_child(args)
        return 0
    import torch
    torch.set_num_threads(1)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    print(f"fused log-prob + entropy vs materialised logits, fwd+bwd, fp32, CPU, {torch.get_num_threads()} thread, "
          f"{args.repeats} repeats (medians); memory in GiB above the inputs")
    print(f"{'N':>6}{'H':>6}{'V':>8}{'chunk':>7} {'variant':<10}{'alloc':>8}{'working':>9}{'rss':>8}{'working':>9}"
          f"{'wall s':>9}{'cpu s':>8}")
    for n, hid, vocab in sizes:
        r = measure_size(n, hid, vocab, args.repeats, fresh=not args.no_rss)
        print_size(n, hid, vocab, r)
    fields = [f"tokens={n}", f"hidden={hid}", f"vocab={vocab}", f"chunk={r['chunk']}",
              f"alloc_ratio={ratio(r['alloc']):.3f}", f"alloc_working_ratio={working_ratio(r, 'alloc'):.3f}",
              f"rss_ratio={ratio(r['rss']):.3f}", f"wall_ratio={ratio(r['wall']):.3f}",
              f"cpu_ratio={ratio(r['cpu']):.3f}", f"max_abs_diff={r['diff']:.2e}"]
    print("RESULT " + " ".join(fields), flush=True)  # the largest (last) size
    return 0


if __name__ == "__main__":
    sys.exit(main())
