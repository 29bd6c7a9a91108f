"""VLLMEngine against transformers, run INSIDE the vLLM venv (imports torch, vllm, transformers and
nemo_dapo.engines.{base,vllm} only):

    .venv-vllm/bin/python tests/engines/vllm_engine_worker.py [--tied-model DIR]

Builds a tiny Llama (head_dim 32: vLLM's CPU attention rejects 16) with transformers, saves it, serves it with
VLLMEngine and checks: finish reasons, lengths, stop and EOS tokens; the engine's log-probs of its sampled tokens
equal transformers' full-forward log_softmax of the distribution sampled from (temperature, top-k, top-p); seeded
requests are reproducible; greedy n > 1; abort keeps partial samples; sleep / wake; after a perturbed weight update
in two buckets a fixed completion's log-probs follow the NEW model, not the old one; an update while a request runs
(tokens before it follow the old model, after it the new one); wrong names, wrong shapes and an incomplete fused
module raise EngineWeightError naming the tensor. ``--tied-model DIR``: a tied-embedding checkpoint saved by another
transformers version (the pytest wrapper saves one with the main venv's): its log-probs and two weight updates
(named_parameters, state_dict). Prints one JSON line last; exits 1 when a check fails.
"""
import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from nemo_dapo.engines.base import EngineError, EngineWeightError, Request  # noqa: E402
from nemo_dapo.engines.vllm import VLLMEngine  # noqa: E402

VOCAB, BOS, EOS, PAD = 96, 1, 2, 0
# fp32 on both sides; measured max |engine - transformers| here: 1e-6 to 4.3e-6 over runs (2 cores, 1 thread)
TOL = 1e-4
RESULTS = {"ok": False, "checks": {}, "failures": [], "tolerance": TOL, "max_abs_diff": {}, "times_s": {}}


def check(name, cond, detail=""):
    RESULTS["checks"][name] = bool(cond)
    if not cond:
        RESULTS["failures"].append(f"{name}: {detail}")


def build_model(seed=0):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                      initializer_range=0.2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a constant direction in the residual stream: an EOS logit bias (EOS ~5% a step)
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[EOS, 0] = 0.5
    return model


def processed_logprobs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """log_softmax of the distribution vLLM samples from (its apply_top_k_top_p_pytorch, fp32)."""
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_k or top_p < 1.0:
        srt, idx = logits.sort(dim=-1)
        if top_k:
            srt = srt.masked_fill(srt < srt[:, srt.size(1) - top_k].unsqueeze(1), float("-inf"))
        if top_p < 1.0:
            mask = srt.softmax(-1).cumsum(-1) <= 1 - top_p
            mask[:, -1] = False
            srt = srt.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, srt)
    return logits.log_softmax(-1)


def reference(model, prompt, tokens, **sampling):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1:-1]
    lp = processed_logprobs(logits, **sampling)
    return [lp[i, t].item() for i, t in enumerate(tokens)], logits.argmax(-1).tolist()


def max_diff(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) else float("inf")


def run(engine, requests):
    for r in requests:
        engine.add(r)
    out, steps = {}, 0
    while engine.has_work():
        for c in engine.step():
            out[c.id] = c
        steps += 1
        assert steps < 10000, "engine never finished"
    return out


def score(engine, prompt, tokens):
    """The engine's log-probs of a FIXED completion (prompt scoring; test-only access to vLLM's LLMEngine)."""
    from vllm import SamplingParams, TokensPrompt

    llm = engine._engine
    llm.add_request("score", TokensPrompt(prompt_token_ids=list(prompt) + list(tokens)),
                    SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False))
    final = None
    while llm.has_unfinished_requests():
        final = next((o for o in llm.step() if o.finished), final)
    return [final.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(tokens)]


def expect_weight_error(name, engine, named, tensor_name):
    try:
        engine.load_weights(named)
        check(name, False, "no error raised")
    except EngineWeightError as e:
        check(name, e.name == tensor_name and tensor_name in str(e), f"name={e.name!r} message={e}")


def main_checks(tmp):
    model = build_model()
    model.save_pretrained(os.path.join(tmp, "m"))
    t0 = time.time()
    engine = VLLMEngine(os.path.join(tmp, "m"), max_batch_size=64, max_seq_len=128, kv_cache_gb=0.25, num_threads=1)
    RESULTS["times_s"]["engine_start"] = round(time.time() - t0, 2)
    info = engine.info()
    check("info", info["vocab_size"] == VOCAB and info["max_seq_len"] == 128 and info["engine"] == "vllm", info)

    t0 = time.time()  # vLLM's first forward (oneDNN set-up; warm-up is skipped with an explicit KV size) is slow
    run(engine, [Request(id="warm", prompt_ids=[BOS, 3], max_new_tokens=1)])
    RESULTS["times_s"]["first_request"] = round(time.time() - t0, 2)
    g = torch.Generator().manual_seed(1)
    prompts = [[BOS] + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 4, 9, 5, 7)]
    stops = [5, 6]
    settings = [dict(temperature=1.0), dict(temperature=1.0), dict(temperature=0.7, top_k=8),
                dict(temperature=1.2, top_p=0.9), dict(temperature=0.8, top_k=20, top_p=0.8), dict(temperature=1.0)]
    reqs = [Request(id=f"r{i}", prompt_ids=p, n=4, max_new_tokens=24, seed=100 + i, stop_token_ids=stops, **s)
            for i, (p, s) in enumerate(zip(prompts, settings))]
    t0 = time.time()
    out = run(engine, reqs)
    gen_s = time.time() - t0
    ntok = sum(c.num_tokens for c in out.values())
    RESULTS["times_s"]["generate_24x4x6"] = round(gen_s, 2)
    RESULTS["tokens_per_s"] = round(ntok / gen_s, 1)
    check("all_finished", sorted(out) == sorted(r.id for r in reqs), sorted(out))
    reasons, worst = [], 0.0
    for r in reqs:
        c = out[r.id]
        check(f"{r.id}_n", len(c.samples) == 4, len(c.samples))
        sampling = dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
        for k, s in enumerate(c.samples):
            reasons.append(s.finish_reason)
            ends = set(stops) | {EOS}
            inner_ok = not any(t in ends for t in s.token_ids[:-1]) and all(0 <= t < VOCAB for t in s.token_ids)
            if s.finish_reason == "stop":
                ok = inner_ok and s.token_ids[-1] in ends and len(s.token_ids) <= r.max_new_tokens
            else:
                ok = inner_ok and s.finish_reason == "length" and len(s.token_ids) == r.max_new_tokens \
                    and s.token_ids[-1] not in ends
            check(f"{r.id}_{k}_finish", ok, (s.finish_reason, s.token_ids))
            ref, _ = reference(model, r.prompt_ids, s.token_ids, **sampling)
            worst = max(worst, max_diff(s.logprobs, ref))
    RESULTS["max_abs_diff"]["sampled_tokens"] = worst
    check("logprobs_match_transformers", worst < TOL, worst)
    RESULTS["finish_reasons"] = {x: reasons.count(x) for x in set(reasons)}
    check("saw_stop_and_length", {"stop", "length"} <= set(reasons), reasons)
    eos_ended = sum(1 for c in out.values() for s in c.samples if s.token_ids[-1] == EOS)
    RESULTS["eos_ended_samples"] = eos_ended
    check("eos_stops", eos_ended > 0, "no sample ended with EOS (config.json's eos_token_id)")
    check("samples_differ", len({tuple(s.token_ids) for s in out["r0"].samples}) > 1, out["r0"].samples)
    # ignore_eos (benchmarks impose lengths): the model's EOS, frequent in this model, no longer ends a sample
    long = run(engine, [Request(id="ie", prompt_ids=prompts[0], n=4, max_new_tokens=40, seed=3, ignore_eos=True)])
    check("ignore_eos", all(len(s.token_ids) == 40 and s.finish_reason == "length" for s in long["ie"].samples),
          [(len(s.token_ids), s.finish_reason) for s in long["ie"].samples])

    again = run(engine, [Request(id="again", prompt_ids=reqs[0].prompt_ids, n=4, max_new_tokens=24, seed=100,
                                 stop_token_ids=stops)])["again"]
    check("seeded_reproducible", [s.token_ids for s in again.samples] == [s.token_ids for s in out["r0"].samples])

    greedy = run(engine, [Request(id="g", prompt_ids=prompts[1], n=2, max_new_tokens=12, temperature=0.0)])["g"]
    _, argmax = reference(model, prompts[1], greedy.samples[0].token_ids)
    check("greedy_n2", greedy.samples[0].token_ids == greedy.samples[1].token_ids
          and greedy.samples[0].token_ids == argmax[:len(greedy.samples[0].token_ids)], greedy.samples)

    engine.add(Request(id="long", prompt_ids=prompts[2], n=3, max_new_tokens=100, seed=7))
    for _ in range(3):
        engine.step()
    aborted = engine.abort(["long", "unknown"])  # samples that already ended keep their reason
    samples = aborted[0].samples if len(aborted) == 1 else []
    check("abort", len(samples) == 3 and not engine.has_work() and any(s.finish_reason == "aborted" for s in samples)
          and all(len(s.logprobs) == len(s.token_ids) <= 3 for s in samples)
          and all(s.finish_reason == "aborted" or s.token_ids[-1] == EOS for s in samples), aborted)

    engine.sleep(1)
    try:
        engine.step()
        check("step_refused_asleep", False, "step() ran while asleep")
    except EngineError:
        check("step_refused_asleep", True)
    engine.wake()
    check("after_wake", run(engine, [Request(id="w", prompt_ids=prompts[0], max_new_tokens=4, seed=1)])["w"]
          .num_tokens > 0)

    # weight update: perturb, send in two buckets, the fixed completion follows the new model
    fixed = out["r0"].samples[0].token_ids
    old_ref, _ = reference(model, prompts[0], fixed)
    RESULTS["max_abs_diff"]["fixed_before_update"] = max_diff(score(engine, prompts[0], fixed), old_ref)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    named = list(model.named_parameters())
    t0 = time.time()
    engine.load_weights([(n, p.data) for n, p in named[:7]])
    try:
        engine.step()
        check("step_refused_mid_update", False, "step() ran with half the weights loaded")
    except EngineError:
        check("step_refused_mid_update", True)
    engine.load_weights((n, p.data) for n, p in named[7:])
    engine.finish_weights()
    RESULTS["times_s"]["weight_update"] = round(time.time() - t0, 3)
    new_ref, _ = reference(model, prompts[0], fixed)
    new_scored = score(engine, prompts[0], fixed)
    RESULTS["max_abs_diff"]["fixed_after_update_vs_new"] = max_diff(new_scored, new_ref)
    RESULTS["max_abs_diff"]["fixed_after_update_vs_old"] = max_diff(new_scored, old_ref)
    check("fixed_before_update_matches", RESULTS["max_abs_diff"]["fixed_before_update"] < TOL)
    check("update_follows_new_model", RESULTS["max_abs_diff"]["fixed_after_update_vs_new"] < TOL)
    check("update_left_old_model", RESULTS["max_abs_diff"]["fixed_after_update_vs_old"] > 100 * TOL)
    post = run(engine, [Request(id="post", prompt_ids=prompts[3], n=4, max_new_tokens=16, seed=3, top_k=10)])["post"]
    worst = max(max_diff(s.logprobs, reference(model, prompts[3], s.token_ids, top_k=10)[0]) for s in post.samples)
    RESULTS["max_abs_diff"]["sampled_after_update"] = worst
    check("sampled_after_update_match", worst < TOL, worst)

    # an update while a request runs: its KV is recomputed; later tokens follow the new weights
    engine.add(Request(id="inflight", prompt_ids=prompts[4], n=2, max_new_tokens=16, seed=11))
    for _ in range(4):
        engine.step()
    before = [len(t) for t in engine._live["inflight"][0]]
    old_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    engine.load_weights([(n, p.data) for n, p in model.named_parameters()])
    engine.finish_weights()
    done = run(engine, [])["inflight"]
    gaps = []
    for s, b in zip(done.samples, before):
        old_lp, _ = reference(old_model, prompts[4], s.token_ids)
        new_lp, _ = reference(model, prompts[4], s.token_ids)
        gaps += [max_diff(s.logprobs[:b], old_lp[:b]), max_diff(s.logprobs[b:], new_lp[b:])]
    RESULTS["max_abs_diff"]["inflight_update"] = max(gaps)
    RESULTS["inflight_tokens_before_update"] = before
    check("inflight_update", max(gaps) < TOL and all(len(s.token_ids) <= 16 for s in done.samples)
          and all(0 < b < len(s.token_ids) or s.finish_reason == "stop" for s, b in zip(done.samples, before)),
          (gaps, before, done.samples))
    try:
        engine.add(Request(id="bad", prompt_ids=[BOS, 3], temperature=3.0))  # vLLM allows temperature <= 2
        check("bad_request_rejected", False, "temperature 3 accepted")
    except EngineError as e:
        check("bad_request_rejected", "bad" in str(e) and not engine.has_work(), str(e))

    q = "model.layers.0.self_attn.q_proj.weight"
    typo = "model.layers.0.self_attn.q_projection.weight"
    expect_weight_error("unknown_name", engine, [(typo, model.lm_head.weight)], typo)
    expect_weight_error("wrong_shape", engine, [(q, torch.zeros(3, 64))], q)
    check("usable_after_rejections", run(engine, [Request(id="ok", prompt_ids=prompts[0], max_new_tokens=3)])
          ["ok"].num_tokens > 0)
    sd = dict(model.named_parameters())
    engine.load_weights([(q, sd[q].data)])  # q without k and v: vLLM would leave k, v uninitialised
    try:
        engine.finish_weights()
        check("incomplete_module", False, "finish_weights accepted q_proj without k_proj / v_proj")
    except EngineWeightError as e:
        check("incomplete_module", e.name == "model.layers.0.self_attn.k_proj.weight" and "qkv_proj" in str(e),
              f"name={e.name!r} message={e}")
    try:
        engine.add(Request(id="x", prompt_ids=[BOS, 3]))
        check("broken_engine_refuses", False, "accepted work after an inconsistent update")
    except EngineError:
        check("broken_engine_refuses", True)
    engine.close()


def tied_checks(directory):
    """A tied-embedding checkpoint saved by another transformers version: loads, matches, takes lm_head.weight."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    engine = VLLMEngine(directory, max_batch_size=16, max_seq_len=96, kv_cache_gb=0.25, num_threads=1, name="tied")
    prompt = [BOS, 7, 8, 9]
    c = run(engine, [Request(id="t", prompt_ids=prompt, n=2, max_new_tokens=16, seed=4)])["t"]
    worst = max(max_diff(s.logprobs, reference(model, prompt, s.token_ids)[0]) for s in c.samples)
    fixed, after = c.samples[0].token_ids, []
    for source in ("named_parameters", "state_dict"):  # embed_tokens only / embed_tokens and its lm_head alias
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * p.std() * torch.randn_like(p))
        named = model.state_dict().items() if source == "state_dict" else model.named_parameters()
        engine.load_weights([(n, t.data) for n, t in named])
        engine.finish_weights()
        after.append(max_diff(score(engine, prompt, fixed), reference(model, prompt, fixed)[0]))
    RESULTS["max_abs_diff"].update(tied_sampled=worst, tied_after_update=max(after))
    check("tied_logprobs_match", worst < TOL, worst)
    check("tied_update_follows_new_model", max(after) < TOL, after)
    engine.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tied-model", default=None, help="a tied-embedding checkpoint saved by another transformers")
    args = ap.parse_args()
    try:
        import transformers
        import vllm

        RESULTS["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                               "transformers": transformers.__version__}
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            main_checks(tmp)
        if args.tied_model:
            tied_checks(args.tied_model)
        RESULTS["times_s"]["total"] = round(time.time() - t0, 1)
    except Exception:  # noqa: BLE001 - reported in the JSON
        RESULTS["failures"].append("exception: " + traceback.format_exc()[-3000:])
    RESULTS["ok"] = not RESULTS["failures"]
    print(json.dumps(RESULTS), flush=True)
    return 0 if RESULTS["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
