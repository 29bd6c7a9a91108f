"""Answers per second of the rule-based verifier, per mode, one at a time and batched (in-process and pooled).

    python benchmarks/verifier_throughput.py            # 4096 responses (128 for math_verify), 5 repeats
    python benchmarks/verifier_throughput.py --quick    # 256 responses (8 for math_verify), 2 repeats

Responses are synthetic but shaped like policy output: 2k-24k characters of step-by-step reasoning (sentences with
numbers, inline TeX and intermediate "=" results) ending in a final line drawn from: a plain correct answer, a wrong
one, ``$..$``-wrapped, the reference's false negatives (``540.``, ``**540**``, ``\\(540\\)``, boxed only), no answer
(truncated), and in 2% adversarial tails (deep brace nesting, hundreds of "Answer:" lines, a 64 KiB line without
newlines, a 1 MiB response). Ground truths mix integers, fractions, radicals and expressions.

Rows (each timed over the whole response set; median of the repeats, the variants interleaved within a repeat):
  verify         ``[verify(r, g, mode=m) ...]`` in this process
  batch inproc   ``verify_batch(..., num_workers=1)`` in this process
  batch pool     ``verify_batch(..., num_workers=W, in_process_below=0)``: spawned worker processes; the pool is
                 started before timing (its cold start is printed separately)
Ratios are against ``verify`` in "dapo" mode measured in the same run, on wall time and on CPU time (this process
plus its worker processes, from /proc; much less sensitive than wall time to other load on the machine).
Ends with one line ``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

# Keep the top level light: the verifier's worker processes (spawn) import this file before they start.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUND_TRUTHS = ("540", "25", "7", "1012", "\\frac{1}{2}", "\\frac{3}{7}", "3\\sqrt{2}", "2\\pi", "x^2+1",
                 "(1,2)", "-4", "0.75", "\\frac{\\sqrt{3}}{2}", "100", "12", "2024")
WRONG = ("541", "24", "8", "1013", "\\frac{1}{3}", "\\frac{4}{7}", "2\\sqrt{3}", "\\pi", "x^2-1", "(2,1)", "4")
SENTENCES = (
    "Let $x$ be the number of {n} we are looking for.", "Substituting $a = {n}$ gives ${n} + {m} = {s}$.",
    "We compute $\\frac{{{n}}}{{{m}}}$ and simplify.", "So the total is ${n} \\cdot {m} = {p}$.",
    "Hence the remainder modulo {m} is {r}.", "Wait, let me double-check this step.",
    "By the Pythagorean theorem, $a^2 + b^2 = {s}$.", "Therefore $\\sqrt{{{p}}}$ is not an integer.",
    "Now consider the case $n \\geq {m}$.", "This gives us {n} ways in total.",
)


def final_line(rng: random.Random, gt: str) -> str:
    """The end of a response: an answer in one of the formats policies produce, or an adversarial tail."""
    u = rng.random()
    if u < 0.40:
        return f"Answer: {gt}"
    if u < 0.50:
        return f"Answer: ${gt}$"
    if u < 0.70:
        return f"Answer: {rng.choice(WRONG)}"
    if u < 0.75:
        return f"Answer: {gt}."
    if u < 0.80:
        return f"Answer: **{gt}**"
    if u < 0.85:
        return f"The final answer is $\\boxed{{{gt}}}$."
    if u < 0.88:
        return f"Answer: \\({gt}\\)"
    if u < 0.98:
        return "so the next step is to compute the"  # truncated: no answer
    kind = rng.randrange(4)
    if kind == 0:
        return "Answer: " + "\\boxed{" * 5000 + gt + "}" * 4000
    if kind == 1:
        return "\n".join(f"Answer: {rng.choice(WRONG)}" for _ in range(300)) + f"\nAnswer: {gt}"
    if kind == 2:
        return "Answer: " + "".join(rng.choice("${}=\\frac ") for _ in range(65536))
    return "x = " * (1 << 18) + f"\nAnswer: {gt}"  # 1 MiB


def make_response(rng: random.Random, gt: str) -> str:
    target = int(2000 * 12 ** rng.random())  # 2k .. 24k characters, log-uniform
    parts, size = [], 0
    while size < target:
        n, m = rng.randrange(2, 999), rng.randrange(2, 99)
        s = rng.choice(SENTENCES).format(n=n, m=m, s=n + m, p=n * m, r=n % m)
        parts.append(s + ("\n\n" if rng.random() < 0.2 else " "))
        size += len(s) + 1
    return "".join(parts) + "\n\n" + final_line(rng, gt)


def make_data(n: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    gts = [rng.choice(GROUND_TRUTHS) for _ in range(n)]
    return [make_response(rng, g) for g in gts], gts


def children_cpu_seconds() -> float:
    """User + system CPU seconds used so far by this process's live child processes (Linux /proc; 0 elsewhere)."""
    import os
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    try:
        kids = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    except OSError:
        return 0.0
    for pid in kids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def timed(fn):
    """(wall seconds, CPU seconds of this process and its child processes, result)."""
    w0, c0 = time.perf_counter(), time.process_time() + children_cpu_seconds()
    out = fn()
    return time.perf_counter() - w0, time.process_time() + children_cpu_seconds() - c0, out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 responses (8 for math_verify), 2 repeats")
    p.add_argument("--n", type=int, default=4096, help="responses for the rule-based modes")
    p.add_argument("--n-math-verify", type=int, default=128, help="responses for math_verify (it is ~100x slower)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=2, help="pool size for the pooled rows")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.n, args.n_math_verify, args.repeats = 256, 8, 2
    if min(args.n, args.n_math_verify, args.repeats, args.workers) < 1:
        p.error("--n, --n-math-verify, --repeats and --workers must be positive")
    return args


def main():
    args = parse_args()
    from nemo_dapo.core.reward import default_num_workers, shutdown_pools, verify, verify_batch

    modes = ["dapo", "tolerant"] + (["math_verify"] if importlib.util.find_spec("math_verify") else [])
    t0 = time.perf_counter()
    responses, gts = make_data(args.n, args.seed)
    chars = sum(map(len, responses))
    print(f"verifier throughput: {args.n} responses ({chars / args.n / 1000:.1f}k chars mean, "
          f"{chars / 2 ** 20:.0f} MiB; made in {time.perf_counter() - t0:.1f} s), math_verify on the first "
          f"{min(args.n_math_verify, args.n)}; {args.repeats} repeats, medians; pool of {args.workers} workers on "
          f"{default_num_workers()} usable cores" + ("" if "math_verify" in modes else "; math_verify not installed"))
    data = {m: (responses[:args.n_math_verify], gts[:args.n_math_verify]) if m == "math_verify"
            else (responses, gts) for m in modes}
    variants = {}
    for m in modes:
        rs, gs = data[m]
        variants[m, "verify"] = lambda m=m, rs=rs, gs=gs: [verify(r, g, mode=m) for r, g in zip(rs, gs)]
        variants[m, "batch inproc"] = lambda m=m, rs=rs, gs=gs: verify_batch(rs, gs, mode=m, num_workers=1)
        variants[m, "batch pool"] = lambda m=m, rs=rs, gs=gs: verify_batch(rs, gs, mode=m, num_workers=args.workers,
                                                                           in_process_below=0)
    cold, _, _ = timed(lambda: verify_batch(responses[:8], gts[:8], mode="dapo", num_workers=args.workers,
                                            in_process_below=0))  # spawn start-up, paid once per process
    for m in modes:  # warm-up: lazy imports (math_verify pulls in sympy) and the workers' first task
        verify_batch(data[m][0][:4], data[m][1][:4], mode=m, num_workers=args.workers, in_process_below=0)
        verify_batch(data[m][0][:4], data[m][1][:4], mode=m, num_workers=1)
    wall, cpu, verdicts = {k: [] for k in variants}, {k: [] for k in variants}, {}
    for _ in range(args.repeats):
        for k, fn in variants.items():
            w, c, verdicts[k] = timed(fn)
            wall[k].append(w)
            cpu[k].append(c)
    shutdown_pools()
    rate = {k: len(data[k[0]][0]) / statistics.median(v) for k, v in wall.items()}
    cpu_rate = {k: len(data[k[0]][0]) / max(statistics.median(v), 1e-9) for k, v in cpu.items()}
    base = rate["dapo", "verify"]
    print(f"pool cold start (spawn {args.workers} workers + first batch of 8): {cold:.2f} s")
    cpu_base = cpu_rate["dapo", "verify"]
    print(f"{'mode':<12}{'variant':<14}{'answers/s':>11}{'x dapo':>9}{'answers/CPU-s':>15}{'x dapo':>9}"
          f"{'accepted %':>12}{'same verdicts':>15}")
    for (m, v), r in rate.items():
        acc = 100 * statistics.fmean(x.acc for x in verdicts[m, v])
        same = verdicts[m, v] == verdicts[m, "verify"]
        print(f"{m:<12}{v:<14}{r:>11.0f}{r / base:>9.3f}{cpu_rate[m, v]:>15.0f}{cpu_rate[m, v] / cpu_base:>9.3f}"
              f"{acc:>12.1f}{str(same):>15}")
    consistent = all(verdicts[k] == verdicts[k[0], "verify"] for k in variants)
    fields = [f"n={args.n}", f"dapo_answers_per_s={base:.0f}", f"dapo_answers_per_cpu_s={cpu_base:.0f}"]
    for (m, v), r in rate.items():
        if (m, v) != ("dapo", "verify"):
            key = f"{m}_{v.replace(' ', '_')}"
            fields.append(f"{key}_vs_dapo={r / base:.3f} {key}_cpu_vs_dapo={cpu_rate[m, v] / cpu_base:.3f}")
    fields.append(f"verdicts_consistent={'pass' if consistent else 'FAIL'}")
    print("RESULT " + " ".join(fields), flush=True)
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
