"""Static batches vs in-flight batching vs streaming with early stop, through the engine server (CPU).

Workload (DAPO-like long tail, one draw per sample, fixed by --seed): 85% of the responses are short
(uniform 8..64 tokens), 10% medium (64..200), 5% run to the cap (--cap, 256); --groups prompt groups of --group-size
samples; a random half of the groups is "informative" (kept by dynamic sampling) and the filler needs --needed of
them. Lengths are imposed with ``ignore_eos`` + per-request ``max_new_tokens`` on a random tiny Llama (head_dim 32,
which vLLM's CPU attention accepts), so every engine decodes exactly the same tokens counts.

Three ways to run the same requests on the same engine with --slots sequences in flight:
  (a) static: fixed-shape batches of --slots requests, each row decoding until the batch's longest response is done
      and the next batch only then (NeMo-Aligner's TensorRT-LLM ModelRunner path; only each response's own tokens
      count as generated); time to the last needed group = the end of the batch holding it;
  (b) in flight: every request submitted at once, finished slots refilled at once; the loop waits for all;
  (c) streaming: as (b), but the requests still running are aborted as soon as --needed informative groups are done.
Prints a table and one RESULT line; medians over --repeats.

    OMP_NUM_THREADS=1 python benchmarks/rollout_engine.py [--engines local,vllm] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nemo_dapo.engines.base import Request  # noqa: E402
from nemo_dapo.engines.client import EngineClient, EngineProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(groups: int, group_size: int, cap: int, seed: int) -> tuple:
    rng = random.Random(seed)

    def length():
        u = rng.random()
        return rng.randint(8, 64) if u < 0.85 else rng.randint(64, 200) if u < 0.95 else cap

    lengths = [[min(length(), cap) for _ in range(group_size)] for _ in range(groups)]
    informative = set(rng.sample(range(groups), groups // 2))
    return lengths, informative


def requests(lengths: list, tag: str) -> list:
    return [Request(id=f"{tag}-{g}-{j}", prompt_ids=[1, 5 + g % 50, 7], n=1, max_new_tokens=n, temperature=1.0,
                    seed=1000 * g + j, ignore_eos=True)
            for g, group in enumerate(lengths) for j, n in enumerate(group)]


def _useful(rid: str, lengths: list) -> int:
    g, j = (int(x) for x in rid.split("-")[1:3])
    return lengths[g][j]


def _group_of(rid: str) -> int:
    return int(rid.split("-")[1])


def run_static(client, lengths, informative, needed, slots) -> dict:
    """Fixed-shape batches: every row of a batch decodes until the batch's longest is done (a finished row keeps its
    slot, as in TensorRT-LLM's ModelRunner); only each response's own tokens count as generated."""
    reqs, t0, tokens, done_groups, t_needed = requests(lengths, "a"), time.perf_counter(), 0, {}, None
    for start in range(0, len(reqs), slots):
        batch = reqs[start:start + slots]
        width = max(r.max_new_tokens for r in batch)
        for r in batch:
            r.max_new_tokens = width
        client.submit(batch)
        for _ in batch:
            c = client.next_completion()
            tokens += _useful(c.id, lengths)
            g = _group_of(c.id)
            done_groups[g] = done_groups.get(g, 0) + 1
        # a group is usable only when the batch that finishes it returns
        full = [g for g, n in done_groups.items() if n == len(lengths[g]) and g in informative]
        if t_needed is None and len(full) >= needed:
            t_needed = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return dict(seconds=total, tokens=tokens, to_needed=t_needed or total)


def run_inflight(client, lengths, informative, needed, early_stop: bool, tag: str) -> dict:
    reqs = requests(lengths, tag)
    t0 = time.perf_counter()
    client.submit(reqs)
    pending, tokens, per_group, full, t_needed = {r.id for r in reqs}, 0, {}, 0, None
    while pending:
        c = client.next_completion()
        pending.discard(c.id)
        tokens += c.num_tokens
        g = _group_of(c.id)
        per_group[g] = per_group.get(g, 0) + 1
        if per_group[g] == len(lengths[g]) and g in informative:
            full += 1
            if full == needed:
                t_needed = time.perf_counter() - t0
                if early_stop:
                    client.abort(sorted(pending))
                    for _ in range(len(pending)):
                        tokens += client.next_completion().num_tokens
                    pending.clear()
    total = time.perf_counter() - t0
    return dict(seconds=total, tokens=tokens, to_needed=t_needed if early_stop else total)


def make_model(directory: str, vocab: int = 512) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)


def engine_python(engine: str) -> str:
    if engine == "vllm":
        return os.environ.get("NEMO_DAPO_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    return sys.executable


def bench_engine(engine: str, model_dir: str, args, lengths, informative) -> dict:
    tmp = tempfile.mkdtemp(prefix="nemo-dapo-bench-")
    options = {"max_batch_size": args.slots}
    if args.refill_min is not None and engine == "local":
        options["refill_min"] = args.refill_min
    proc = EngineProcess(engine=engine, model_dir=model_dir, address=f"unix:{tmp}/e.sock",
                         python=engine_python(engine), options=options, threads=1,
                         log_path=os.path.join(tmp, "engine.log"),
                         env={"PYTHONPATH": ROOT})
    client = EngineClient(proc.address, name=engine, connect_timeout_s=600, request_timeout_s=600, process=proc)
    out = {"a": [], "b": [], "c": []}
    try:
        run_inflight(client, [g[:1] for g in lengths[:4]], set(), 0, False, "warm")  # first-call costs
        for rep in range(args.repeats):
            out["a"].append(run_static(client, lengths, informative, args.needed, args.slots))
            out["b"].append(run_inflight(client, lengths, informative, args.needed, False, f"b{rep}"))
            out["c"].append(run_inflight(client, lengths, informative, args.needed, True, f"c{rep}"))
            print(f"  {engine} repeat {rep + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1]['seconds']:.1f}s" for k, v in out.items()), flush=True)
    finally:
        proc.stop(client)
    return {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "tokens", "to_needed")}
            for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="local", help="comma list of: local, vllm")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--needed", type=int, default=16, help="informative groups the filler needs (of groups/2)")
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--slots", type=int, default=64, help="sequences decoded together (engine max_batch_size)")
    p.add_argument("--refill-min", type=int, default=None,
                   help="local engine: refill free slots once this many are free (default slots // 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (a smoke run, not a measurement)")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.needed, args.cap, args.slots, args.repeats = 8, 2, 64, 16, 1
    lengths, informative = workload(args.groups, args.group_size, args.cap, args.seed)
    flat = [n for g in lengths for n in g]
    print(f"workload: {len(flat)} responses, mean {statistics.mean(flat):.1f} tokens, median "
          f"{statistics.median(flat):.0f}, {sum(n == args.cap for n in flat)} at the cap {args.cap}; "
          f"{args.slots} in flight; needed {args.needed} of {len(informative)} informative groups")
    model_dir = tempfile.mkdtemp(prefix="nemo-dapo-bench-model-")
    make_model(model_dir)
    results = []
    for engine in args.engines.split(","):
        if not os.path.exists(engine_python(engine)):
            print(f"{engine}: skipped, no interpreter at {engine_python(engine)} "
                  f"(bash scripts/install.sh .venv-vllm engine-vllm)")
            continue
        r = bench_engine(engine, model_dir, args, lengths, informative)
        print(f"\n{engine}: mode | seconds | generated tokens | tokens/s | time to last needed group (s)")
        for k, name in (("a", "static"), ("b", "in flight"), ("c", "streaming")):
            v = r[k]
            print(f"  {name:10s} | {v['seconds']:7.2f} | {v['tokens']:8.0f} | {v['tokens'] / v['seconds']:8.0f} | "
                  f"{v['to_needed']:6.2f}")
        tps = {k: r[k]["tokens"] / r[k]["seconds"] for k in r}
        results.append(f"{engine}_inflight_vs_static={tps['b'] / tps['a']:.2f}x "
                       f"{engine}_stream_time_cut={1 - r['c']['to_needed'] / r['b']['to_needed']:.0%} "
                       f"{engine}_stream_tokens_saved={1 - r['c']['tokens'] / r['b']['tokens']:.0%} "
                       f"{engine}_static_to_needed_vs_stream={r['a']['to_needed'] / r['c']['to_needed']:.2f}x "
                       f"{engine}_tokens_static={r['a']['tokens']:.0f} "
                       f"{engine}_tokens_inflight={r['b']['tokens']:.0f} {engine}_tokens_stream={r['c']['tokens']:.0f}")
    print("RESULT " + " ".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
