"""The local KV-cached decoders (LocalSampler, LocalEngine) under another transformers (5.x), run INSIDE that venv:

    .venv-vllm/bin/python tests/local/transformers5_worker.py

For a tiny Llama and a tiny Qwen2 (GQA, 2 layers) built with ``nemo_dapo.models.decoder.build_model``, checks against a
cache-free reference (a full forward over prompt + tokens so far at every step, argmax, ``log_softmax``):
  * ``LocalSampler`` greedy on left-padded prompts of different lengths, per-row budgets (rows finish at different
    steps, so the cache is compacted): the same tokens, log-probs within TOL;
  * ``LocalEngine`` greedy with fewer slots than requests (refills, row moves, window shifts): the same;
  * sampled tokens (temperature 1) of both: their log-probs equal a full forward over prompt + response.
Prints one JSON line last; exits 1 when a check fails.
"""
import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import transformers  # noqa: E402

from nemo_dapo.engines.base import Request  # noqa: E402
from nemo_dapo.engines.local import LocalEngine  # noqa: E402
from nemo_dapo.models import kv_cache  # noqa: E402
from nemo_dapo.models.decoder import build_model  # noqa: E402
from nemo_dapo.local.sampler import LocalSampler  # noqa: E402

torch.set_num_threads(1)
VOCAB, PAD, BOS, EOS = 64, 0, 1, 2
TOL = 1e-5
LENGTHS = [1, 4, 9, 6, 2, 7]
BUDGETS = [9, 3, 12, 6, 10, 1]
ENGINE_BUDGETS = [30, 4, 26, 7, 28, 12]  # long enough that the engine's live window shifts (max_seq_len 40)
CONFIGS = {arch: dict(arch=arch, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
           for arch in ("llama", "qwen2")}
RESULTS = {"ok": False, "transformers": transformers.__version__, "layered_cache": kv_cache.LAYERED,
           "tolerance": TOL, "checks": {}, "max_abs_diff": {}, "failures": [], "times_s": {}}


def check(name, ok, detail=""):
    RESULTS["checks"][name] = bool(ok)
    if not ok:
        RESULTS["failures"].append(f"{name}: {detail}"[:2000])


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[BOS] + torch.randint(3, VOCAB, (n - 1,), generator=g).tolist() for n in LENGTHS]


def left_pad(rows):
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), P, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):], mask[i, P - len(r):] = torch.tensor(r), 1
    return ids, mask


@torch.no_grad()
def full_logp(model, ids):
    """log_softmax [T, V] of a cache-free forward over one unpadded sequence."""
    x = torch.tensor([ids])
    return torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].float(), dim=-1)


def reference_greedy(model, prompt, budget):
    seq, toks, lps = list(prompt), [], []
    for _ in range(budget):
        lp = full_logp(model, seq)[-1]
        t = int(lp.argmax())
        toks.append(t), lps.append(float(lp[t])), seq.append(t)
        if t == EOS:
            break
    return toks, lps


def teacher_forced(model, prompt, tokens):
    if not tokens:
        return []
    lp = full_logp(model, list(prompt) + list(tokens))[len(prompt) - 1:-1]
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def max_diff(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def sampler_rows(gen):
    out = []
    for i in range(gen.response_ids.shape[0]):
        n = int(gen.response_mask[i].sum())
        out.append((gen.response_ids[i, :n].tolist(), gen.logprobs[i, :n].tolist()))
    return out


def run_engine(eng, requests):
    for r in requests:
        eng.add(r)
    out, calls = {}, 0
    while eng.has_work() and calls < 10000:
        for c in eng.step():
            out[c.id] = c
        calls += 1
    return out


def check_arch(arch):
    model = build_model(CONFIGS[arch], vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=3).eval()
    P = prompts()
    refs = [reference_greedy(model, p, b) for p, b in zip(P, BUDGETS)]

    # (a) LocalSampler, greedy, left-padded batch, per-row budgets
    t0 = time.perf_counter()
    ids, mask = left_pad(P)
    sampler = LocalSampler(model, eos_id=EOS, pad_id=PAD)
    got = sampler_rows(sampler.generate(ids, mask, max_new_tokens=torch.tensor(BUDGETS), temperature=0.0))
    same = [g[0] == r[0] for g, r in zip(got, refs)]
    check(f"{arch}_sampler_greedy_tokens", all(same), f"rows differ: {[i for i, s in enumerate(same) if not s]}; "
          f"got {[g[0] for g in got]} want {[r[0] for r in refs]}")
    err = max(max_diff(g[1], r[1]) for g, r in zip(got, refs))
    RESULTS["max_abs_diff"][f"{arch}_sampler_greedy_logp"] = err
    check(f"{arch}_sampler_greedy_logp", err <= TOL, f"max |logp - reference| = {err:.3g}")
    # sampled (temperature 1): log-probs of the drawn tokens equal a full forward over prompt + response
    got = sampler_rows(sampler.generate(ids, mask, max_new_tokens=torch.tensor(BUDGETS), temperature=1.0, seed=7))
    err = max(max_diff(g[1], teacher_forced(model, p, g[0])) for g, p in zip(got, P))
    RESULTS["max_abs_diff"][f"{arch}_sampler_sampled_logp"] = err
    check(f"{arch}_sampler_sampled_logp", err <= TOL, f"max |logp - full forward| = {err:.3g}")
    check(f"{arch}_sampler_lengths", all(len(g[0]) == b or (g[0] and g[0][-1] == EOS) for g, b in zip(got, BUDGETS)),
          f"lengths {[len(g[0]) for g in got]} budgets {BUDGETS}")
    RESULTS["times_s"][f"{arch}_sampler"] = round(time.perf_counter() - t0, 3)

    # (b) LocalEngine: 2 slots for 6 requests (greedy) + 2 samples each of 3 seeded requests
    t0 = time.perf_counter()
    eng = LocalEngine(model, eos_id=EOS, pad_id=PAD, max_batch_size=2, max_seq_len=40, steps_per_call=3)
    moves, make_room = [], eng._make_room

    def spy(need_left):
        before = eng._c
        make_room(need_left)
        if eng._rows and eng._c != before:
            moves.append((before, eng._c))
    eng._make_room = spy
    refs = [reference_greedy(model, p, b) for p, b in zip(P, ENGINE_BUDGETS)]
    reqs = [Request(id=f"g{i}", prompt_ids=p, max_new_tokens=b, temperature=0.0)
            for i, (p, b) in enumerate(zip(P, ENGINE_BUDGETS))]
    reqs += [Request(id=f"s{i}", prompt_ids=P[i], n=2, max_new_tokens=10, temperature=1.0, seed=i) for i in range(3)]
    out = run_engine(eng, reqs)
    check(f"{arch}_engine_all_done", sorted(out) == sorted(r.id for r in reqs) and not eng.has_work(),
          f"finished {sorted(out)}")
    greedy = [out[f"g{i}"].samples[0] if f"g{i}" in out else None for i in range(len(P))]
    same = [s is not None and s.token_ids == r[0] for s, r in zip(greedy, refs)]
    check(f"{arch}_engine_greedy_tokens", all(same), f"rows differ: {[i for i, s in enumerate(same) if not s]}; "
          f"got {[s and s.token_ids for s in greedy]} want {[r[0] for r in refs]}")
    err = max(max_diff(s.logprobs, r[1]) for s, r in zip(greedy, refs) if s is not None)
    RESULTS["max_abs_diff"][f"{arch}_engine_greedy_logp"] = err
    check(f"{arch}_engine_greedy_logp", err <= TOL, f"max |logp - reference| = {err:.3g}")
    err = max((max_diff(s.logprobs, teacher_forced(model, P[i], s.token_ids))
               for i in range(3) if f"s{i}" in out for s in out[f"s{i}"].samples), default=float("inf"))
    RESULTS["max_abs_diff"][f"{arch}_engine_sampled_logp"] = err
    check(f"{arch}_engine_sampled_logp", err <= TOL, f"max |logp - full forward| = {err:.3g}")
    check(f"{arch}_engine_window_moved", len(moves) > 0, "the live window never moved (test too short)")
    RESULTS["times_s"][f"{arch}_engine"] = round(time.perf_counter() - t0, 3)


def main():
    t0 = time.perf_counter()
    try:
        for arch in CONFIGS:
            check_arch(arch)
    except Exception:  # noqa: BLE001 - reported in the JSON
        RESULTS["failures"].append(traceback.format_exc()[-4000:])
    RESULTS["times_s"]["total"] = round(time.perf_counter() - t0, 3)
    RESULTS["ok"] = not RESULTS["failures"] and bool(RESULTS["checks"])
    print(json.dumps(RESULTS))
    return 0 if RESULTS["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
