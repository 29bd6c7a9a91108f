"""Rule-based rewards without a server, behind NeMo-Aligner's reward-client contract.

NeMo-Aligner's trainers call ``rm.infer_rm(rollout_batch)`` right after generating a batch and collect
``future.result()`` later (rewards [B, 1], identical on every rank of a model-parallel group), so that scoring
overlaps with the next generation. ``LocalRewardClient`` keeps that contract for DAPO's verifier
(``core.reward.RuleReward``: decode, then ``verify_batch``, which fans out to a process pool for large batches):
scoring starts on a background thread, and only the model-parallel source rank scores (like the remote client), the
result being broadcast to the others when ``result()`` is called.

``rollout_batch`` (NeMo-Aligner's names): ``response_tokens`` [B, S] prompt + response from position 0,
``prompt_lengths`` [B], ``response_lengths`` [B] (prompt + response, EOS included), plus ``answers`` list[str]
(the ground truths; ``DAPOPromptDataset`` carries them).

``ClientReward`` turns any such client into the step loop's ``RewardFn``; ``acc`` comes from the client when it
reports it (``LocalRewardClient`` does), else from the sign of the reward.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_dapo.core.reward import RuleReward, default_num_workers

try:  # the ABC NeMo-Aligner's trainers duck-type against; plain object when NeMo-Aligner is absent
    from nemo_aligner.utils.server_utils import FutureResult
except ImportError:  # pragma: no cover - exercised only without NeMo-Aligner
    FutureResult = object

log = logging.getLogger("nemo_dapo")


def _leading_int(value: Optional[str]) -> Optional[int]:
    """``"8"`` / ``"8(x16)"`` / ``"8,7"`` (Slurm's per-node task lists) -> 8; None / unparsable -> None."""
    digits = ""
    for ch in (value or "").strip():
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def ranks_per_node(env: Mapping[str, str]) -> int:
    """Processes of this job on this node: torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per node (srun sets no
    LOCAL_WORLD_SIZE), else 1."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        n = _leading_int(env.get(key))
        if n:
            return n
    return 1


def reward_pool_size(env: Mapping[str, str], cores: int, node_cores: int, max_workers: Optional[int] = None) -> int:
    """Verifier processes for one scoring rank. ``cores``: the CPUs this process may run on (its affinity);
    ``node_cores``: the node's CPUs. Slurm's SLURM_CPUS_PER_TASK is the rank's share when set; an affinity smaller
    than the node means the launcher already bound the rank to its share; otherwise the node's cores are split
    between its ranks. ``max_workers`` caps the pool (each spawned worker re-imports the launcher)."""
    per_task = _leading_int(env.get("SLURM_CPUS_PER_TASK"))
    if per_task:
        n = min(per_task, cores)
    elif cores < node_cores:
        n = cores
    else:
        n = cores // ranks_per_node(env)
    n = max(1, n)
    return n if max_workers is None else max(1, min(n, int(max_workers)))


def _mp_group_and_src():
    """(group, src global rank) of this rank's model-parallel group, or (None, rank) without model parallelism."""
    if not dist.is_initialized():
        return None, 0
    try:
        from nemo_aligner.utils import parallel_state
        group, src = parallel_state.get_model_parallel_group(), parallel_state.get_model_parallel_src_rank()
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return None, dist.get_rank()
    return (group, src) if dist.get_world_size(group) > 1 else (None, dist.get_rank())


def response_of(rollout_batch: dict) -> tuple:
    """(response_ids [B, R], response_mask [B, R]) cut out of NeMo-Aligner's packed ``response_tokens``."""
    tokens = rollout_batch["response_tokens"].cpu()
    p = rollout_batch["prompt_lengths"].cpu().long()
    n = rollout_batch["response_lengths"].cpu().long() - p
    width = max(1, int(n.max())) if len(n) else 1
    idx = p[:, None] + torch.arange(width)[None, :]
    mask = torch.arange(width)[None, :] < n[:, None]
    ids = tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1))
    return torch.where(mask, ids, torch.zeros_like(ids)), mask.float()


class RewardFuture(FutureResult):
    """``result()`` -> rewards [B, 1] float (NeMo-Aligner's RMFutureResult); ``details()`` -> (score, acc, preds)."""

    def __init__(self, future: Optional[Future], batch_size: int, group=None, src: int = 0):
        self._future, self._b, self._group, self._src = future, batch_size, group, src
        self._value = None

    def details(self) -> tuple:
        if self._value is None:
            value = self._future.result() if self._future is not None else None
            if self._group is not None:
                box = [value]
                dist.broadcast_object_list(box, src=self._src, group=self._group)
                value = box[0]
            self._value = value
        return self._value

    def result(self) -> torch.Tensor:
        return self.details()[0].view(-1, 1)


NEMO_AUTO_TOKENIZER = "nemo.collections.common.tokenizers.huggingface.auto_tokenizer"


def nemo_auto_tokenizer_inner(tokenizer):
    """The Hugging Face tokenizer inside NeMo's ``AutoTokenizer`` when ``ids_to_text``, ``ids_to_tokens`` and
    ``tokens_to_text`` are that class's own (not a subclass's), else None."""
    methods = ("ids_to_text", "ids_to_tokens", "tokens_to_text")
    if any(getattr(getattr(type(tokenizer), m, None), "__module__", None) != NEMO_AUTO_TOKENIZER for m in methods):
        return None
    return getattr(tokenizer, "tokenizer", None)


def response_decoder(tokenizer) -> Callable[[torch.Tensor], str]:
    """``decode(ids) -> str`` for one response's token ids (1-D int64 tensor), equal to
    ``tokenizer.ids_to_text(ids.tolist())``.

    NeMo 2.1's ``AutoTokenizer.ids_to_text`` filters special tokens against ``all_special_tokens``, a property the
    Hugging Face tokenizer rebuilds on every read, once per token: 12-20 us a token (3 to 22 special tokens), up to
    0.4 s for one 20k-token response (``benchmarks/response_decode.py``), on the thread that scores while the rank
    trains. For that class (:func:`nemo_auto_tokenizer_inner`) the same steps run here with the special tokens read
    once, when the decoder is made; any other tokenizer keeps its own ``ids_to_text``.
    """
    hf = nemo_auto_tokenizer_inner(tokenizer)
    if hf is None:
        return lambda ids: tokenizer.ids_to_text(ids.tolist())
    special = frozenset(hf.all_special_tokens)

    def decode(ids: torch.Tensor) -> str:
        tokens = hf.convert_ids_to_tokens(ids.tolist())
        return hf.convert_tokens_to_string([t for t in tokens if t not in special])

    return decode


class LocalRewardClient:
    """``infer_rm(rollout_batch) -> RewardFuture`` with DAPO's rule-based verifier (``core.reward``).

    ``tokenizer``: NeMo tokenizer (``ids_to_text`` decodes a response, skipping special tokens); ``mode``: verifier
    mode ("dapo", "tolerant", "math_verify"); ``num_workers``: verifier processes of this rank (default:
    :func:`reward_pool_size` from the process's CPU affinity and the torchrun / Slurm task layout, capped by
    ``max_workers``). ``eos_text`` is stripped from decoded responses when given.
    """

    def __init__(self, tokenizer, *, mode: str = "dapo", num_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, eos_text: Optional[str] = None):
        if num_workers is None:
            num_workers = reward_pool_size(os.environ, default_num_workers(), os.cpu_count() or 1, max_workers)
            log.info("reward verifier pool: %d processes per scoring rank (%d ranks on this node)", num_workers,
                     ranks_per_node(os.environ))
        self.num_workers = int(num_workers)
        self.reward = RuleReward(response_decoder(tokenizer), mode=mode, num_workers=self.num_workers,
                                 eos_text=eos_text)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemo_dapo_reward")

    def score(self, response_ids: torch.Tensor, response_mask: torch.Tensor, answers: Sequence[str]) -> tuple:
        """Synchronous scoring on this rank: (score [B], acc [B], preds)."""
        return self.reward(response_ids, response_mask, list(answers))

    def infer_rm(self, rollout_batch: dict) -> RewardFuture:
        answers = rollout_batch.get("answers")
        if answers is None:
            raise ValueError("LocalRewardClient.infer_rm needs rollout_batch['answers'] (one ground truth per "
                             "response); build prompts with DAPOPromptDataset, which carries them")
        ids, mask = response_of(rollout_batch)
        if len(answers) != ids.shape[0]:
            raise ValueError(f"rollout_batch has {ids.shape[0]} responses but {len(answers)} answers")
        group, src = _mp_group_and_src()
        is_src = group is None or dist.get_rank() == src
        future = self._thread.submit(self.score, ids, mask, list(answers)) if is_src else None
        return RewardFuture(future, ids.shape[0], group, src)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class ClientReward:
    """The step loop's ``RewardFn`` over a reward client with NeMo-Aligner's ``infer_rm`` contract."""

    def __init__(self, client):
        self.client = client

    def __call__(self, response_ids: torch.Tensor, response_mask: torch.Tensor, ground_truths: Sequence[str]):
        n = response_mask.long().sum(-1)
        batch = {"response_tokens": response_ids, "prompt_lengths": torch.zeros_like(n), "response_lengths": n,
                 "answers": list(ground_truths)}
        future = self.client.infer_rm(batch)
        if hasattr(future, "details"):
            score, acc, preds = future.details()
            return score.float(), acc.float(), list(preds)
        score = future.result().view(-1).float().cpu()
        return score, (score > 0).float(), [""] * len(score)


def check_response_decoder(tokenizer, responses: int = 32, length: int = 200, seed: int = 0) -> list:
    """The differences (empty: none) between :func:`response_decoder` and ``tokenizer.ids_to_text`` on random
    responses that mix special tokens in, and whether a NeMo ``AutoTokenizer`` got the fast path."""
    decode = response_decoder(tokenizer)
    problems = []
    if type(tokenizer).__module__ == NEMO_AUTO_TOKENIZER and nemo_auto_tokenizer_inner(tokenizer) is None:
        problems.append("NeMo's AutoTokenizer no longer has the ids_to_text / ids_to_tokens / tokens_to_text that "
                        "response_decoder re-implements: responses are decoded by its slow ids_to_text")
    g = torch.Generator().manual_seed(seed)
    for row in torch.randint(0, int(tokenizer.vocab_size), (responses, length), generator=g):
        fast, slow = decode(row), tokenizer.ids_to_text(row.tolist())
        if fast != slow:
            problems.append(f"response_decoder gives {fast[:60]!r}..., ids_to_text {slow[:60]!r}... for ids "
                            f"{row[:12].tolist()}...")
            break
    return problems


def check_installed_nemo() -> list:
    """:func:`check_response_decoder` on NeMo's installed ``AutoTokenizer`` over a tokenizer trained here."""
    import tempfile

    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    from nemo_dapo.data.tokenizer import save_tokenizer, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        texts = [f"Question: what is {a} + {b}? Answer: {a + b}\n" for a in range(30) for b in range(0, 30, 7)]
        return check_response_decoder(AutoTokenizer(save_tokenizer(train_tokenizer(texts, vocab_size=300), tmp)))


if __name__ == "__main__":  # run by the trainer image's build (containers/Dockerfile)
    import sys

    found = check_installed_nemo()
    print("\n".join(found) or "nemo_dapo.aligner.reward_client: NeMo's AutoTokenizer matches response_decoder")
    sys.exit(1 if found else 0)
