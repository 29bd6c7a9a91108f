"""``MegatronPolicy``: the ``Policy`` protocol of core/types.py on a megatron-core GPTModel (TP, PP, EP, DP).

Every rank of a data-parallel (DP) replica calls ``logprobs`` / ``train_step`` with the same batch (the loop's DP
share; the ranks of one TP/PP group must see identical data). Micro-batches go through megatron's
``get_forward_backward_func`` schedule; gradients are reduced by megatron's DDP (``finalize_model_grads``).

Sequence packing: megatron's RoPE numbers positions 0..S-1 whatever the position ids say, so left-padded prompts
would shift every position by the padding. Each row is therefore re-packed left-aligned,
``[prompt tokens, response tokens, padding]``, which gives every real token its true position and lets a plain causal
mask stand in for the padding mask (padding only ever comes after the real tokens). The response token t of row b is
predicted by the output at position ``prompt_len[b] - 1 + t``; only those positions go through the output layer.

Log-prob and entropy come from the final hidden states and the vocabulary-parallel output weight through
``vocab_parallel.vocab_parallel_logprobs_entropy`` (no [tokens x vocab] logits, no vocabulary gather).

Loss scaling: ``loss_fn`` returns each micro-batch's contribution to the mini-batch loss (global ``num_tokens``);
``reduction.megatron_loss_scale`` undoes the schedule's and DDP's averaging (see reduction.py).

Collectives inside the forward (MoE all-to-all, pipeline sends) need every DP rank to run the same number of
micro-batches: the count is agreed by an all-reduce (max) and short ranks add fully masked rows. A rank without any
sample (``minibatch=None``) must still call ``train_step`` / ``logprobs``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import fields, replace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from nemo_dapo.core.metrics import combine_metrics
from nemo_dapo.core.packing import pack_rows, response_positions
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.megatron.convert import hf_arch
from nemo_dapo.megatron.model import unwrap
from nemo_dapo.megatron.reduction import (agreed_microbatches, from_last_pipeline_stage, megatron_loss_scale,
                                          scale_for_schedule)
from nemo_dapo.megatron.refit_hf import hf_weight_buckets, layer_spec_name
from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logprobs_entropy


_OPTIONAL = ("engine_logp", "old_logp", "rewards", "acc", "advantages")


def blank_rows(like: Optional[RolloutBatch], n: int) -> RolloutBatch:
    """``n`` fully masked rows shaped like ``like`` (1 pad prompt token, no response token), with the same optional
    fields present (zeros) and absent. Without ``like`` every optional field is present: on fully masked rows every
    loss term and metric share is 0, so zeros are harmless, and any loss function finds what it reads."""
    p = like.prompt_ids.shape[1] if like is not None else 1
    r = like.response_ids.shape[1] if like is not None else 1
    pad = like.pad_id if like is not None else 0
    prompt_mask = torch.zeros(n, p, dtype=torch.long)
    prompt_mask[:, -1] = 1  # one "real" (pad) prompt token keeps the packing arithmetic valid
    kw = dict(prompt_ids=torch.full((n, p), pad, dtype=torch.long), prompt_mask=prompt_mask,
              response_ids=torch.full((n, r), pad, dtype=torch.long), response_mask=torch.zeros(n, r),
              group_ids=torch.full((n,), -1, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool),
              engine_logp=torch.zeros(n, r), old_logp=torch.zeros(n, r), rewards=torch.zeros(n),
              acc=torch.zeros(n), advantages=torch.zeros(n))
    if like is not None:
        for name in kw:
            v = getattr(like, name)
            if name in _OPTIONAL:
                kw[name] = None if v is None else torch.zeros((n,) + tuple(v.shape[1:]), dtype=v.dtype)
            else:
                kw[name] = kw[name].to(v.dtype)
    return RolloutBatch(**kw, pad_id=pad)


def pack_left_aligned(mb: RolloutBatch, seq_len: int) -> dict:
    """Tensors of one micro-batch in the left-aligned layout (module doc).

    Returns tokens [b, seq_len] long; pred_pos [b, R] long: the position whose output predicts response token t;
    targets [b, R] long (padding ids replaced by 0); mask [b, R] bool.
    """
    b, p = mb.prompt_ids.shape
    r = mb.response_ids.shape[1]
    plen = mb.prompt_mask.long().sum(-1)
    if not torch.equal(mb.prompt_mask.bool(), torch.arange(p)[None, :].to(plen) >= (p - plen)[:, None]):
        raise ValueError("prompt_mask must be LEFT-padded (zeros then ones in every row); see core/types.py")
    mask = mb.response_mask > 0
    if bool((mask.any(-1) & (plen == 0)).any()):
        raise ValueError("a row with response tokens has an empty prompt; its first token has no position to be "
                         "predicted from (prepend a BOS token)")
    if int(plen.max()) + r > seq_len:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest packed row ({int(plen.max()) + r})")
    tokens = pack_rows(mb.prompt_ids, plen, mb.response_ids, mb.pad_id, seq_len)
    pred_pos = response_positions(plen, r, -1).clamp(min=0)
    targets = torch.where(mask, mb.response_ids, torch.zeros_like(mb.response_ids))
    return dict(tokens=tokens, pred_pos=pred_pos, targets=targets, mask=mask)


@contextlib.contextmanager
def hidden_states_only(model):
    """Make the last stage's GPTModel return its final hidden states [S(/tp with SP), b, H] instead of logits:
    both 0.10.0 and 0.16.1 return them when ``post_process`` is False (the final norm belongs to the decoder and
    still runs). ``model`` may be wrapped (DDP, Float16Module: the latter casts them to fp32 on the last stage)."""
    inner = unwrap(model)
    saved = inner.post_process
    inner.post_process = False
    try:
        yield
    finally:
        inner.post_process = saved


def output_weight(model) -> torch.Tensor:
    """The last stage's output-layer weight shard [V/tp, H] (the shared embedding weight when tied)."""
    inner = unwrap(model)
    return inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights \
        else inner.output_layer.weight


def hidden_logprobs_entropy(model, hidden: torch.Tensor, targets: torch.Tensor, *,
                            positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                            chunk_size: int = 1024, temperature: float = 1.0,
                            valid_vocab: Optional[int] = None) -> tuple:
    """fp32 (logp, entropy) [b, T] of ``targets`` [b, T] from the final hidden states of ``model``'s last stage.

    hidden [S, b, H] ([S/tp, b, H] with sequence parallelism: gathered here, and the gather's backward
    reduce-scatter sums the TP partial gradients, so the log-prob backward does not all-reduce them again).
    Target t of row b is predicted at ``positions[b, t]`` (default: position t, i.e. T <= S). ``mask`` [b, T]:
    only positions with mask != 0 are computed (the others are 0). The logits never exist beyond one chunk of
    ``chunk_size`` tokens x V/tp (vocab_parallel.vocab_parallel_logprobs_entropy)."""
    inner = unwrap(model)
    sp = bool(inner.config.sequence_parallel)
    if sp:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    weight = output_weight(inner)
    h = hidden.transpose(0, 1).to(weight.dtype)  # Float16Module hands fp32 copies of bf16 values: exact cast back
    if positions is None:
        h = h[:, :targets.shape[1]]
    else:
        h = h.gather(1, positions[..., None].expand(*positions.shape, h.shape[-1]))
    return vocab_parallel_logprobs_entropy(h, weight, targets, mask=mask, chunk_size=chunk_size,
                                           temperature=temperature, reduce_grad_hidden=not sp,
                                           valid_vocab=valid_vocab)


class MegatronPolicy:
    """The trainable megatron-core model behind the ``Policy`` protocol.

    ``model``: this rank's GPTModel (wrapped here in megatron's DDP unless it already is). ``optimizer``: a torch
    optimizer over its parameters (fp32 parameters; the policy clips gradients and skips non-finite updates
    itself) or a megatron ``MegatronOptimizer`` built over the DDP model (it clips with its own config).
    ``micro_batch_size``: rows per micro-batch. ``max_grad_norm``: global gradient-norm clip (None: off).
    ``temperature``: logits are divided by it (use the sampling temperature). ``chunk_size``: tokens per chunk
    of the fused log-prob/entropy. ``hf_config``: the Hugging Face config the model was built from (see
    ``convert_build``), needed by :meth:`hf_weight_buckets`. ``valid_vocab`` (default: ``hf_config.vocab_size``
    when given): the rows that pad the output layer beyond it are left out of the log-prob softmax, as the engine
    that receives the HF-shaped weights leaves them out (None: every row counts). ``hf_spec``: its layer spec for the name map (``"local"`` / ``"te"``; default: read from the
    model's parameter names).
    """

    def __init__(self, model, optimizer, *, micro_batch_size: int, max_grad_norm: Optional[float] = 1.0,
                 temperature: float = 1.0, chunk_size: int = 1024, hf_config=None, hf_spec: Optional[str] = None,
                 valid_vocab: Optional[int] = None):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
            raise NotImplementedError("MegatronPolicy runs one model chunk per rank (no virtual pipeline stages)")
        inner = unwrap(model)
        if getattr(inner.config, "mtp_num_layers", None):
            raise NotImplementedError("multi-token-prediction layers are not supported by MegatronPolicy")
        if not isinstance(model, DistributedDataParallel):
            model = DistributedDataParallel(inner.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                            inner)
        inner.config.finalize_model_grads_func = finalize_model_grads
        inner.config.no_sync_func = model.no_sync
        self.model, self.inner, self.optimizer = model, inner, optimizer
        self.micro_batch_size, self.max_grad_norm = int(micro_batch_size), max_grad_norm
        self.temperature, self.chunk_size = float(temperature), int(chunk_size)
        self.device = next(inner.parameters()).device
        self._megatron_optimizer = isinstance(optimizer, MegatronOptimizer)
        self.hf_config = hf_config
        if valid_vocab is None and hf_config is not None:
            valid_vocab = int(hf_config.vocab_size)
        self.valid_vocab = valid_vocab
        if hf_config is not None:
            hf_arch(hf_config)  # refuse an unsupported family now, not at the first refit
            hf_spec = hf_spec or layer_spec_name(inner)
        self.hf_spec = hf_spec

    # ---- batching ------------------------------------------------------------------------------------------------
    def _microbatches(self, batch: Optional[RolloutBatch]) -> tuple:
        """([(micro-batch, packed tensors)], seq_len, real rows): every DP rank gets the same number of
        micro-batches of ``micro_batch_size`` rows, the last ones completed with blank rows."""
        rows = len(batch) if batch is not None else 0
        mbs = self.micro_batch_size
        n = agreed_microbatches(math.ceil(rows / mbs))
        if rows == 0:
            padded = blank_rows(None, n * mbs)
        elif n * mbs > rows:
            padded = RolloutBatch.cat([batch, blank_rows(batch, n * mbs - rows)])
        else:
            padded = batch
        padded = replace(padded, **{f.name: getattr(padded, f.name).to(self.device) for f in fields(padded)
                                    if isinstance(getattr(padded, f.name), torch.Tensor)})
        seq_len = int(padded.prompt_mask.long().sum(-1).max()) + padded.response_ids.shape[1]
        if self.inner.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            seq_len = -(-seq_len // tp) * tp
        out = []
        for i in range(n):
            mb = padded.select(slice(i * mbs, (i + 1) * mbs))
            out.append((mb, pack_left_aligned(mb, seq_len)))
        return out, seq_len, rows

    # ---- forward ---------------------------------------------------------------------------------------------------
    def _logp_entropy(self, hidden: torch.Tensor, packed: dict) -> tuple:
        """hidden [S(/tp with SP), b, H] -> fp32 (logp [b, R], entropy [b, R]), 0 on padding."""
        return hidden_logprobs_entropy(self.inner, hidden, packed["targets"], positions=packed["pred_pos"],
                                       mask=packed["mask"], chunk_size=self.chunk_size,
                                       temperature=self.temperature, valid_vocab=self.valid_vocab)

    def _run(self, micro, seq_len: int, loss_func_of, *, forward_only: bool) -> list:
        def forward_step(data_iterator, model):
            mb, packed = next(data_iterator)
            s = packed["tokens"].shape[1]
            pos = torch.arange(s, device=self.device).expand_as(packed["tokens"])
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=self.device), 1).view(1, 1, s, s)
            with hidden_states_only(model):
                out = model(packed["tokens"], pos, causal)
            return out, lambda hidden: loss_func_of(hidden, mb, packed)

        return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro),
                                           model=[self.model], num_microbatches=len(micro), seq_length=seq_len,
                                           micro_batch_size=self.micro_batch_size, forward_only=forward_only)

    @torch.no_grad()
    def logprobs(self, batch: Optional[RolloutBatch]) -> tuple:
        """(log-prob [B, R], entropy [B, R]) fp32 of the response tokens, 0 on padding, on every rank."""
        self.model.eval()
        micro, seq_len, rows = self._microbatches(batch)

        def loss_func(hidden, mb, packed):
            logp, ent = self._logp_entropy(hidden, packed)
            return hidden.new_zeros(()), {"logp": logp, "entropy": ent}

        stored = self._run(micro, seq_len, loss_func, forward_only=True)
        width = micro[0][0].response_ids.shape[1]
        if parallel_state.is_pipeline_last_stage():
            out = torch.stack([torch.cat([m[k] for m in stored]).float() for k in ("logp", "entropy")])
        else:
            out = torch.empty(2, len(micro) * self.micro_batch_size, width, device=self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        dev = batch.response_mask.device if batch is not None else torch.device("cpu")
        return out[0, :rows].to(dev), out[1, :rows].to(dev)

    # ---- update ----------------------------------------------------------------------------------------------------
    def train_step(self, minibatch: Optional[RolloutBatch], *, num_tokens: float, loss_fn) -> dict:
        """One optimizer update; ``num_tokens`` is the GLOBAL normaliser of ``loss_fn`` for this mini-batch."""
        self.model.train()
        self._zero_grad()
        micro, seq_len, _ = self._microbatches(minibatch)
        scale = megatron_loss_scale(len(micro))

        def loss_func(hidden, mb, packed):
            logp, ent = self._logp_entropy(hidden, packed)
            loss, metrics = loss_fn(logp, ent, mb, num_tokens)
            return scale_for_schedule(loss, metrics, scale)

        stored = self._run(micro, seq_len, loss_func, forward_only=False)
        metrics = from_last_pipeline_stage(combine_metrics(stored) if parallel_state.is_pipeline_last_stage() else None)
        local_loss = metrics.pop("loss")
        flags = torch.tensor([local_loss, 0.0 if math.isfinite(local_loss) else 1.0], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(flags[:1], group=parallel_state.get_data_parallel_group())
        dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
        grad_norm = self.grad_norm()
        skipped = bool(flags[1] > 0) or not math.isfinite(grad_norm)
        if skipped:
            self._zero_grad()
        else:
            grad_norm = self._step(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"]) if getattr(self.optimizer, "param_groups", None) else 0.0
        return {**metrics, "loss": float(flags[0]), "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def _grads(self):
        for p in self.inner.parameters():
            g = getattr(p, "main_grad", None)
            yield p, (p.grad if g is None else g)

    def grad_norm(self) -> float:
        """Global L2 norm of the (DP-reduced) gradients: each parameter counted once across TP, PP and EP."""
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        for p, g in self._grads():
            if g is None or getattr(p, "shared", False):  # a tied-embedding copy: counted on the first stage
                continue
            is_expert = not getattr(p, "allreduce", True)
            if not getattr(p, "tensor_model_parallel", False) and (etp_rank if is_expert else tp_rank) != 0:
                continue  # replicated over (expert) TP: count rank 0's copy
            sq = g.float().pow(2).sum().double()
            if is_expert:
                expert += sq
            else:
                dense += sq
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if self.inner.config.num_moe_experts:
            dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt())

    def _step(self, grad_norm: float) -> float:
        if self._megatron_optimizer:
            _, norm, _ = self.optimizer.step()
            return float(norm) if norm is not None else grad_norm
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (grad_norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
            if coef < 1.0:
                for _, g in self._grads():
                    if g is not None:
                        g.mul_(coef)
        for p, g in self._grads():
            p.grad = None if g is None else (g if g.dtype == p.dtype else g.to(p.dtype))
        self.optimizer.step()
        return grad_norm

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for p in self.inner.parameters():
            p.grad = None

    # ---- refit -----------------------------------------------------------------------------------------------------
    def hf_weight_buckets(self, bucket_bytes: int, *, dtype: Optional[torch.dtype] = None, stats=None):
        """The whole model as buckets ``[(HF name, tensor), ...]`` of at most ``bucket_bytes`` for a rollout engine's
        weight update (``refit_hf.hf_weight_buckets``): EVERY rank must call it and consume it to the end; every
        rank receives the full model (no engine-TP cut). No tensor aliases a parameter: training may go on once a
        bucket is consumed. Needs ``hf_config`` at construction."""
        if self.hf_config is None:
            raise ValueError("MegatronPolicy.hf_weight_buckets needs the model's Hugging Face config: construct the "
                             "policy with hf_config=... (the config convert_build built the model from)")
        return hf_weight_buckets(self.model, self.hf_config, bucket_bytes=bucket_bytes, spec=self.hf_spec,
                                 dtype=dtype, stats=stats)

    # ---- state -----------------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return dict(tp=parallel_state.get_tensor_model_parallel_world_size(),
                    pp=parallel_state.get_pipeline_model_parallel_world_size(),
                    ep=parallel_state.get_expert_model_parallel_world_size(),
                    tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                    pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                    ep_rank=parallel_state.get_expert_model_parallel_rank())

    def state_dict(self) -> dict:
        """This rank's shards (model + optimizer) and the layout they belong to."""
        model = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in self.inner.state_dict().items()}
        return {"model": model, "optimizer": self.optimizer.state_dict(), "layout": self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("layout") != self._layout():
            raise ValueError(f"MegatronPolicy.load_state_dict: the state was saved by rank layout "
                             f"{state.get('layout')} but this rank is {self._layout()}; reshard it first "
                             "(refit_gather.full_state_dict + model.load_full_state_dict)")
        self.inner.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
