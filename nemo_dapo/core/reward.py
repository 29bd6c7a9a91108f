"""Rule-based reward for math answers: a per-answer verifier, a multi-core batch API and a ``RewardFn``.

Modes (see ``answer_normalize`` for the exact rules):
  * ``"dapo"``        the reference ``math_dapo`` verifier, false negatives included; use it to compare with
                      published DAPO numbers.
  * ``"tolerant"``    also accepts ``540.``, ``540.0``, ``**540**``, ``\\(540\\)``, ``0540`` and a final ``\\boxed{}``
                      but never a different value or an answer buried mid-text.
  * ``"math_verify"`` symbolic comparison by the optional ``math-verify`` package. Its timeouts rely on
                      ``signal.alarm``, which works only in a process's main thread, so off the main thread and for
                      batches it runs in worker processes.
Score is +1.0 for a correct answer and -1.0 otherwise (the reference's reward range); ``acc`` is the unshaped 0/1
correctness used by the dynamic-sampling filter and by validation metrics.

Ground truths are normalised by the same rules as predictions, but nothing repairs the data itself: a ground truth
``'025'`` never equals the prediction ``25`` in ``"dapo"`` mode (loaders should store AIME answers as ``str(int(x))``).
Each distinct ground truth of a batch is normalised once (a group repeats it G times), and one longer than
``answer_normalize.MAX_GROUND_TRUTH_CHARS`` is never normalised at all (it cannot equal any prediction).
"""
from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from nemo_dapo.core import answer_normalize

MODES = ("dapo", "tolerant", "math_verify")
# Below these batch sizes scoring in-process beats handing work to the pool (rule modes run ~10^4-10^5 answers/s).
IN_PROCESS_BELOW = {"dapo": 2048, "tolerant": 2048, "math_verify": 4}


class Verdict(NamedTuple):
    score: float  # +1.0 correct, -1.0 wrong or no answer found
    acc: bool
    pred: str  # the normalised prediction ("[INVALID]" when no answer was found)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"verifier mode={mode!r} is not one of {MODES}")
    if mode == "math_verify" and importlib.util.find_spec("math_verify") is None:
        raise ModuleNotFoundError(
            "verifier mode='math_verify' needs the math-verify package: `pip install math-verify` "
            "(or the nemo_dapo[verify] extra), or choose mode='dapo' or 'tolerant'")


def _check_texts(name: str, values: Sequence) -> None:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}] must be str, got {type(v).__name__}; convert ground truths with str() "
                            "when loading the data and decode token ids before verifying")


def _verdict(ok: bool, pred: str) -> Verdict:
    return Verdict(1.0 if ok else -1.0, bool(ok), pred)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def verify(response: str, ground_truth: str, *, mode: str = "dapo") -> Verdict:
    """Score one decoded response against its ground-truth answer string."""
    _check_mode(mode)
    _check_texts("response", [response])
    _check_texts("ground_truth", [ground_truth])
    if mode == "math_verify" and not _in_main_thread():
        return verify_batch([response], [ground_truth], mode=mode)[0]  # signal-based timeouts need a main thread
    return _verdict(*answer_normalize.MATCHERS[mode](response, ground_truth))


# ---------------------------------------------------------------------------------------------------------------
# Batch scoring over a persistent process pool
# ---------------------------------------------------------------------------------------------------------------

_POOLS: dict = {}
_POOL_LOCK = threading.Lock()


def default_num_workers() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _pool(num_workers: int) -> ProcessPoolExecutor:
    """The persistent pool for this worker count (started on first use, so start-up is paid once per process).

    Spawn, not fork: the trainer runs torch/NCCL threads, and forking a threaded process can deadlock the child.
    As with any spawned process, each worker imports the main script once (keep its top level light and guarded).
    """
    with _POOL_LOCK:
        pool = _POOLS.get(num_workers)
        if pool is None:
            pool = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"))
            _POOLS[num_workers] = pool
        return pool


def shutdown_pools() -> None:
    """Stop the verifier worker processes (they are restarted on the next pooled call)."""
    with _POOL_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


atexit.register(shutdown_pools)


def _chunk_bounds(ground_truths: list, size: int) -> list:
    """[(start, end)] of chunks of about ``size`` items whose cuts never split a run of equal ground truths (a
    group), so each worker normalises a group's ground truth once."""
    n, bounds, a = len(ground_truths), [], 0
    while a < n:
        b = min(a + size, n)
        while b < n and ground_truths[b] == ground_truths[b - 1]:
            b += 1
        bounds.append((a, b))
        a = b
    return bounds


def _score_in_pool(mode: str, responses: list, ground_truths: list, num_workers: int) -> list:
    n = len(responses)
    size = max(1, -(-n // (4 * num_workers)))  # ~4 chunks per worker evens out slow answers
    bounds = _chunk_bounds(ground_truths, size)
    try:
        chunks = _pool(num_workers).map(answer_normalize.match_many, [mode] * len(bounds),
                                        [responses[a:b] for a, b in bounds],
                                        [ground_truths[a:b] for a, b in bounds])
        return [r for chunk in chunks for r in chunk]
    except BrokenProcessPool as e:
        with _POOL_LOCK:
            _POOLS.pop(num_workers, None)
        raise RuntimeError(
            "a verifier worker process died (out of memory or killed?); the pool was dropped and the next call "
            "starts a fresh one. If the script that called verify_batch has no `if __name__ == '__main__':` "
            "guard, add one: worker processes import the main script") from e


def verify_batch(responses: Sequence[str], ground_truths: Sequence[str], *, mode: str = "dapo",
                 num_workers: Optional[int] = None, in_process_below: Optional[int] = None) -> list:
    """``[verify(r, g, mode=mode) for r, g in zip(responses, ground_truths)]``, using up to ``num_workers`` cores.

    Results keep the input order. Batches smaller than ``in_process_below`` (default ``IN_PROCESS_BELOW[mode]``)
    or ``num_workers <= 1`` are scored in this process, except ``math_verify`` off the main thread, which always
    goes to a worker. ``num_workers`` defaults to the cores available to this process.
    """
    _check_mode(mode)
    if len(responses) != len(ground_truths):
        raise ValueError(f"verify_batch got {len(responses)} responses but {len(ground_truths)} ground_truths; "
                         "pass one ground truth per response (repeat it group_size times)")
    responses, ground_truths = list(responses), list(ground_truths)
    _check_texts("responses", responses)
    _check_texts("ground_truths", ground_truths)
    # Every mode reads only the tail of a response; shipping whole responses to workers cost more than scoring them.
    responses = [r[-answer_normalize.ANSWER_TAIL_CHARS:] for r in responses]
    workers = default_num_workers() if num_workers is None else int(num_workers)
    if workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1 (or None for all available cores)")
    threshold = IN_PROCESS_BELOW[mode] if in_process_below is None else in_process_below
    needs_worker = mode == "math_verify" and not _in_main_thread()
    if not needs_worker and (workers == 1 or len(responses) < threshold):
        results = answer_normalize.match_many(mode, responses, ground_truths)
    else:
        results = _score_in_pool(mode, responses, ground_truths, workers)
    return [_verdict(ok, pred) for ok, pred in results]


# ---------------------------------------------------------------------------------------------------------------
# RewardFn over token ids
# ---------------------------------------------------------------------------------------------------------------

class RuleReward:
    """``RewardFn`` (see ``types.py``): decodes each response's valid tokens and verifies it.

    ``decode(ids) -> str`` gets one response's kept token ids as a 1-D int64 tensor and should skip special
    tokens, as the reference does; ``eos_text``, when given, is stripped from the end of the decoded text (the
    reference strips a trailing EOS string). A tensor rather than a list: a Hugging Face tokenizer's ``decode``
    turns a tensor into a list in one call but checks a list element by element, 30x slower on long responses
    (``benchmarks/response_decode.py``).
    """

    def __init__(self, decode: Callable[[torch.Tensor], str], *, mode: str = "dapo", num_workers: Optional[int] = None,
                 eos_text: Optional[str] = None):
        _check_mode(mode)
        self.decode, self.mode, self.num_workers, self.eos_text = decode, mode, num_workers, eos_text

    def decode_responses(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list:
        """[B] strings from ``response_ids`` [B, R] restricted to ``response_mask`` [B, R] != 0."""
        if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
            raise ValueError(f"response_ids {tuple(response_ids.shape)} and response_mask "
                             f"{tuple(response_mask.shape)} must both be [B, R]")
        keep = response_mask.bool()
        texts = [self.decode(response_ids[b][keep[b]]) for b in range(response_ids.shape[0])]
        if self.eos_text:
            texts = [t[:-len(self.eos_text)] if t.endswith(self.eos_text) else t for t in texts]
        return texts

    def __call__(self, response_ids: torch.Tensor, response_mask: torch.Tensor,
                 ground_truths: Sequence[str]) -> tuple:
        """(score [B] float32 in {+1, -1}, acc [B] float32 in {0, 1}, preds list[str] of length B)."""
        if len(ground_truths) != response_ids.shape[0]:
            raise ValueError(f"RuleReward got {response_ids.shape[0]} responses but {len(ground_truths)} "
                             "ground_truths; pass one per response row")
        texts = self.decode_responses(response_ids, response_mask)
        verdicts = verify_batch(texts, ground_truths, mode=self.mode, num_workers=self.num_workers)
        score = torch.tensor([v.score for v in verdicts], dtype=torch.float32)
        acc = torch.tensor([float(v.acc) for v in verdicts], dtype=torch.float32)
        return score, acc, [v.pred for v in verdicts]
