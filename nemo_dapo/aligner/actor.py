"""The DAPO actor: NeMo-Aligner 0.7.0's Megatron GPT actor with the DAPO loss of ``nemo_dapo.core``.

What changes against NeMo-Aligner's PPO actor (``MegatronGPTActorModel``), everything else is inherited:
  * the loss is ``core.loss.make_loss_fn`` (decoupled clip eps_low/eps_high, dual clip, token-level aggregation,
    overlong filtering through ``is_end``, optional truncated importance sampling), fed with log-probs and entropies
    from the vocab-parallel logits by ``megatron.vocab_parallel`` (the vocabulary is never gathered);
  * the normaliser is GLOBAL: valid tokens over all micro-batches and data-parallel ranks of the optimizer step, and
    each micro-batch's share is multiplied by (num_microbatches x dp) to undo the schedule's division by the number
    of micro-batches and the data-parallel gradient averaging - so the gradient is exactly that of the DAPO loss;
  * old log-probs (and entropies) are recomputed with the same forward and the same log-prob code as training, so the
    first update of a step sees a ratio of exactly 1;
  * a rank may hold any number of samples (token-balanced splits give ranks different counts): all DP ranks run the
    same number of micro-batches (max over DP, as expert-parallel all-to-alls need), short ranks add all-masked rows.
  * generation lives in ``nemo_dapo.aligner.generation`` (TensorRT-LLM or the debug sampler), not in the actor.

Batch layout (NeMo-Aligner's): ``response_tokens`` [B, S] long = prompt + response of each row from position 0,
right-padded; per-token tensors ``mask``, ``prev_logprobs``, ``engine_logprobs`` are [B, S-1] and aligned with the
shifted log-probs (entry t belongs to token t + 1); ``mask`` is 1 on response tokens (EOS included);
``advantages`` [B]; ``is_end`` [B] (1: the response ended with EOS / an end string, 0: truncated at the cap).
``layout.pack_rollout`` / ``layout.unpack_response`` convert from / to the core layout (types.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mcore_ps
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from omegaconf import DictConfig, OmegaConf

from nemo.collections.nlp.modules.common.megatron.utils import get_iterator_k_split
from nemo_aligner.utils.distributed import broadcast_tensor_within_pp
from nemo_aligner.utils.train_utils import set_sync_funcs
from nemo_dapo.aligner.compat import CHECKPOINT_KEY, actor_base
from nemo_dapo.aligner.layout import (  # noqa: F401  (re-exported: the actor's batch layout)
    as_rollout,
    pack_rollout,
    pack_tokens,
    pad_rows,
    prompt_lengths_of,
    to_shifted,
    unpack_response,
)
from nemo_dapo.core.loss import METRIC_REDUCTION, make_loss_fn
from nemo_dapo.megatron.reduction import megatron_loss_scale
from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logits_logprobs_entropy

MegatronGPTActorModel = actor_base()

# How each metric of a micro-batch combines over micro-batches and ranks ("loss" is a share, like the token metrics).
_REDUCE = dict(METRIC_REDUCTION, loss="sum")


def seq_len_multiple(cfg: DictConfig) -> int:
    """What every micro-batch's sequence length S is padded to a multiple of: NeMo-Aligner's DPO rule
    (algorithms/dpo.py): 8 x TP with sequence parallelism (megatron-core splits the [S, b, h] activations along S
    over TP and asserts divisibility; TE wants 8-aligned shards), else 16; times CP (context parallelism splits S
    again)."""
    tp = int(cfg.get("tensor_model_parallel_size", 1))
    base = 8 * tp if bool(cfg.get("sequence_parallel", False)) else 16
    return base * int(cfg.get("context_parallel_size", 1) or 1)


def pad_seq_len(batch: dict, multiple: int, pad_id: int) -> tuple:
    """(batch, S): ``response_tokens`` [B, S] right-padded with ``pad_id`` to S' (a multiple of ``multiple``) and
    the shifted per-token fields [B, S-1] (mask, prev/engine log-probs) with zeros to [B, S'-1], so the added
    positions are masked out of the loss; causal attention keeps them from changing the real positions' outputs.
    Per-row fields ([B]) are unchanged. S is the original length (log-probs are cut back to S-1)."""
    s = batch["response_tokens"].shape[1]
    target = -(-s // multiple) * multiple
    if target == s:
        return batch, s
    out = {}
    for k, v in batch.items():
        if k == "response_tokens":
            out[k] = torch.cat([v, v.new_full((v.shape[0], target - s), pad_id)], 1)
        elif isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == s - 1:
            out[k] = torch.cat([v, v.new_zeros((v.shape[0], target - s))], 1)
        else:
            out[k] = v
    return out, s


def _agreed_microbatches(rows: int, mbs: int) -> int:
    """Micro-batches every DP rank runs: the max over DP of ceil(rows / mbs) (at least 1). Expert-parallel all-to-alls
    span DP ranks, so all of them must run the same number of forwards; short ranks add all-masked rows."""
    n = torch.tensor([max(1, -(-rows // mbs))], dtype=torch.int64).cuda()
    if mcore_ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=mcore_ps.get_data_parallel_group())
    return int(n.item())


# ---- the actor -----------------------------------------------------------------------------------------------------

def _dapo_cfg(cfg: DictConfig) -> DictConfig:
    if cfg.get("dapo") is None:
        raise ValueError("model.dapo is missing from the model config: the DAPO actor reads its loss and rollout "
                         "settings from model.dapo (see conf/gpt_dapo_actor.yaml)")
    return cfg.dapo


def loss_fn_from_cfg(cfg: DictConfig):
    """``core.loss.make_loss_fn`` from ``model.dapo``: eps_low, eps_high, clip_c (dual clip), agg, overlong_filter,
    tis_cap (and, for agg=seq-mean-token-sum-norm, the generation cap length_params.max_length)."""
    d = _dapo_cfg(cfg)
    agg = d.get("agg", "token-mean")
    max_len = d.get("length_params", {}).get("max_length") if agg == "seq-mean-token-sum-norm" else None
    clip_c, tis_cap = d.get("clip_c", None), d.get("tis_cap", None)
    return make_loss_fn(eps_low=float(d.get("eps_low", 0.2)), eps_high=float(d.get("eps_high", 0.28)),
                        clip_c=None if clip_c is None else float(clip_c), agg=agg, max_len=max_len,
                        overlong_filter=bool(d.get("overlong_filter", False)),
                        tis_cap=None if tis_cap is None else float(tis_cap))


class MegatronGPTDAPOActorModel(MegatronGPTActorModel):
    """NeMo-Aligner's GPT actor trained with the DAPO loss. Config: ``model.dapo`` (see conf/gpt_dapo_actor.yaml)."""

    def __init__(self, cfg: DictConfig, trainer):
        # The PPO actor's __init__ reads model.ppo and may build a TensorRT-LLM engine: run the model's own __init__
        # chain instead and set the attributes the inherited methods use.
        super(MegatronGPTActorModel, self).__init__(cfg, trainer=trainer)
        d = _dapo_cfg(self.cfg)
        self.automatic_optimization = False
        self.init_policy_state_dict = None  # DAPO has no reference policy
        self.distributed_adam_offload_manager = None
        self._length_params = OmegaConf.to_container(d.get("length_params", {}), resolve=True)
        self._sampling_params = OmegaConf.to_container(d.get("sampling_params", {}), resolve=True)
        self.to_offload_adam_states = bool(d.get("offload_adam_states", False)) and self.with_distributed_adam
        self.forward_micro_batch_size = int(d.get("forward_micro_batch_size", self.cfg.micro_batch_size))
        self.use_trtllm_generation = False  # rollouts: nemo_dapo.aligner.generation
        self.entropy_bonus, self.ratio_eps = 0.0, None  # PPO-only attributes, unused here
        self.loss_fn = loss_fn_from_cfg(self.cfg)
        self.logprob_chunk_size = int(d.get("logprob_chunk_size", 1024))
        self.seq_len_multiple = seq_len_multiple(self.cfg)  # sequence-parallel split and kernel alignment
        # log pi is taken at the sampling temperature, like the reference (logits / T)
        self.logprob_temperature = float(self._sampling_params.get("temperature", 1.0) or 1.0)
        self.trainer_state: Optional[torch.Tensor] = None  # packed trainer state, saved inside checkpoints
        # Vocabulary the rollout engine samples from (ids >= it are Megatron's padding rows, left out of the softmax so
        # that training log-probs and the engine's describe one distribution); set by generation.build_generator.
        self.valid_vocab: Optional[int] = None

    def infer(self, inference_batch):
        raise NotImplementedError("the DAPO actor does not generate: use nemo_dapo.aligner.generation "
                                  "(TRTLLMGenerator, or MegatronSampler for small debug runs)")

    # ---- checkpoint hooks: the trainer state travels inside the checkpoint ---------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.trainer_state is not None:
            checkpoint[CHECKPOINT_KEY] = self.trainer_state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.trainer_state = checkpoint.get(CHECKPOINT_KEY)

    # ---- shared forward ------------------------------------------------------------------------------------------
    def _logprobs_entropy(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple:
        """logits [b, S, V/tp] (last stage), tokens [b, S] -> fp32 (logp, entropy) [b, S-1] of tokens 1..S-1."""
        return vocab_parallel_logits_logprobs_entropy(logits[:, :-1], tokens[:, 1:],
                                                      chunk_size=self.logprob_chunk_size,
                                                      temperature=self.logprob_temperature,
                                                      valid_vocab=self.valid_vocab)

    def _forward(self, model, mb: dict):
        return model(mb["response_tokens"], mb["position_ids"], mb["attention_mask"], labels=None)

    def _with_masks(self, batch: dict) -> dict:
        attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(batch["response_tokens"])
        return dict(batch, attention_mask=attention_mask, position_ids=position_ids)

    # ---- training ------------------------------------------------------------------------------------------------
    def get_actor_forward_output_and_loss_func(self, loss_fn=None, num_tokens=None, scale: float = 1.0):
        loss_fn = loss_fn or self.loss_fn

        def fwd_output_and_loss_func(data_iterator, model):
            mb = {k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v)
                  for k, v in next(data_iterator).items()}
            logits = self._forward(model, mb)

            def loss_func(logits):
                logp, entropy = self._logprobs_entropy(logits, mb["response_tokens"])
                loss, metrics = loss_fn(logp, entropy, as_rollout(mb), num_tokens)
                metrics = {k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}
                metrics["loss"] = loss.detach().float()
                # The schedule divides every micro-batch loss by num_microbatches and the DP gradient sync averages
                # over ranks; the scale (megatron.reduction) undoes both so the gradient is that of the summed shares.
                return loss * scale, metrics

            return logits, loss_func

        return fwd_output_and_loss_func

    def global_normalizer(self, batch: dict, loss_fn=None) -> torch.Tensor:
        """The loss normaliser of this optimizer step: ``loss_fn.normalizer`` summed over the local rows and DP."""
        loss_fn = loss_fn or self.loss_fn
        local = loss_fn.normalizer(as_rollout(batch)).float().reshape(1).cuda()
        dist.all_reduce(local, group=mcore_ps.get_data_parallel_group())
        return local[0].cpu()

    def get_loss_and_metrics(self, batch: dict, forward_only: bool, *, num_tokens=None, loss_fn=None,
                             reduce_over_dp: bool = True):
        """(loss, metrics) of one optimizer step's local share ``batch`` (any number of rows, including 0).

        ``num_tokens``: the global normaliser (computed here over DP when None). Metrics are combined over
        micro-batches as core.loss.METRIC_REDUCTION says, over DP when ``reduce_over_dp`` (else they are this DP
        rank's shares), and returned on every rank. ``loss`` is the step's loss (the DAPO objective of the global
        batch when reduced over DP, else this rank's share of it).
        """
        loss_fn = loss_fn or self.loss_fn
        mbs = int(self.cfg.micro_batch_size)
        num_microbatches = _agreed_microbatches(batch["response_tokens"].shape[0], mbs)
        batch, _ = pad_rows(batch, mbs, self.tokenizer.eos_id, min_rows=num_microbatches * mbs)
        batch, _ = pad_seq_len(batch, self.seq_len_multiple, self.tokenizer.eos_id)
        if num_tokens is None:
            num_tokens = self.global_normalizer(batch, loss_fn)
        scale = megatron_loss_scale(num_microbatches)
        batch = self._with_masks(batch)
        set_sync_funcs(self, forward_only)
        per_mb = get_forward_backward_func()(
            forward_step_func=self.get_actor_forward_output_and_loss_func(loss_fn, num_tokens, scale),
            data_iterator=self._make_data_iterator_list(get_iterator_k_split(batch, num_microbatches)),
            model=self.model, num_microbatches=num_microbatches, forward_only=forward_only,
            seq_length=batch["response_tokens"].shape[1], micro_batch_size=mbs)
        metrics = self._combine_metrics(per_mb, reduce_over_dp)
        return metrics["loss"], metrics

    def _combine_metrics(self, per_mb: list, reduce_over_dp: bool) -> dict:
        """Combine micro-batch metrics on the last pipeline stage, then share them with the stages of THIS rank's
        pipeline (its own DP share: a broadcast from the global last rank would hand every DP rank that rank's
        share, which the caller's DP reduction then counts DP times)."""
        out = None
        if mcore_ps.is_pipeline_last_stage():
            out = {}
            for k in sorted({k for m in per_mb for k in m}):
                vals = torch.stack([m[k].float().cpu() for m in per_mb if k in m])
                how = _REDUCE.get(k, "mean")
                v = vals.sum() if how == "sum" else vals.min() if how == "min" else vals.max() if how == "max" \
                    else vals.mean()
                if reduce_over_dp and mcore_ps.get_data_parallel_world_size() > 1:
                    op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}.get(how, dist.ReduceOp.SUM)
                    v = v.cuda()
                    dist.all_reduce(v, op=op, group=mcore_ps.get_data_parallel_group())
                    v = v.cpu() / (mcore_ps.get_data_parallel_world_size() if how == "mean" else 1)
                out[k] = float(v)
        if mcore_ps.get_pipeline_model_parallel_world_size() == 1:
            return out
        box = [out]
        dist.broadcast_object_list(box, src=mcore_ps.get_pipeline_model_parallel_last_rank(),
                                   group=mcore_ps.get_pipeline_model_parallel_group())
        return box[0]

    # ---- old log-probs -------------------------------------------------------------------------------------------
    def _logprob_entropy_func(self):
        def fwd(data_iterator, model):
            mb = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
            logits = self._forward(model, mb)

            def collect(logits, non_loss_data=True):
                logp, entropy = self._logprobs_entropy(logits, mb["response_tokens"])
                return torch.stack([logp, entropy])  # [2, b, S-1]

            return logits, collect

        return fwd

    @torch.no_grad()
    def get_logprobs_and_entropy(self, response_tokens: torch.Tensor, forward_micro_batch_size: Optional[int] = None):
        """fp32 (logp, entropy), each [B, S-1], of tokens 1..S-1 of ``response_tokens`` [B, S]; on every rank.

        The same forward and log-prob code as the loss (so the first update of a step has ratio exactly 1).
        """
        fmbs = int(forward_micro_batch_size or self.forward_micro_batch_size)
        num_microbatches = _agreed_microbatches(response_tokens.shape[0], fmbs)
        batch, n = pad_rows({"response_tokens": response_tokens}, fmbs, self.tokenizer.eos_id,
                            min_rows=num_microbatches * fmbs)
        batch, s = pad_seq_len(batch, self.seq_len_multiple, self.tokenizer.eos_id)
        set_sync_funcs(self, forward_only=True)
        out = get_forward_backward_func()(
            forward_step_func=self._logprob_entropy_func(),
            data_iterator=self._make_data_iterator_list(get_iterator_k_split(self._with_masks(batch),
                                                                             num_microbatches)),
            model=self.model, num_microbatches=num_microbatches, forward_only=True,
            seq_length=batch["response_tokens"].shape[1], micro_batch_size=fmbs, collect_non_loss_data=True)
        stacked = torch.cat(out, dim=1).float() if out else None  # [2, B_padded, S-1] on the last stage
        stacked = broadcast_tensor_within_pp(stacked, dtype=torch.float32).cpu()
        return stacked[0, :n, :s - 1], stacked[1, :n, :s - 1]

    @torch.no_grad()
    def get_inference_log_probs(self, response_tokens, forward_micro_batch_size=None):
        """NeMo-Aligner's API: log-probs [B, S-1] (see get_logprobs_and_entropy)."""
        return self.get_logprobs_and_entropy(response_tokens, forward_micro_batch_size)[0]
