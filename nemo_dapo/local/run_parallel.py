"""Generation on two cores: a ``Generator`` that splits each batch between this process and worker processes.

Why processes and not torch threads: sampling a ~1M-parameter model is a long chain of tiny matmuls, where a second
intra-op thread mostly spins, and on a machine whose other core is busy it made generation 10x slower (measured, see
the report in run.py's README section). Two single-threaded processes each decode half of the rows instead.

The model's parameters are moved to shared memory once; every worker builds the same architecture and points its
parameters at that memory. The optimizer updates the parameters in place, so workers always sample from the current
weights and no refit is needed. Requests are sequential (the trainer waits for the rows), so a worker never reads
weights in the middle of an update. A worker exits when its pipe closes, so a killed trainer leaves no orphans.
"""
from __future__ import annotations

import logging
import signal
from typing import Optional

import torch
import torch.multiprocessing as mp

from nemo_dapo.core.types import Generation
from nemo_dapo.local.sampler import LocalSampler

log = logging.getLogger("nemo_dapo")


def _worker(conn, config, attn_implementation: str, shared: dict, eos_id: int, pad_id: int) -> None:
    # Ctrl-C reaches the whole process group: the trainer decides when to stop (after the current step, see
    # run_dir.StopSignals) and closes the pipe, which ends this worker; a worker dying first would fail that step.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    params = dict(model.named_parameters())
    for name, tensor in shared.items():
        params[name].data = tensor  # alias the trainer's (shared-memory) weights: updates are seen, not copied
    sampler = LocalSampler(model, eos_id=eos_id, pad_id=pad_id)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        args, kwargs = request
        try:
            conn.send(("ok", sampler.generate(*args, **kwargs)))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            conn.send(("error", repr(e)))


class ParallelSampler:
    """``Generator`` over ``processes`` single-threaded processes (this one included) sharing ``model``'s weights.

    Rows are split in contiguous, nearly equal blocks; each block is sampled with the call's seed and its first row's
    index, so every row draws from the same stream whatever the number of processes (``LocalSampler``'s rule).
    ``processes=1`` is the plain in-process sampler.
    """

    def __init__(self, model, *, eos_id: int, pad_id: int, processes: int = 2):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.model, self.eos_id, self.pad_id = model, int(eos_id), int(pad_id)
        self.local = LocalSampler(model, eos_id=eos_id, pad_id=pad_id)
        self._conns, self._procs = [], []
        if processes == 1:
            return
        model.share_memory()
        shared = {name: p.data for name, p in model.named_parameters()}
        ctx = mp.get_context("spawn")  # the trainer has threads (tokenizer, TensorBoard): never fork it
        attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
        for _ in range(processes - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, model.config, attn, shared, self.eos_id, self.pad_id),
                               daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def processes(self) -> int:
        return 1 + len(self._procs)

    def update_weights(self, policy) -> None:
        source = getattr(policy, "model", policy)
        if source is not self.model:
            raise ValueError("ParallelSampler shares the policy's own module; build it from policy.model")

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens, temperature=1.0,
                 top_p=1.0, seed: Optional[int] = None) -> Generation:
        n = prompt_ids.shape[0]
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        if n < 2 or not self._procs:
            return self.local.generate(prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed)
        blocks = [(k * n // self.processes, (k + 1) * n // self.processes) for k in range(self.processes)]
        budget = max_new_tokens
        sent = []
        for k, (lo, hi) in enumerate(blocks[1:], start=1):
            if hi == lo:
                continue
            rows = budget[lo:hi] if isinstance(budget, torch.Tensor) and budget.dim() == 1 else budget
            kwargs = dict(max_new_tokens=rows, temperature=temperature, top_p=top_p, seed=seed, first_row=lo)
            self._conns[k - 1].send(((prompt_ids[lo:hi], prompt_mask[lo:hi]), kwargs))
            sent.append(k)
        lo, hi = blocks[0]
        rows = budget[lo:hi] if isinstance(budget, torch.Tensor) and budget.dim() == 1 else budget
        parts = [self.local.generate(prompt_ids[lo:hi], prompt_mask[lo:hi], max_new_tokens=rows,
                                     temperature=temperature, top_p=top_p, seed=seed, first_row=lo)] if hi > lo else []
        for k in sent:
            try:
                status, result = self._conns[k - 1].recv()
            except (EOFError, ConnectionError) as e:
                raise RuntimeError(
                    f"generation worker {k} died. Workers are started with the spawn method: a script that runs "
                    "training must guard its entry point with `if __name__ == '__main__':`; or set "
                    "rollout.processes=1 to sample in this process only") from e
            if status != "ok":
                raise RuntimeError(f"generation worker {k} failed: {result}")
            parts.append(result)
        return Generation.cat(parts, self.pad_id)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
                conn.close()
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []
