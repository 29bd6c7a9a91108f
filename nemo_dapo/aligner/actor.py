"""The DAPO actor: NeMo-Aligner 0.7.0's Megatron GPT actor with the DAPO loss of ``nemo_dapo.core``.

What changes against NeMo-Aligner's PPO actor (``MegatronGPTActorModel``), everything else is inherited:
  * the loss is the core ``LossFn`` the trainer builds once (core.loss.DAPOLossFn: decoupled clip eps_low/eps_high,
    dual clip, token-level aggregation, overlong filtering through ``is_end``, optional truncated importance
    sampling) and hands to the actor (``actor.loss_fn``), fed with log-probs and entropies from the final hidden
    states and the output-layer shard (``megatron.step``; the vocabulary is never gathered) and with the packed
    batch's ``megatron.layout.loss_input``;
  * forward-backward, micro-batches, filler rows and the skip decision are ``megatron.step``'s, the one Megatron
    training step (a bare GPTModel runs the same one);
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
``megatron.layout.pack_rollout`` / ``unpack_response`` convert from / to the core layout (types.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mcore_ps
from omegaconf import DictConfig, OmegaConf

from nemo_aligner.utils.distributed import broadcast_tensor_within_pp
from nemo_aligner.utils.train_utils import set_sync_funcs
from nemo_dapo.aligner.compat import CHECKPOINT_KEY, actor_base
from nemo_dapo.cluster.config_load import nemo_model_key, required
from nemo_dapo.core.metrics import combine_metrics, reduce_over_ranks
from nemo_dapo.megatron.extra_state import without_extra_state
from nemo_dapo.megatron.model import gpt_layer_spec
from nemo_dapo.megatron.reduction import DPReducer, from_last_pipeline_stage, megatron_loss_scale, sum_grads_over_tp
from nemo_dapo.megatron.step import (forward_backward, hidden_logprobs_entropy, hidden_states_only, loss_share,
                                     microbatches, normalizer_share)
from nemo_dapo.megatron.te_check import grouped_gemm_problem, te_version
from nemo_dapo.megatron.vocab_parallel import vocab_parallel_logits_logprobs_entropy

MegatronGPTActorModel = actor_base()


def seq_len_multiple(cfg: DictConfig) -> int:
    """What every micro-batch's sequence length S is padded to a multiple of: NeMo-Aligner's DPO rule
    (algorithms/dpo.py): 8 x TP with sequence parallelism (megatron-core splits the [S, b, h] activations along S
    over TP and asserts divisibility; TE wants 8-aligned shards), else 16; times CP (context parallelism splits S
    again). NeMo's own model keys, read with NeMo's defaults (``nemo_model_key``): NeMo split the model by them."""
    tp = int(nemo_model_key(cfg, "tensor_model_parallel_size"))
    base = 8 * tp if bool(nemo_model_key(cfg, "sequence_parallel")) else 16
    return base * int(nemo_model_key(cfg, "context_parallel_size"))


# ---- the actor -----------------------------------------------------------------------------------------------------

def _is_qk_norm(name: str) -> bool:
    return ".self_attention.q_layernorm." in name or ".self_attention.k_layernorm." in name


def _dapo_cfg(cfg: DictConfig) -> DictConfig:
    if cfg.get("dapo") is None:
        raise ValueError("model.dapo is missing from the model config: the DAPO actor reads its loss and rollout "
                         "settings from model.dapo (see conf/gpt_dapo_actor.yaml)")
    return cfg.dapo


def _dapo(cfg: DictConfig, key: str):
    """Strict read of ``model.dapo.<key>``: a missing key is an error naming it (the YAML holds every default)."""
    return required(_dapo_cfg(cfg), key, "model.dapo")


class MegatronGPTDAPOActorModel(MegatronGPTActorModel):
    """NeMo-Aligner's GPT actor trained with the DAPO loss. Config: ``model.dapo`` (see conf/gpt_dapo_actor.yaml)."""

    def __init__(self, cfg: DictConfig, trainer):
        # The PPO actor's __init__ reads model.ppo and may build a TensorRT-LLM engine: run the model's own __init__
        # chain instead and set the attributes the inherited methods use.
        super(MegatronGPTActorModel, self).__init__(cfg, trainer=trainer)
        self.automatic_optimization = False
        self.init_policy_state_dict = None  # DAPO has no reference policy
        self.distributed_adam_offload_manager = None
        self._length_params = OmegaConf.to_container(_dapo(self.cfg, "length_params"), resolve=True)
        self._sampling_params = OmegaConf.to_container(_dapo(self.cfg, "sampling_params"), resolve=True)
        self.to_offload_adam_states = bool(_dapo(self.cfg, "offload_adam_states")) and self.with_distributed_adam
        self.forward_micro_batch_size = int(_dapo(self.cfg, "forward_micro_batch_size"))
        self.use_trtllm_generation = False  # rollouts: nemo_dapo.aligner.generation
        self.entropy_bonus, self.ratio_eps = 0.0, None  # PPO-only attributes, unused here
        # the DAPO loss (core.types.LossFn), built once by the trainer's builder and handed over by DAPOTrainer
        self.loss_fn = None
        self.logprob_chunk_size = int(_dapo(self.cfg, "logprob_chunk_size"))
        self.seq_len_multiple = seq_len_multiple(self.cfg)  # sequence-parallel split and kernel alignment
        # log pi is taken at the sampling temperature, like the reference (logits / T)
        self.logprob_temperature = float(_dapo(self.cfg, "sampling_params.temperature") or 1.0)
        self.trainer_state: Optional[torch.Tensor] = None  # packed trainer state, saved inside checkpoints
        # Vocabulary the rollout engine samples from (ids >= it are Megatron's padding rows, left out of the softmax so
        # that training log-probs and the engine's describe one distribution); set by generation.build_generator.
        self.valid_vocab: Optional[int] = None

    # ---- model construction: QK-norm (Qwen3) -----------------------------------------------------------------
    def model_provider_func(self, pre_process, post_process):
        """NeMo's GPT model; with ``model.qk_layernorm: True`` (Qwen3) built from a layer spec WITH QK-norm.

        NeMo 2.1's ``MegatronGPTModel.model_provider_func`` takes its layer spec from ``get_specs``, which never
        passes megatron-core's ``qk_layernorm`` (megatron_gpt_model.py, NeMo v2.1.0 lines 153-176 and 475-499),
        although ``build_transformer_config`` copies ``model.qk_layernorm`` into ``TransformerConfig``. Without QK-norm
        the inherited method is used unchanged; with it, the same ``MCoreGPTModel`` is built with the same arguments
        (copied from that method) and ``megatron.model.gpt_layer_spec(qk_layernorm=True)`` (TE's spec when
        ``model.transformer_engine``, else the local one; both build an RMSNorm over ``kv_channels`` when
        ``normalization: rmsnorm``; below TE 1.9 the TE spec's QK-norm is ``qk_norm.QKNorm``). NeMo itself is not
        patched. ``moe_grouped_gemm`` needs TE >= 1.9 (``te_check.grouped_gemm_problem``): refused here below it.
        """
        config = self.transformer_config
        problem = grouped_gemm_problem(te_version()) if config.moe_grouped_gemm and self.transformer_engine else ""
        if problem:  # NeMo-Aligner 0.7.0's image has TE 1.8
            raise ValueError(problem)
        if not config.qk_layernorm:
            return super().model_provider_func(pre_process, post_process)
        if not self.mcore_gpt or self.spec_name not in ("", "te_gpt"):
            raise ValueError(f"model.qk_layernorm=True needs model.mcore_gpt=True and NeMo's default GPT layer spec "
                             f"(model.name '' or 'te_gpt'), got mcore_gpt={self.mcore_gpt} name={self.spec_name!r}")
        from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MCoreGPTModel
        from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import mcore_model_customize

        spec = gpt_layer_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                              qk_layernorm=True, use_te=bool(self.transformer_engine), fp8=self.cfg.get("fp8", False))
        model = MCoreGPTModel(
            config=config, transformer_layer_spec=spec,
            vocab_size=self.cfg.get("override_vocab_size", self.padded_vocab_size),
            max_sequence_length=required(self.cfg, "encoder_seq_length", "model"), pre_process=pre_process,
            post_process=post_process, parallel_output=True,
            share_embeddings_and_output_weights=self.cfg.get("share_embeddings_and_output_weights", True),
            position_embedding_type=self.cfg.get("position_embedding_type", "learned_absolute"),
            rotary_percent=self.cfg.get("rotary_percentage", 1.0),
            seq_len_interpolation_factor=self.cfg.get("seq_len_interpolation_factor", None),
            rotary_base=self.cfg.get("rotary_base", 10000))
        mcore_model_customize(self.cfg, model)
        for name, param in model.named_parameters():
            if _is_qk_norm(name):  # their gradients are summed over TP before the optimizer takes them: apex's
                param._disable_greedy_grad_copy = not self.megatron_amp_O2  # distributed Adam (NeMo's value)
                param._disable_overlap_grad_sync = True  # must not sync them early (as NeMo does for SP norms)
        return model

    # ---- gradient reductions: QK-norm weights under TP ----------------------------------------------------------
    def _qk_norm_grads_nemo_leaves(self) -> list:
        """The QK-norm weights' gradients that NeMo-Aligner's reductions do not sum over TP (each TP rank normalises
        its own heads, so each holds a partial gradient of the replicated weight; without the sum the ranks' copies
        drift apart). megatron-core's optimizer sums them itself (``finalize_model_grads``), and NeMo's
        sequence-parallel reduction sums the ones marked ``sequence_parallel`` (TE's norms, under SP)."""
        if not self.transformer_config.qk_layernorm or mcore_ps.get_tensor_model_parallel_world_size() == 1 \
                or self.use_mcore_dist_optim:
            return []
        sp = bool(self.transformer_config.sequence_parallel)  # NeMo's reading of model.sequence_parallel
        attr = "main_grad" if self.megatron_amp_O2 else "grad"  # where NeMo's own SP reduction reads them
        return [getattr(p, attr).data for n, p in self.named_parameters()
                if p.requires_grad and _is_qk_norm(n) and getattr(p, attr, None) is not None
                and not (sp and getattr(p, "sequence_parallel", False))]

    def finish_training_step(self):
        sum_grads_over_tp(self._qk_norm_grads_nemo_leaves())  # before the reductions hand grads to the optimizer
        super().finish_training_step()

    def infer(self, inference_batch):
        raise NotImplementedError("the DAPO actor does not generate: rollouts come from an engine server "
                                  "(nemo_dapo.aligner.engine_generation) or a legacy generator "
                                  "(nemo_dapo.aligner.generation)")

    # ---- checkpoint hooks: the trainer state travels inside the checkpoint ---------------------------------------
    def sharded_state_dict(self, prefix: str = ""):
        """NeMo's, with the modules' ``_extra_state`` neither saved nor loaded unless FP8 trains: the converted
        checkpoint (local spec) lacks TE's attention and norm states (``megatron.extra_state``)."""
        sharded = super().sharded_state_dict(prefix=prefix)
        return sharded if self.cfg.get("fp8", False) else without_extra_state(sharded)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.trainer_state is not None:
            checkpoint[CHECKPOINT_KEY] = self.trainer_state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.trainer_state = checkpoint.get(CHECKPOINT_KEY)

    # ---- shared forward ------------------------------------------------------------------------------------------
    # True: take log-probs from NeMo's full [b, S, V/tp] logits (the former path, kept as the tests' reference for
    # the hidden-state path; it costs ~3 x b x S x V/tp x 4 bytes more per micro-batch, benchmarks/actor_logits_memory.py)
    logprobs_from_logits = False

    def _logprobs_entropy(self, out: torch.Tensor, tokens: torch.Tensor, model=None, mask=None) -> tuple:
        """fp32 (logp, entropy) [b, S-1] of tokens 1..S-1 of ``tokens`` [b, S] from the last stage's output of
        ``_forward_logprob`` on ``model``: final hidden states [S(/tp with SP), b, H] through the output-layer
        shard, chunk by chunk (megatron.step.hidden_logprobs_entropy), or with ``logprobs_from_logits`` logits
        [b, S, V/tp]. ``mask`` [b, S-1]: only positions with mask != 0 are computed (the others are 0)."""
        if self.logprobs_from_logits:
            return vocab_parallel_logits_logprobs_entropy(out[:, :-1], tokens[:, 1:],
                                                          chunk_size=self.logprob_chunk_size,
                                                          temperature=self.logprob_temperature,
                                                          valid_vocab=self.valid_vocab)
        return hidden_logprobs_entropy(model, out, tokens[:, 1:], mask=None if mask is None else mask > 0,
                                       chunk_size=self.logprob_chunk_size, temperature=self.logprob_temperature,
                                       valid_vocab=self.valid_vocab)

    def _forward(self, model, mb: dict):
        """logits [b, S, V/tp] (last stage; the debug sampler reads them)."""
        return model(mb["response_tokens"], mb["position_ids"], mb["attention_mask"], labels=None)

    def _forward_logprob(self, model, mb: dict):
        """The forward whose last-stage output ``_logprobs_entropy`` takes: final hidden states (no logits)."""
        if self.logprobs_from_logits:
            return self._forward(model, mb)
        with hidden_states_only(model):
            return self._forward(model, mb)

    def _with_masks(self, batch: dict) -> dict:
        attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(batch["response_tokens"])
        return dict(batch, attention_mask=attention_mask, position_ids=position_ids)

    # ---- training ------------------------------------------------------------------------------------------------
    def _on_device(self, mb: dict) -> dict:
        return {k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}

    def _microbatches(self, batch: dict, rows: int) -> tuple:
        """(groups, micro) of megatron.step.microbatches: longest rows first, at most
        ``model.dapo.micro_batch_tokens`` rows x padded length each (null: ``rows`` rows each), padded to
        ``seq_len_multiple``, the same count on every DP rank."""
        budget = self.cfg.dapo.get("micro_batch_tokens")
        return microbatches(batch, multiple=self.seq_len_multiple, pad_id=self.tokenizer.eos_id,
                            max_tokens=None if budget is None else int(budget),
                            max_rows=rows if budget is None else None)

    def _schedule(self, forward, micro: list, forward_only: bool, **kw) -> list:
        """megatron.step.forward_backward with NeMo's masks, sync functions and per-chunk data iterators."""
        set_sync_funcs(self, forward_only)
        return forward_backward(self.model, forward, micro, forward_only=forward_only,
                                data_iterator=self._make_data_iterator_list(iter([self._with_masks(mb)
                                                                                  for mb in micro])), **kw)

    def get_loss_and_metrics(self, batch: dict, forward_only: bool, *, norm=None, loss_fn=None,
                             reduce_over_dp: bool = True):
        """(loss, metrics) of one optimizer step's local share ``batch`` (any number of rows, including 0).

        Micro-batches: see ``_microbatches`` (rows sorted by ``response_lengths``, each group padded only to its own
        longest row, rounded to ``seq_len_multiple``); every DP rank runs the same number (filler micro-batches).
        ``loss_fn``: a core.types.LossFn (default: ``self.loss_fn``, the trainer's). ``norm``: its global
        normaliser (computed here over DP when None). Metrics are combined over
        micro-batches as core.loss.METRIC_REDUCTION says, over DP when ``reduce_over_dp`` (else they are this DP
        rank's shares), and returned on every rank. ``loss`` is the step's loss (the DAPO objective of the global
        batch when reduced over DP, else this rank's share of it).
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("get_loss_and_metrics needs a loss: pass loss_fn=, or let DAPOTrainer hand the actor the "
                             "loss its builder made (actor.loss_fn)")
        _, micro = self._microbatches(batch, int(self.cfg.micro_batch_size))
        if norm is None:  # the normaliser is additive over rows, and filler rows add nothing
            norm = normalizer_share(loss_fn, micro).reshape(1).cuda()
            dist.all_reduce(norm, group=mcore_ps.get_data_parallel_group())
            norm = norm[0].cpu()
        scale = megatron_loss_scale(len(micro))

        def forward(mb, model):
            mb = self._on_device(mb)
            out = self._forward_logprob(model, mb)

            def loss_func(out):
                logp, entropy = self._logprobs_entropy(out, mb["response_tokens"], model, mb["mask"])
                return loss_share(loss_fn, logp, entropy, mb, norm, scale)

            return out, loss_func

        per_mb = self._schedule(forward, micro, forward_only)
        metrics = self._combine_metrics(per_mb, reduce_over_dp)
        return metrics["loss"], metrics

    def _combine_metrics(self, per_mb: list, reduce_over_dp: bool) -> dict:
        """Combine micro-batch metrics on the last pipeline stage, then share them with the stages of THIS rank's
        pipeline (its own DP share: a broadcast from the global last rank would hand every DP rank that rank's
        share, which the caller's DP reduction then counts DP times)."""
        out = None
        if mcore_ps.is_pipeline_last_stage():
            out = combine_metrics(per_mb)
            if reduce_over_dp:
                out = reduce_over_ranks(out, DPReducer(mcore_ps.get_data_parallel_group()))
        return from_last_pipeline_stage(out)

    # ---- old log-probs -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs_and_entropy(self, response_tokens: torch.Tensor, forward_micro_batch_size: Optional[int] = None,
                                 lengths: Optional[torch.Tensor] = None):
        """fp32 (logp, entropy), each [B, S-1], of tokens 1..S-1 of ``response_tokens`` [B, S]; on every rank.

        ``lengths`` [B] (optional): real tokens of each row; positions t >= lengths[b] - 1 are then not computed
        (0). Micro-batches as in training (``_microbatches`` with ``forward_micro_batch_size`` rows when there is no
        token budget). The same forward and log-prob code as the loss (so the first update of a step has ratio
        exactly 1).
        """
        fmbs = int(forward_micro_batch_size or self.forward_micro_batch_size)
        n, s = response_tokens.shape
        batch = {"response_tokens": response_tokens}
        if lengths is not None:
            batch["response_lengths"] = lengths
        groups, micro = self._microbatches(batch, fmbs)
        for mb in micro:
            mb.pop("response_lengths", None)

        def forward(mb, model):
            mb = self._on_device(mb)
            out = self._forward_logprob(model, mb)

            def collect(out, non_loss_data=True):
                logp, entropy = self._logprobs_entropy(out, mb["response_tokens"], model)
                return torch.stack([logp, entropy])  # [2, b, S_mb-1]

            return out, collect

        out = self._schedule(forward, micro, True, collect_non_loss_data=True)
        stacked = None
        if mcore_ps.is_pipeline_last_stage():
            stacked = torch.zeros(2, n, max(s - 1, 0), dtype=torch.float32)
            for g, o in zip(groups, out):
                w = min(s - 1, o.shape[2])
                stacked[:, torch.tensor(g, dtype=torch.long), :w] = o[:, :, :w].float().cpu()
        stacked = broadcast_tensor_within_pp(stacked, dtype=torch.float32).cpu()
        return stacked[0], stacked[1]

    @torch.no_grad()
    def get_inference_log_probs(self, response_tokens, forward_micro_batch_size=None):
        """NeMo-Aligner's API: log-probs [B, S-1] (see get_logprobs_and_entropy)."""
        return self.get_logprobs_and_entropy(response_tokens, forward_micro_batch_size)[0]
