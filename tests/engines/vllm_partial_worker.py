"""What partial rollouts need from VLLMEngine, run INSIDE the vLLM venv (see vllm_engine_worker.py):

    .venv-vllm/bin/python tests/engines/vllm_partial_worker.py

An aborted request reports each sample's tokens so far with their log-probs (a prefix of what the same seeded
request draws uninterrupted); resubmitted as prompt + partial response with the remaining budget, a greedy sample
continues exactly as the uninterrupted one, and a sampled continuation's log-probs are transformers' log-probs of
those tokens after prompt + partial. Many resubmitted seeded prompts at once (more prefill than one step takes) run. Prints one JSON line last; exits 1 when a check fails.
"""
import json
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.engines.vllm_engine_worker import RESULTS, TOL, build_model, check, max_diff, reference, run  # noqa: E402
from nemo_dapo.engines.base import Request  # noqa: E402
from nemo_dapo.engines.vllm import VLLMEngine  # noqa: E402

PROMPT, BUDGET, NEVER = [1, 5, 9, 14, 3], 20, []


def partial_of(engine, request, steps):
    engine.add(request)
    for _ in range(steps):
        assert not engine.step(), "finished before the abort"
    (c,) = engine.abort([request.id])
    return c.samples


def checks(tmp):
    model = build_model(seed=4)
    model.save_pretrained(os.path.join(tmp, "m"))
    engine = VLLMEngine(os.path.join(tmp, "m"), max_batch_size=64, max_seq_len=128, kv_cache_gb=0.25, num_threads=1)
    kw = dict(prompt_ids=PROMPT, max_new_tokens=BUDGET, ignore_eos=True)
    full = run(engine, [Request(id="g", n=2, temperature=0.0, **kw)])["g"].samples
    part = partial_of(engine, Request(id="gp", n=2, temperature=0.0, **kw), 4)
    check("greedy_partial", all(s.finish_reason == "aborted" and 0 < len(s.token_ids) < BUDGET
                                and len(s.logprobs) == len(s.token_ids) for s in part), part)
    for k, (f, p) in enumerate(zip(full, part)):
        rest = run(engine, [Request(id=f"gc{k}", prompt_ids=PROMPT + p.token_ids, n=1, temperature=0.0,
                                    max_new_tokens=BUDGET - len(p.token_ids), ignore_eos=True)])[f"gc{k}"].samples[0]
        check(f"greedy_continues_{k}", p.token_ids + rest.token_ids == f.token_ids, (p.token_ids, rest.token_ids))
        RESULTS["max_abs_diff"][f"greedy_logprobs_{k}"] = max_diff(p.logprobs + rest.logprobs, f.logprobs)
    sampled = run(engine, [Request(id="s", n=2, temperature=1.0, seed=11, **kw)])["s"].samples
    part = partial_of(engine, Request(id="sp", n=2, temperature=1.0, seed=11, **kw), 4)
    for k, (f, p) in enumerate(zip(sampled, part)):
        n = len(p.token_ids)
        check(f"sampled_prefix_{k}", 0 < n < BUDGET and p.token_ids == f.token_ids[:n], (p.token_ids, f.token_ids))
        RESULTS["max_abs_diff"][f"sampled_partial_logprobs_{k}"] = max_diff(p.logprobs, f.logprobs[:n])
        prompt = PROMPT + p.token_ids
        rest = run(engine, [Request(id=f"sc{k}", prompt_ids=prompt, n=1, temperature=1.0, seed=20 + k,
                                    max_new_tokens=BUDGET - n, ignore_eos=True)])[f"sc{k}"].samples[0]
        check(f"sampled_budget_{k}", n + len(rest.token_ids) == BUDGET, len(rest.token_ids))
        ref, _ = reference(model, prompt, rest.token_ids, temperature=1.0)
        RESULTS["max_abs_diff"][f"continuation_vs_transformers_{k}"] = max_diff(rest.logprobs, ref)
    # resubmitted groups arrive together: 60 seeded prompts of 100 tokens (6,000 > the CPU step budget of 4,096)
    # once split a prefill, which vLLM's CPU sampler cannot rewind; the adapter keeps prefills whole
    many = [Request(id=f"m{i}", prompt_ids=[(7 * i + j) % 40 + 1 for j in range(100)], n=1, temperature=1.0, seed=i,
                    max_new_tokens=4, ignore_eos=True) for i in range(60)]
    done = run(engine, many)
    check("seeded_prefills_beyond_the_step_budget", sorted(done) == sorted(r.id for r in many) and all(
        len(c.samples[0].token_ids) == 4 for c in done.values()), len(done))
    engine.close()


def main():
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checks(tmp)
        for key, diff in RESULTS["max_abs_diff"].items():
            check(f"tol_{key}", diff < TOL, diff)
    except Exception:  # noqa: BLE001 - reported in the JSON line
        RESULTS["failures"].append(traceback.format_exc())
    RESULTS["ok"] = not RESULTS["failures"]
    print(json.dumps(RESULTS))
    return 0 if RESULTS["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
