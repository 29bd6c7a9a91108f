"""Each benchmark runs end to end in its --quick mode and ends with a well-formed RESULT line.

These check that the benchmarks work, not the performance targets: timings here are meaningless (tiny sizes, shared
machine). Only deterministic quantities are asserted on: simulated response counts (seeded), allocator bytes and
numerical agreement of the fused path with its reference.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(name: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """benchmarks/<name> --quick, its output captured (whatever its exit status)."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), "--quick", *extra],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


def run_quick_output(name: str, *extra: str, timeout: float = 600) -> tuple:
    """Runs benchmarks/<name> --quick; returns the key=value fields of its final RESULT line as strings, and its
    stdout."""
    res = run_benchmark(name, *extra, timeout=timeout)
    assert res.returncode == 0, f"{name} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    lines = res.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), f"{name} did not end with a RESULT line:\n{res.stdout[-3000:]}"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert fields, f"{name}: empty RESULT line"
    return fields, res.stdout


def run_quick(name: str, *extra: str, timeout: float = 600) -> dict:
    """The RESULT fields of ``run_quick_output``."""
    return run_quick_output(name, *extra, timeout=timeout)[0]


def test_dynamic_sampling_waste_quick():
    r = run_quick("dynamic_sampling_waste.py")
    assert r["reference_check"] == "pass"
    for sc in ("hard", "medium", "easy", "drift"):
        # Seeded counts: carry-over and adaptive sizing never generate more per trained response than the reference.
        assert 0 < float(r[f"ours_vs_ref_{sc}"]) < 1.0
        assert 0 < float(r[f"carry_only_vs_ref_{sc}"]) < 1.0
        assert 0 < float(r[f"floor_vs_ref_{sc}"]) <= 1.0
    assert float(r["ours_vs_ref_worst"]) == max(float(r[f"ours_vs_ref_{sc}"]) for sc in ("hard", "medium", "easy",
                                                                                         "drift"))


def test_verifier_throughput_quick():
    r = run_quick("verifier_throughput.py")
    assert r["verdicts_consistent"] == "pass"
    assert float(r["dapo_answers_per_s"]) > 0 and float(r["dapo_answers_per_cpu_s"]) > 0
    for key in ("tolerant_verify", "dapo_batch_inproc", "dapo_batch_pool", "tolerant_batch_pool"):
        assert float(r[f"{key}_vs_dapo"]) > 0 and float(r[f"{key}_cpu_vs_dapo"]) > 0


def test_response_decode_quick():
    # the script exits non-zero when a way of decoding gives other texts than its baseline; NeMo's rows are checked
    # on the real AutoTokenizer in tests/aligner/test_trainer_e2e.py (one NeMo import less here)
    r = run_quick("response_decode.py", "--no-nemo")
    assert r["nemo"] == "no" and float(r["hf_tensor_vs_base_L128"]) > 0 and float(r["hf_list_vs_base_L2048"]) == 1.0


@pytest.mark.parametrize("fresh_rss", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_logprobs_quick(fresh_rss):
    # The fresh-interpreter RSS measurement starts two more interpreters (the slow variant covers it).
    r = run_quick("fused_logprobs.py", *([] if fresh_rss else ["--no-rss"]))
    assert float(r["max_abs_diff"]) < 1e-3  # fp32: fused and reference agree on values and both gradients
    assert 0 < float(r["alloc_ratio"]) < 1.0  # allocator bytes are deterministic: chunking must allocate less
    assert 0 < float(r["alloc_working_ratio"]) < float(r["alloc_ratio"])
    assert float(r["wall_ratio"]) > 0 and float(r["cpu_ratio"]) > 0
    assert (float(r["rss_ratio"]) > 0) if fresh_rss else r["rss_ratio"] == "nan"


@pytest.mark.slow
def test_vocab_parallel_memory_quick():
    if not (BENCHMARKS / "vocab_parallel_memory.py").exists():
        pytest.skip("benchmarks/vocab_parallel_memory.py is not present")
    r = run_quick("vocab_parallel_memory.py", "--hidden", "64", "--vocab", "4096", "--chunks", "128")
    assert any(k.endswith("_time_ratio") for k in r), r


@pytest.mark.slow
def test_rollout_engine_quick():
    r = run_quick("rollout_engine.py", "--engines", "local")
    # The workload is seeded and its lengths imposed (ignore_eos): every mode decodes the same responses, and the
    # early stop generates strictly fewer tokens.
    assert r["local_tokens_static"] == r["local_tokens_inflight"]
    assert 0 < int(r["local_tokens_stream"]) < int(r["local_tokens_inflight"])
    assert r["local_inflight_vs_static"].endswith("x") and float(r["local_inflight_vs_static"][:-1]) > 0


def test_actor_logits_memory_quick():
    r = run_quick("actor_logits_memory.py")
    # bf16 on both sides; the log-probs, entropies and both gradients agree to bf16 rounding
    assert float(r["max_abs_diff"]) < 0.1
    # allocator bytes are deterministic: the hidden-state path never holds the [tokens, V/tp] logits
    assert 0 < float(r["alloc_ratio"]) < 0.5
    # seeded lengths: trimmed, token-budget micro-batches pad less than the mini-batch-maximum split
    assert 1.0 <= float(r["pad_after"]) < float(r["pad_before"])
    assert int(r["microbatches_after"]) <= int(r["microbatches_before"])


def test_state_offload_quick():
    r = run_quick("state_offload.py")
    # the script itself exits non-zero when a round trip changes a byte; the rates are timings (never asserted on)
    assert r["device"] == "cpu" and r["bit_identical"] == "true" and float(r["state_gb"]) > 0.04
    assert float(r["offload_gb_per_s"]) > 0 and float(r["raw_d2h_gb_per_s"]) > 0


@pytest.mark.slow
def test_partial_rollouts_quick(tmp_path):
    # a key that reads the sampler's log-probs (it needs tis_cap, which every run sets) for every run: the
    # re-evaluation below loads the runs' config with it too
    keep_all = "algorithm.reject_logp_diff=10.0"
    r = run_quick("partial_rollouts.py", "--out", str(tmp_path), keep_all)
    assert r["seeds"] == "1" and r["engine"] == "local" and r["linked_runs"] == "0"
    for key in ("discarded_abort", "discarded_suspend"):
        assert 0.0 <= float(r[key]) <= 1.0
    assert float(r["tokens_per_trained_ratio"]) > 0
    # one seed: the per-seed ratio is the ratio of the medians
    assert float(r["s_per_1k_trained_ratio_paired"]) == pytest.approx(float(r["s_per_1k_trained_ratio"]), abs=1e-3)
    for key in ("accuracy_abort", "accuracy_suspend"):
        assert 0.0 <= float(r[key]) <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "suspend_seed1" / "metrics.jsonl").open()]
    logged = [row["actor/rejected"] for row in rows if "actor/rejected" in row]
    assert logged and not any(logged)  # logged by every trained step; a threshold of 10 leaves nothing out
    capped = [row["actor/is_capped"] for row in rows if "actor/is_capped" in row]  # every run sets tis_cap
    assert len(capped) == len(logged) and all(0.0 <= c <= 1.0 for c in capped)
    # --reeval on the same --out: the cached runs' final models on more held-out problems
    e = run_quick("partial_rollouts.py", "--out", str(tmp_path), "--reeval", "24", "--reeval-samples", "2", keep_all)
    assert e["reeval_problems"] == "24" and e["reeval_samples"] == "2" and 0.0 <= float(e["accuracy_base"]) <= 1.0
    abort, suspend = float(e["accuracy_abort"]), float(e["accuracy_suspend"])
    for acc in (abort, suspend):  # avg@2 over 24 problems: a multiple of 1/48 (printed to 4 decimals)
        assert acc * 48 == pytest.approx(round(acc * 48), abs=0.01)
    assert float(e["mean_change"]) == pytest.approx(suspend - abort, abs=2e-4)
    assert e["seed_sd_abort"] == e["seed_sd_suspend"] == "nan"  # one seed has no spread
    assert (tmp_path / "heldout_24.jsonl").read_text().count("\n") == 24
    assert (tmp_path / "suspend_seed1" / "reeval_24_2.json").exists()


def test_partial_rollouts_step_budget_and_validation_curve(tmp_path):
    """--max-steps stops both policies after the same number of updates; trainer.val_every prints the held-out
    accuracy of both after each validated step; --second-override sets a key for the second policy only; a cached run
    of another step budget, or of another second-policy key, is refused."""
    fields, stdout = run_quick_output("partial_rollouts.py", "--out", str(tmp_path), "--max-samples", "100000",
                                      "--max-steps", "2", "--second-override", "eval.n_samples=2",
                                      "trainer.val_every=1")
    assert fields["max_steps"] == "2" and fields["second_override"] == "eval.n_samples=2"
    for policy, n_samples in (("abort", 1), ("suspend", 2)):
        rows = [json.loads(line) for line in (tmp_path / f"{policy}_seed1" / "metrics.jsonl").open()]
        assert max(r["step"] for r in rows if r.get("kind") == "train") == 2
        config = (tmp_path / f"{policy}_seed1" / "config.yaml").read_text()
        assert f"n_samples: {n_samples}\n" in config
    medians = [line for line in stdout.splitlines() if line.startswith("median ")]
    assert len(medians) == 2 and all(float(line.split("actor/approx_kl ")[1].split(")")[0]) >= 0 for line in medians)
    assert all(float(line.split("refit ")[1].split(",")[0]) > 0 for line in medians)  # both policies refit each step
    # abort trains no token of older weights; suspend's, if any, moved a little between sampling and training
    stale = {line.split()[1]: float(line.split("logp mismatch ")[1].split()[0]) for line in medians}
    assert math.isnan(stale["abort"]) and (math.isnan(stale["suspend"]) or 0.0 <= stale["suspend"] < 1.0), medians
    assert all("| left out 0.0% |" in line for line in medians)  # algorithm.reject_logp_diff is off
    curve = [line for line in stdout.splitlines() if line.startswith("held-out after step")]
    assert [line.split()[3] for line in curve] == ["1", "2"], stdout[-3000:]
    for line in curve:  # "... abort A, suspend S, change D +- SE": D is S - A
        a, s, d = (float(line.split(name)[1].split()[0].rstrip(",")) for name in (" abort ", " suspend ", "change "))
        assert d == pytest.approx(s - a, abs=2e-3) and 0.0 <= a <= 1.0
    again = run_benchmark("partial_rollouts.py", "--out", str(tmp_path), "--max-samples", "100000", "--max-steps", "3",
                          timeout=120)
    assert again.returncode != 0 and "ran trainer.max_steps=2, not 3" in again.stdout + again.stderr
    other = run_benchmark("partial_rollouts.py", "--out", str(tmp_path), "--max-samples", "100000", "--max-steps", "2",
                          "--second-override", "eval.n_samples=3", timeout=120)
    assert other.returncode != 0 and "ran eval.n_samples=2, not 3" in other.stdout + other.stderr


def test_update_attribution_quick(tmp_path):
    r = run_quick("update_attribution.py", "--out", str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [row["counters/optimizer_steps"] for row in rows if "counters/optimizer_steps" in row]
    assert int(r["updates"]) == steps[-1] == len(list((tmp_path / "updates").glob("*.pt")))  # one per optimizer step
    assert float(r["probe_start"]) <= 0 and float(r["probe_end"]) <= 0  # mean log-probabilities
    assert float(r["split_residual"]) < 1e-4  # the recorded AdamW steps are the parts' sum (the policy's optimizer)
    # --final on a partial_rollouts-style folder: POLICY_seedN/final_model
    (tmp_path / "sync_seed1").symlink_to(tmp_path / "run", target_is_directory=True)
    f = run_quick("update_attribution.py", "--out", str(tmp_path), "--final")
    assert f["runs_sync"] == "1" and int(f["swapped_over_0.5_sync"]) <= int(f["swapped_over_0.05_sync"]) <= 1


def test_eager_launch_fits_a_line_over_the_layer_count():
    """The CPU has no CUDA graphs: the baseline's fields are nan there, the eager slope a positive time per layer."""
    fields, out = run_quick_output("eager_launch.py")
    assert fields["device"] == "cpu" and 0 < float(fields["eager_ms_per_layer"]) < 100
    assert all(math.isnan(float(fields[k])) for k in ("graph_ms_per_layer", "graph_fixed_ms", "ratio"))
    assert "  2 layers: eager" in out and "  4 layers: eager" in out


def test_gpu_timeslice_says_it_needs_cuda():
    """The CPU has nothing to time-slice: --quick ends with the skip, and a full run refuses (exit 2)."""
    assert run_quick("gpu_timeslice.py") == {"device": "cpu", "skipped": "no_cuda"}
    full = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_timeslice.py")], capture_output=True, text=True,
                          timeout=120)
    assert full.returncode == 2 and full.stdout.strip().endswith("skipped=no_cuda")
