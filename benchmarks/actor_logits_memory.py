"""The DAPO actor's last-stage log-prob + loss memory per micro-batch, and the padding of its micro-batches.

    python benchmarks/actor_logits_memory.py           # 4096 tokens x hidden 1024 x vocab 152064 / TP 8, bf16
    python benchmarks/actor_logits_memory.py --quick   # small shape, 2 repeats (seconds)

(1) Memory. One micro-batch of b x S tokens leaves the decoder as hidden states h [S, b, H] (bf16, requires grad);
the output-layer shard W [V/tp, H]. Both variants compute the taken-token log-prob and the entropy of tokens 1..S-1
and backward ``(logp * adv * mask).sum()`` (entropy logged only, as in DAPO) into h.grad and W.grad:
  logits  what the actor did before: megatron-core's output layer ``h @ W.T`` [S, b, V/tp], GPTModel's
          ``transpose(0, 1).contiguous()``, megatron's Float16Module cast to fp32, then
          ``vocab_parallel.vocab_parallel_logits_logprobs_entropy`` on ``logits[:, :-1]``
  hidden  the actor now: the Float16Module's fp32 copy of h, then ``megatron.step.hidden_logprobs_entropy``
          (the same function the actor calls; chunked, logits recomputed per chunk in backward)
Peak: the torch allocator's live bytes during one fwd+bwd (profiler memory events), beyond the inputs; the
gradients (same in both) are included. Time: median wall / CPU seconds, variants interleaved. TP=1 process group
(gloo): V/tp is the shard a TP rank holds. Ratio = hidden / logits in the same run.

(2) Padding. Response lengths drawn from the plan's DAPO-like model (plan_generation.ResponseLengths: cap 20,480,
mean ~6k, 5% truncated) plus a prompt; a mini-batch dealt to DP ranks; padded / real tokens of the actor's
micro-batches before (every micro-batch of ``mbs`` rows padded to the rank's longest row, NeMo-Aligner's split) and
after (core.microbatch.plan_microbatches with ``micro_batch_tokens``), both with the DP-agreed micro-batch count
(filler micro-batches count: rows x S before, ``multiple`` tokens after). Seeded: deterministic.
Ends with one line ``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _memory import profiled_peak  # noqa: E402

MIB = 2 ** 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 tokens, hidden 128, vocab 8192, 2 repeats")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the micro-batch (b x S, b = 1)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=152064, help="full (padded) vocabulary")
    p.add_argument("--tp", type=int, default=8, help="the shard is vocab / tp rows")
    p.add_argument("--chunk", type=int, default=256, help="model.dapo.logprob_chunk_size (its YAML default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--rows", type=int, default=512, help="mini-batch rows (padding part)")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--mbs", type=int, default=1, help="micro_batch_size (rows per micro-batch before)")
    p.add_argument("--micro-batch-tokens", type=int, default=24576)
    p.add_argument("--multiple", type=int, default=64, help="seq_len_multiple (8 x TP with sequence parallelism)")
    a = p.parse_args()
    if a.quick:
        a.tokens, a.hidden, a.vocab, a.tp, a.chunk, a.repeats, a.rows = 256, 128, 8192, 1, 64, 2, 128
    return a


def setup():
    import torch
    if not torch.cuda.is_available():
        import tests.support.megatron_cpu_shim  # noqa: F401  megatron asks torch.cuda for its device
    import torch.distributed as dist
    from megatron.core import parallel_state
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from tests.support.dist import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.set_num_threads(1)


class _LastStage:
    """What ``hidden_logprobs_entropy`` reads of a GPTModel: its config and (untied) output layer."""

    def __init__(self, weight):
        from types import SimpleNamespace
        self.config = SimpleNamespace(sequence_parallel=False)
        self.share_embeddings_and_output_weights = False
        self.output_layer = SimpleNamespace(weight=weight)


def make_inputs(n, hid, v_local, dtype, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 1, hid, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v_local, hid, generator=g) / hid ** 0.5).to(dtype).requires_grad_()
    tokens = torch.randint(0, v_local, (1, n), generator=g)
    adv = torch.randn(1, n - 1, generator=g)
    mask = (torch.rand(1, n - 1, generator=g) < 0.9).float()  # the prompt and padding are masked out
    return h, w, tokens, adv, mask


def step(variant, chunk, h, w, tokens, adv, mask):
    from nemo_dapo.megatron.step import hidden_logprobs_entropy
    from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logits_logprobs_entropy
    if variant == "logits":
        logits = (h @ w.t()).transpose(0, 1).contiguous().float()  # output layer, GPTModel, Float16Module
        logp, ent = vocab_parallel_logits_logprobs_entropy(logits[:, :-1], tokens[:, 1:], chunk_size=chunk)
    else:
        logp, ent = hidden_logprobs_entropy(_LastStage(w), h.float(), tokens[:, 1:], mask=mask > 0,
                                            chunk_size=chunk)
    (logp * adv * mask).sum().backward()
    out = (logp.detach() * mask, ent.detach() * mask, h.grad, w.grad)
    h.grad = w.grad = None
    return out


def memory_part(a):
    import torch
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    v_local = a.vocab // a.tp
    inputs = make_inputs(a.tokens, a.hidden, v_local, dtype)
    peaks, walls, cpus, outs = {}, {"logits": [], "hidden": []}, {"logits": [], "hidden": []}, {}
    for v in ("logits", "hidden"):
        peaks[v], outs[v] = profiled_peak(lambda: step(v, a.chunk, *inputs))
    for _ in range(a.repeats):
        for v in ("logits", "hidden"):
            t0, c0 = time.perf_counter(), time.process_time()
            step(v, a.chunk, *inputs)
            walls[v].append(time.perf_counter() - t0)
            cpus[v].append(time.process_time() - c0)
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(outs["logits"], outs["hidden"]))
    logits_bytes = a.tokens * v_local * 4
    print(f"memory: {a.tokens} tokens x hidden {a.hidden} x vocab {a.vocab} / tp {a.tp} = {v_local} rows, "
          f"{a.dtype}, chunk {a.chunk}; fp32 logits of the micro-batch: {logits_bytes / MIB:.0f} MiB")
    print(f"{'variant':8s} {'peak MiB':>10s} {'x logits':>9s} {'wall s':>8s} {'cpu s':>8s}")
    for v in ("logits", "hidden"):
        print(f"{v:8s} {peaks[v] / MIB:10.1f} {peaks[v] / peaks['logits']:9.3f} "
              f"{statistics.median(walls[v]):8.2f} {statistics.median(cpus[v]):8.2f}")
    print(f"max abs diff of logp / entropy / grad_h / grad_W between the variants: {diff:.2e}")
    return dict(alloc_ratio=peaks["hidden"] / peaks["logits"], logits_peak_mib=peaks["logits"] / MIB,
                hidden_peak_mib=peaks["hidden"] / MIB, max_abs_diff=diff,
                cpu_ratio=statistics.median(cpus["hidden"]) / statistics.median(cpus["logits"]))


def draw_lengths(n, rng, *, l_max=20480, mean=6000.0, truncated=0.05, prompt=(100, 600)):
    """Row lengths (prompt + response): responses by inverse CDF of plan_generation.ResponseLengths."""
    from nemo_dapo.cluster.plan_generation import ResponseLengths
    shape = ResponseLengths(l_max, mean, truncated).shape
    out = []
    for _ in range(n):
        if rng.random() < truncated:
            r = l_max
        else:
            r = max(1, int(-l_max / shape * math.log1p(rng.random() * math.expm1(-shape))))
        out.append(rng.randint(*prompt) + r)
    return out


def padding_part(a, seed=0):
    from nemo_dapo.core.microbatch import padded_len, plan_microbatches, round_up
    rng = random.Random(seed)
    lengths = draw_lengths(a.rows, rng)
    shares = [lengths[r::a.dp] for r in range(a.dp)]
    n_before = max(max(1, -(-len(s) // a.mbs)) for s in shares)
    plans = [plan_microbatches(s, multiple=a.multiple, max_tokens=a.micro_batch_tokens) for s in shares]
    n_after = max(max(1, len(p)) for p in plans)
    real = sum(lengths)
    before = sum(n_before * a.mbs * round_up(max(s), a.multiple) for s in shares)
    after = sum(sum(len(g) * padded_len(s, g, a.multiple) for g in p) + (n_after - len(p)) * a.multiple
                for s, p in zip(shares, plans))
    print(f"padding: {a.rows} rows (mean {statistics.mean(lengths):.0f} tokens, "
          f"{sum(x > 20480 for x in lengths)} at the response cap) over DP {a.dp}, seq multiple {a.multiple}")
    print(f"  before (mbs {a.mbs}, padded to the rank's longest row): {n_before} micro-batches/rank, "
          f"padded/real {before / real:.3f}")
    print(f"  after  (micro_batch_tokens {a.micro_batch_tokens}, trimmed): {n_after} micro-batches/rank, "
          f"padded/real {after / real:.3f}")
    return dict(pad_before=before / real, pad_after=after / real, microbatches_before=n_before,
                microbatches_after=n_after)


def main():
    a = parse_args()
    setup()
    res = memory_part(a)
    res.update(padding_part(a))
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
