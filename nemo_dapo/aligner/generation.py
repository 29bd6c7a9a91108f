"""The legacy rollout generators of the NeMo-Aligner path (the ``Generator`` protocol of core/types.py), used with
``trainer.dapo.rollout_engine: legacy``; the engine-server generators (trtllm, vllm, local) are in
``engine_generation.py``.

* :class:`TRTLLMGenerator` drives NeMo-Aligner's ``GPTGenerateTRTLLM``: the engine is built on first use and refit
  from the actor's current weights before the first generation after every update (never twice for the same
  weights); prompts go in as NeMo-Aligner wants them (right-padded + lengths), in static batches of the engine's
  ``generation_batch_size``; with ``reshard`` (PP folded into DP for generation) the pipeline stages of one replica
  generate disjoint slices of its prompts and exchange the results. Dense models only (the exporter cannot refit
  experts); the fixes it needs around NeMo 2.1's exporter are in ``legacy_export``.
* :class:`MegatronSampler` is the debugging path without TensorRT-LLM: plain ancestral sampling with the training
  model itself (one full forward per new token through megatron's schedule, so TP and PP work; no KV cache). Slow,
  exact, seeded: meant for tiny models and tests.

Both return responses in the core layout (right-padded ids, mask with EOS, ``truncated`` = no EOS within the cap).
``check_generation_lengths`` validates the sequence budget of the legacy engine; ``build_trtllm_engine`` calls it
before building the engine.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from nemo_dapo.cluster.config_load import nemo_model_key, required
from nemo_dapo.megatron.layout import pack_tokens
from nemo_dapo.aligner.legacy_export import (TPPaddedVocab, attention_bias_overrides, banned_ids_list,
                                             engine_config_overrides, with_zero_dense_bias)
from nemo_dapo.core import engine_registry
from nemo_dapo.core.packing import cut_responses
from nemo_dapo.core.types import Generation, RolloutBatch
from nemo_dapo.core.sampling import sample_next

# NeMo / megatron are imported inside the generators, so that importing this module (``check_generation_lengths``,
# the package's lazy exports) loads nothing heavy.

# Keys of conf/gpt_dapo_actor.yaml are read strictly (``required``); NeMo's own model keys (TP, EP, biases, experts)
# with NeMo's defaults (``nemo_model_key``), as NeMo built the model from them.


def _packed_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, room: int, pad_id: int) -> tuple:
    """(tokens [B, P_max + room] right-padded with ``pad_id``, prompt lengths [B]) from left-padded prompts."""
    b = prompt_ids.shape[0]
    stub = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                        response_ids=torch.full((b, room), pad_id, dtype=torch.long),
                        response_mask=torch.zeros(b, room), group_ids=torch.zeros(b, dtype=torch.long),
                        truncated=torch.zeros(b, dtype=torch.bool))
    return pack_tokens(stub, pad_id)


def check_generation_lengths(model_cfg) -> None:
    """Raise when ``max_input_len + max_length > encoder_seq_length`` (NeMo-Aligner asserts it only when the engine
    is built, i.e. after the model has loaded). Keys (all required): model.dapo.trt_llm.max_input_len (null: the
    encoder length minus the generation length), model.dapo.length_params.max_length, model.encoder_seq_length."""
    seq = int(required(model_cfg, "encoder_seq_length", "model"))
    gen = required(model_cfg, "dapo.length_params.max_length", "model")
    if gen is None or int(gen) < 1:
        raise ValueError(f"model.dapo.length_params.max_length must be a positive generation cap, got {gen}")
    max_in = required(model_cfg, "dapo.trt_llm.max_input_len", "model")
    max_in = seq - int(gen) if max_in is None else int(max_in)
    if max_in < 1 or max_in + int(gen) > seq:
        raise ValueError(
            f"model.dapo.trt_llm.max_input_len ({max_in}) + model.dapo.length_params.max_length ({gen}) = "
            f"{max_in + int(gen)} must be <= model.encoder_seq_length ({seq}) and max_input_len >= 1: lower the "
            f"prompt or generation budget, or raise model.encoder_seq_length (e.g. 2048 + 20480 needs >= 22528)")


def _response_from_rows(rows: torch.Tensor, prompt_lengths: torch.Tensor, total_lengths: torch.Tensor,
                        is_end: torch.Tensor, max_new_tokens: int, pad_id: int) -> Generation:
    """NeMo-Aligner's (prompt + response rows, total lengths, is_end) -> core Generation (right-padded)."""
    ids, mask = cut_responses(rows, prompt_lengths, (total_lengths - prompt_lengths).clamp(min=0, max=max_new_tokens),
                              pad_id)
    return Generation(response_ids=ids, response_mask=mask.float(), truncated=~is_end.bool())


def _cut_at_out_of_vocab(rows: torch.Tensor, totals: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Total lengths [B] cut before the first id outside [0, vocab_size) in ``rows`` [B, L] (prompt + response):
    such an id is no token, and NeMo-Aligner's check would clamp it to another token we would then train on."""
    pos = torch.arange(rows.shape[1])[None, :]
    bad = ((rows < 0) | (rows >= vocab_size)) & (pos < totals[:, None])
    first = torch.where(bad, pos, torch.full_like(pos, rows.shape[1])).min(dim=1).values
    return torch.minimum(totals, first)


class MegatronSampler:
    """Debug ``Generator``: ancestral sampling with the actor's Megatron model (TP/PP aware, no KV cache).

    Every rank of a model-parallel group samples with the same seed from the same gathered logits, so they agree
    token by token. Stops a row at EOS (or any of ``stop_token_ids``); ``logprobs`` are those of the sampling
    distribution (after temperature / top-p), as an inference engine would report them.
    """

    def __init__(self, actor, *, stop_token_ids: Optional[list] = None):
        if int(nemo_model_key(actor.cfg, "expert_model_parallel_size")) > 1:
            # Expert all-to-alls span data-parallel ranks, which generate different numbers of tokens and batches.
            raise NotImplementedError("MegatronSampler does not support expert parallelism (EP > 1); debug MoE "
                                      "runs with model.expert_model_parallel_size=1 or use TensorRT-LLM")
        self.actor = actor
        self.eos_id = actor.tokenizer.eos_id
        self.stop_ids = torch.tensor(sorted({self.eos_id, *(stop_token_ids or [])}), dtype=torch.long)
        self.vocab_size = int(actor.tokenizer.vocab_size)

    def update_weights(self, policy) -> None:
        """Nothing to do: the sampler runs the training weights."""

    @torch.no_grad()
    def _next_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, vocab] at ``positions`` [B] of ``tokens`` [B, S], on every rank."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        from nemo_aligner.utils.distributed import broadcast_tensor_within_pp

        actor = self.actor
        attention_mask, _, position_ids = actor.get_ltor_masks_and_position_ids(tokens)
        batch = {"response_tokens": tokens, "attention_mask": attention_mask, "position_ids": position_ids}

        def fwd(data_iterator, model):
            mb = {k: v.cuda() for k, v in next(data_iterator).items()}
            logits = actor._forward(model, mb)

            def collect(logits, non_loss_data=True):
                rows = torch.arange(logits.shape[0], device=logits.device)
                picked = logits[rows, positions.to(logits.device)]  # [B, V/tp]
                return gather_from_tensor_model_parallel_region(picked.float())

            return logits, collect

        out = get_forward_backward_func()(
            forward_step_func=fwd, data_iterator=actor._make_data_iterator_list(iter([batch])), model=actor.model,
            num_microbatches=1, forward_only=True, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
            collect_non_loss_data=True)
        logits = broadcast_tensor_within_pp(out[0] if out else None, dtype=torch.float32).cpu()
        logits[:, self.vocab_size:] = float("-inf")  # Megatron pads the vocabulary; never sample padding ids
        return logits

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> Generation:
        b = prompt_ids.shape[0]
        tokens, p = _packed_prompts(prompt_ids, prompt_mask, max_new_tokens, self.eos_id)  # [B, P_max + R]
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else 0)
        out_ids = torch.full((b, max_new_tokens), self.eos_id, dtype=torch.long)
        out_lp = torch.zeros(b, max_new_tokens)
        n = torch.zeros(b, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        self.actor.prepare_for_inference()
        try:
            for t in range(max_new_tokens):
                # row b's next token goes to position p_b + t: predicted from position p_b + t - 1
                logits = self._next_logits(tokens[:, :int(p.max()) + t], p + t - 1)
                tok, lp = sample_next(logits, temperature, top_p, gen)
                live = ~done
                rows = torch.nonzero(live).squeeze(1)
                tokens[rows, p[rows] + t] = tok[rows]
                out_ids[rows, t], out_lp[rows, t] = tok[rows], lp[rows]
                n[rows] += 1
                done |= live & torch.isin(tok, self.stop_ids)
                if bool(done.all()):
                    break
        finally:
            self.actor.finish_inference()
        mask = torch.arange(max_new_tokens)[None, :] < n[:, None]
        out_ids = torch.where(mask, out_ids, torch.full_like(out_ids, self.eos_id))
        return Generation(response_ids=out_ids, response_mask=mask.float(), truncated=~done,
                          logprobs=out_lp * mask)


class TRTLLMGenerator:
    """``Generator`` over NeMo-Aligner's ``GPTGenerateTRTLLM`` (``engine``; built from ``actor.cfg`` when None).

    ``reshard``: the engine is TP-only and the pipeline stages of a replica share its generation work (NeMo-Aligner's
    ``trainer.<algo>.trt_llm.reshard``). ``refit_gather``: optional callable replacing the exporter's weight gather
    (``gather_and_reshard_model(model_config, model, storage_dtype) -> state dict``).

    Around NeMo 2.1's exporter: the vocabulary it sees is V rounded up to the TP size (ids in [V, V_tp) are banned
    in every sampling call and cut from a response should one appear); attention biases reach the engine
    (``attn_bias``); with ``trt_llm.unload_engine_train`` the engine freed after a call is reloaded and refit by the
    next one; the sampling parameters are set in full on every call. Dense models only: the exporter cannot refit
    experts (``trainer.dapo.rollout_engine: trtllm`` can).
    """

    def __init__(self, actor, engine=None, *, reshard: Optional[bool] = None, refit_gather=None):
        cfg = actor.cfg
        if nemo_model_key(cfg, "num_moe_experts"):
            raise NotImplementedError(
                f"model.num_moe_experts={cfg.num_moe_experts}: NeMo-Aligner's TensorRT-LLM engine (rollout_engine: "
                "legacy) cannot refit MoE weights (NeMo 2.1's exporter has no expert names, megatron-core 0.10's "
                "converter rejects them); set trainer.dapo.rollout_engine: trtllm")
        trt = required(cfg, "dapo.trt_llm", "model")
        self.actor = actor
        self.reshard = bool(required(trt, "reshard", "model.dapo.trt_llm")) if reshard is None else reshard
        self.engine = engine if engine is not None else build_trtllm_engine(actor)
        self.vocab_size = int(actor.tokenizer.vocab_size)  # V: ids >= V are not tokens
        tp = int(nemo_model_key(cfg, "tensor_model_parallel_size"))  # the engine's TP (NeMo's exporter: = training TP)
        self.engine.tokenizer = TPPaddedVocab(actor.tokenizer, tp)  # what the first refit hands to the exporter
        self._bias = attention_bias_overrides(cfg, str(required(trt, "model_type", "model.dapo.trt_llm")))
        exporter = self.engine.trt_llm_exporter
        gather = refit_gather if refit_gather is not None else exporter.gather_and_reshard_model
        if nemo_model_key(cfg, "qkv_bias") and not nemo_model_key(cfg, "bias"):
            gather = with_zero_dense_bias(gather, int(cfg.hidden_size))
        exporter.gather_and_reshard_model = gather
        sc = self.engine.sampling_config
        # the configured top-k (sampling_params.top_k, or 1 with use_greedy): what a non-greedy call restores
        self._top_k = sc.top_k
        sc.update(bad_words_list=banned_ids_list(self.vocab_size, self.engine.tokenizer.vocab_size,
                                                  int(self.engine.generation_batch_size)))
        self._stale = True  # weights changed since the last refit, or the engine was unloaded (or never built)
        self.pad_id = actor.tokenizer.eos_id

    def update_weights(self, policy) -> None:
        """Mark the engine stale; the refit happens right before the next generation (as NeMo-Aligner does in
        ``prepare_for_inference``), so a validation pass right after an update does not refit twice."""
        self._stale = True

    def _refit_if_stale(self) -> None:
        if self._stale:
            # The first refit builds the engine; after an unload, NeMo's exporter.refit reloads the engine file
            # (load_distributed: its build-time weights) and then writes the current weights into it.
            with engine_config_overrides(self._bias):
                self.engine.refit(self.actor.model)
            self._stale = False

    def _set_sampling(self, max_new_tokens: int, temperature: float, top_p: float, seed: Optional[int]) -> None:
        if max_new_tokens > self.engine.max_generation_length:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the engine's max_generation_length="
                             f"{self.engine.max_generation_length} (model.dapo.length_params.max_length)")
        greedy = temperature == 0
        # every field on every call: the engine's SamplingConfig is shared by all calls
        self.engine.sampling_config.update(max_new_tokens=max_new_tokens, top_p=top_p,
                                           temperature=1.0 if greedy else temperature,
                                           top_k=1 if greedy else self._top_k)
        if seed is not None:
            self.engine.rng_generator.manual_seed(int(seed))

    def _my_rows(self, b: int) -> tuple:
        """Rows this rank generates and the pipeline group to share results with (reshard with PP > 1 only)."""
        if not self.reshard:
            return list(range(b)), None
        from megatron.core import parallel_state as mcore_ps

        pp = mcore_ps.get_pipeline_model_parallel_world_size()
        if pp == 1:
            return list(range(b)), None
        r = mcore_ps.get_pipeline_model_parallel_rank()
        return list(range(r * b // pp, (r + 1) * b // pp)), mcore_ps.get_pipeline_model_parallel_group()

    def _generate_rows(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple:
        """Static batches of exactly ``generation_batch_size`` (the last one padded with copies of its first row)."""
        from nemo_aligner.utils.parallel_state import trt_llm_reshard_region

        from nemo_dapo.aligner.compat import device

        gbs = int(self.engine.generation_batch_size)
        outs, totals = [], []
        for start in range(0, tokens.shape[0], gbs):
            t, l_ = tokens[start:start + gbs], lengths[start:start + gbs]
            real = t.shape[0]
            if real < gbs:
                t = torch.cat([t, t[:1].expand(gbs - real, -1)])
                l_ = torch.cat([l_, l_[:1].expand(gbs - real)])
            with trt_llm_reshard_region() if self.reshard else nullcontext():
                res = self.engine.generate((t.to(device()), l_.to(device())))
            outs.append(res["response_tokens"][:real].cpu())
            totals.append(res["response_lengths"][:real].cpu())
        width = max(o.shape[1] for o in outs)
        outs = [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_id) for o in outs]
        return torch.cat(outs), torch.cat(totals)

    def _is_end(self, rows: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        """NeMo-Aligner's check: ended with EOS or an end string, and every id inside the tokenizer's range."""
        from nemo.collections.nlp.modules.common.text_generation_strategy import GPTModelTextGenerationStrategy
        from nemo_aligner.utils.text_generation_utils import verify_is_valid_and_clamp_range_

        end_strings = list(required(self.actor._sampling_params, "end_strings", "model.dapo.sampling_params") or [])
        strategy = GPTModelTextGenerationStrategy(self.actor)
        return verify_is_valid_and_clamp_range_(rows, totals, strategy, self.actor.tokenizer, end_strings).cpu()

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None) -> Generation:
        b = prompt_ids.shape[0]
        tokens, p = _packed_prompts(prompt_ids, prompt_mask, 0, self.pad_id)  # right-padded prompts + lengths
        if int(p.max()) > self.engine.max_input_len:
            raise ValueError(f"a prompt of {int(p.max())} tokens exceeds the engine's max_input_len="
                             f"{self.engine.max_input_len} (model.dapo.trt_llm.max_input_len)")
        self.actor.prepare_for_inference()
        try:
            self._refit_if_stale()
            self._set_sampling(max_new_tokens, temperature, top_p, seed)
            mine, pp_group = self._my_rows(b)
            result = None
            if mine:
                rows, totals = self._generate_rows(tokens[mine], p[mine])
                kept = _cut_at_out_of_vocab(rows, totals, self.vocab_size)  # before _is_end clamps the ids
                is_end = self._is_end(rows, totals)
                result = _response_from_rows(rows, p[mine], kept, is_end, max_new_tokens, self.pad_id)
        finally:
            self.actor.finish_inference()
            self.engine.free()  # unloads only with trt_llm.unload_engine_train
            if getattr(self.engine, "unload_engine_train", False):
                self._stale = True  # the next call must reload the engine and refit it, not reuse a freed one
        if pp_group is not None:
            parts = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(parts, result, group=pp_group)
            return Generation.cat([x for x in parts if x is not None], self.pad_id)
        return result


def build_trtllm_engine(actor):
    """NeMo-Aligner's ``GPTGenerateTRTLLM`` configured from ``model.dapo`` (trt_llm, sampling/length params)."""
    from nemo_dapo.aligner.compat import trtllm_generator_class

    cfg = actor.cfg
    check_generation_lengths(cfg)

    def trt(key):
        return required(cfg, f"dapo.trt_llm.{key}", "model")

    def sp(key):
        return required(cfg, f"dapo.sampling_params.{key}", "model")

    max_len = int(required(cfg, "dapo.length_params.max_length", "model"))
    max_in = trt("max_input_len")  # null: what the generation cap leaves (as check_generation_lengths)
    return trtllm_generator_class()(
        model_cfg=cfg, end_strings=list(sp("end_strings") or []), tokenizer=actor.tokenizer,
        sample_temperature=float(sp("temperature")), sample_top_k=int(sp("top_k")), sample_top_p=float(sp("top_p")),
        repetition_penalty=float(sp("repetition_penalty")), max_generation_length=max_len,
        max_input_len=int(cfg.encoder_seq_length - max_len if max_in is None else max_in),
        generation_batch_size=int(required(cfg, "dapo.rollout_micro_batch_size", "model")),
        use_greedy=bool(sp("use_greedy")), trt_model_type=str(trt("model_type")), seed=trt("seed"),
        unload_engine_train=bool(trt("unload_engine_train")), reshard_model=bool(trt("reshard")),
        trt_model_dir=str(trt("model_dir")))


def build_generator(actor, *, refit_gather=None, cfg=None):
    """The rollout generator of ``trainer.dapo.rollout_engine`` (``cfg``: the whole run config; without it, legacy).

    trtllm | vllm | local: an engine-server client per rank (``engine_generation.build_engine_generator``; the
    servers are started by the launcher). legacy: TRTLLMGenerator when ``model.dapo.trt_llm.enable``, else the
    MegatronSampler debug path. TRTLLMGenerator refuses MoE models (NeMo 2.1's exporter cannot refit experts)."""
    engine = "legacy" if cfg is None else cfg.trainer.dapo.rollout_engine  # a key of gpt_dapo_actor.yaml
    if engine_registry.is_served(engine):
        from nemo_dapo.aligner.engine_generation import build_engine_generator

        return build_engine_generator(actor, cfg)
    if engine != "legacy":  # the validator refuses it first; this guards a config that skipped it
        raise ValueError(f"trainer.dapo.rollout_engine={engine!r}: not an engine of nemo_dapo.core.engine_registry "
                         f"(one of {engine_registry.rollout_engines()})")
    if required(actor.cfg, "dapo.trt_llm.enable", "model"):
        generator = TRTLLMGenerator(actor, refit_gather=refit_gather)  # refuses MoE (names the trtllm engine)
        actor.valid_vocab = int(actor.tokenizer.vocab_size)  # the engine bans the ids it pads the vocabulary with
        return generator
    return MegatronSampler(actor)
