"""``MegatronPolicy``: the ``Policy`` protocol of core/types.py on a bare megatron-core GPTModel (TP, PP, EP, DP),
through the one training step of nemo_dapo/megatron/step.py that the NeMo actor runs too.

Tests use it to drive the step loop, the refit and the CUDA checks on a GPTModel without NeMo. Every rank of a
data-parallel (DP) replica calls ``logprobs`` / ``train_step`` with its DP share (the ranks of one TP/PP group see
identical data); a rank without any sample (``None`` or 0 rows) must still call them. Rows are packed as the actor
packs them (megatron/layout.py: each row's real prompt tokens, then its response, from position 0), so megatron's
RoPE gives every token its true position and a causal mask is the whole attention mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer

from nemo_dapo.core.metrics import combine_metrics
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.megatron.convert import hf_arch
from nemo_dapo.megatron.layout import blank_rows, pack_rollout, prompt_lengths_of, unpack_response
from nemo_dapo.megatron.model import unwrap
from nemo_dapo.megatron.reduction import from_last_pipeline_stage, megatron_loss_scale
from nemo_dapo.megatron.refit_hf import hf_weight_buckets, layer_spec_name
from nemo_dapo.megatron.step import (forward_backward, hidden_logprobs_entropy, hidden_states_only, loss_share,
                                     microbatches, skip_update)

TRAIN_FIELDS = ("response_tokens", "mask", "prev_logprobs", "engine_logprobs", "advantages", "is_end",
                "prompt_lengths", "response_lengths")


def causal_inputs(tokens: torch.Tensor) -> tuple:
    """(position_ids [b, S], attention_mask [1, 1, S, S] bool, True = masked) of packed rows for a bare GPTModel:
    every row starts at position 0 and padding only follows the real tokens, so a causal mask is the whole mask."""
    s = tokens.shape[1]
    pos = torch.arange(s, device=tokens.device).expand_as(tokens)
    return pos, torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), 1).view(1, 1, s, s)


def grads(model):
    """(parameter, gradient) of every parameter: megatron DDP's ``main_grad`` where it keeps one, else ``.grad``."""
    for p in unwrap(model).parameters():
        g = getattr(p, "main_grad", None)
        yield p, (p.grad if g is None else g)


def grad_norm(model) -> float:
    """Global L2 norm of the (DP-reduced) gradients: each parameter counted once across TP, PP and EP."""
    inner = unwrap(model)
    device = next(inner.parameters()).device
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    for p, g in grads(inner):
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
    if inner.config.num_moe_experts:
        dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + expert).sqrt())


class MegatronPolicy:
    """The trainable megatron-core model behind the ``Policy`` protocol.

    ``model``: this rank's GPTModel (wrapped here in megatron's DDP unless it already is). ``optimizer``: a torch
    optimizer over its parameters (fp32 parameters; the policy clips gradients and skips non-finite updates
    itself) or a megatron ``MegatronOptimizer`` built over the DDP model (it clips with its own config).
    ``micro_batch_size``: rows per micro-batch. ``max_grad_norm``: global gradient-norm clip (None: off).
    ``temperature``: logits are divided by it (use the sampling temperature). ``chunk_size``: tokens per chunk
    of the fused log-prob/entropy. ``hf_config``: the Hugging Face config the model was built from (see
    ``convert_build``), needed by :meth:`hf_weight_buckets`. ``valid_vocab`` (default: ``hf_config.vocab_size``
    when given): the rows that pad the output layer beyond it are left out of the log-prob softmax (None: every
    row counts). ``hf_spec``: its layer spec for the name map (default: read from the parameter names).
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
        # sequence parallelism splits S over TP; the actor's multiple also aligns kernels, not needed here
        self.multiple = parallel_state.get_tensor_model_parallel_world_size() if inner.config.sequence_parallel \
            else 1

    # ---- batching and forward ----------------------------------------------------------------------------------
    def _packed(self, batch: Optional[RolloutBatch]) -> dict:
        if batch is None or len(batch) == 0:
            return blank_rows(TRAIN_FIELDS, 0, 0, 2)
        return pack_rollout(batch, batch.pad_id)

    def _microbatches(self, packed: dict, pad_id: int) -> tuple:
        return microbatches(packed, multiple=self.multiple, pad_id=pad_id, max_rows=self.micro_batch_size)

    def _forward(self, loss_func_of):
        def forward(mb, model):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            pos, causal = causal_inputs(mb["response_tokens"])
            with hidden_states_only(model):
                out = model(mb["response_tokens"], pos, causal)
            return out, lambda hidden: loss_func_of(hidden, mb)

        return forward

    def _logp_entropy(self, hidden: torch.Tensor, mb: dict, mask: Optional[torch.Tensor] = None) -> tuple:
        """hidden [S(/tp with SP), b, H] -> fp32 (logp, entropy) [b, S-1] of tokens 1..S-1."""
        return hidden_logprobs_entropy(self.inner, hidden, mb["response_tokens"][:, 1:], mask=mask,
                                       chunk_size=self.chunk_size, temperature=self.temperature,
                                       valid_vocab=self.valid_vocab)

    @torch.no_grad()
    def logprobs(self, batch: Optional[RolloutBatch]) -> tuple:
        """(log-prob [B, R], entropy [B, R]) fp32 of the response tokens, 0 on padding, on every rank."""
        self.model.eval()
        pad_id = batch.pad_id if batch is not None else 0
        packed = self._packed(batch)
        n, s = packed["response_tokens"].shape
        groups, micro = self._microbatches(packed, pad_id)

        def collect(hidden, mb):
            logp, ent = self._logp_entropy(hidden, mb)
            return hidden.new_zeros(()), {"lp": torch.stack([logp, ent])}  # [2, b, S_mb - 1]

        stored = forward_backward(self.model, self._forward(collect), micro, forward_only=True)
        out = torch.zeros(2, n, max(s - 1, 0), device=self.device)
        if parallel_state.is_pipeline_last_stage():
            for g, o in zip(groups, stored):
                w = min(s - 1, o["lp"].shape[2])
                out[:, torch.tensor(g, dtype=torch.long), :w] = o["lp"][:, :, :w].float()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        if batch is None or len(batch) == 0:
            return torch.zeros(0, 0), torch.zeros(0, 0)
        p, width = prompt_lengths_of(batch), batch.response_ids.shape[1]
        mask = batch.response_mask.float()
        dev = batch.response_mask.device
        return ((unpack_response(out[0].cpu(), p, width) * mask).to(dev),
                (unpack_response(out[1].cpu(), p, width) * mask).to(dev))

    # ---- update ------------------------------------------------------------------------------------------------
    def train_step(self, minibatch: Optional[RolloutBatch], *, norm: float, loss_fn) -> dict:
        """One optimizer update; ``norm`` is the GLOBAL normaliser of ``loss_fn`` for this mini-batch."""
        self.model.train()
        self._zero_grad()
        pad_id = minibatch.pad_id if minibatch is not None else 0
        _, micro = self._microbatches(self._packed(minibatch), pad_id)
        scale = megatron_loss_scale(len(micro))

        def loss_func(hidden, mb):
            logp, ent = self._logp_entropy(hidden, mb, mask=mb["mask"] > 0)
            return loss_share(loss_fn, logp, ent, mb, norm, scale)

        stored = forward_backward(self.model, self._forward(loss_func), micro, forward_only=False)
        metrics = from_last_pipeline_stage(combine_metrics(stored) if parallel_state.is_pipeline_last_stage() else None)
        norm = grad_norm(self.model)
        loss, skipped = skip_update(metrics.pop("loss"), norm)
        if skipped:
            self._zero_grad()
        else:
            norm = self._step(norm)
        lr = float(self.optimizer.param_groups[0]["lr"]) if getattr(self.optimizer, "param_groups", None) else 0.0
        return {**metrics, "loss": loss, "grad_norm": norm, "lr": lr, "skipped": float(skipped)}

    def _step(self, norm: float) -> float:
        if self._megatron_optimizer:
            _, clipped, _ = self.optimizer.step()
            return float(clipped) if clipped is not None else norm
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s formula
            if coef < 1.0:
                for _, g in grads(self.inner):
                    if g is not None:
                        g.mul_(coef)
        for p, g in grads(self.inner):
            p.grad = None if g is None else (g if g.dtype == p.dtype else g.to(p.dtype))
        self.optimizer.step()
        return norm

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for p in self.inner.parameters():
            p.grad = None

    # ---- refit -------------------------------------------------------------------------------------------------
    def hf_weight_buckets(self, bucket_bytes: int, *, dtype: Optional[torch.dtype] = None, stats=None):
        """The whole model as buckets ``[(HF name, tensor), ...]`` of at most ``bucket_bytes`` for a rollout
        engine's weight update (``refit_hf.hf_weight_buckets``): EVERY rank must call it and consume it to the end.
        Needs ``hf_config`` at construction."""
        if self.hf_config is None:
            raise ValueError("MegatronPolicy.hf_weight_buckets needs the model's Hugging Face config: construct the "
                             "policy with hf_config=... (the config convert_build built the model from)")
        return hf_weight_buckets(self.model, self.hf_config, bucket_bytes=bucket_bytes, spec=self.hf_spec,
                                 dtype=dtype, stats=stats)

    # ---- state -------------------------------------------------------------------------------------------------
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
                             "(megatron_reduction.full_state_dict, then megatron_model.load_full_state_dict)")
        self.inner.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
