"""GPU worker for test_aligner_trtllm.py: NeMo-Aligner's real TensorRT-LLM engine behind our TRTLLMGenerator.

Run inside the trainer image (containers/Dockerfile: NeMo-Aligner 0.7.0's stack, TensorRT-LLM 0.13, TE, apex), one GPU:
    python tests/gpu/aligner_trtllm_worker.py            (OUT_DIR=<dir> for the JSON report)

1. Builds a tiny Llama-style MegatronGPTDAPOActorModel (fp32, so that Megatron and the engine agree to the last bit
   of the argmax) and a TRTLLMGenerator over the real GPTGenerateTRTLLM.
2. Greedy generation; Megatron, teacher-forced on the engine's output, must pick the same token at (almost) every
   response position, and its log-prob of the engine's token must equal its maximum log-prob there.
3. Seeded sampling is reproducible; another seed gives other samples.
4. Refit: the actor's weights are perturbed, the generator told so; the next generation refits (no rebuild) and
   follows the NEW weights (agreement again), and differs from the old output.
5. Log-prob agreement after that first refit: one sampling call (temperature 1, no top-k/top-p) with TensorRT-LLM's
   ``output_log_probs``; the engine's log-prob of every sampled token must equal the actor's recomputed one (the
   training path, ``get_logprobs_and_entropy``) within LOGPROB_MAX_ABS / LOGPROB_MEAN_ABS nats (fp32 both sides).
   The worker exits non-zero right there when it does not.
The model has Qwen2's QKV bias (``qkv_bias``, set non-zero): the engine must carry it (``attn_bias``) for 2-5 to
hold. ``make_vocab_size_divisible_by: 1`` keeps Megatron's vocabulary equal to the tokenizer's: the engine samples
over the tokenizer's V, and the training log-softmax runs over Megatron's padded vocabulary.
Writes ``trtllm.json`` with the measured agreement, call counts and timings.
"""
import json
import os
import tempfile
import time

import torch

# The log-prob agreement after the first refit (fp32 engine vs fp32 Megatron; differences are accumulation order).
LOGPROB_MAX_ABS = 0.02  # nats, worst sampled token
LOGPROB_MEAN_ABS = 0.002  # nats, mean over sampled tokens


def tiny_cfg(tok_dir: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "precision": 32, "micro_batch_size": 4, "global_batch_size": 4, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "encoder_seq_length": 128, "max_position_embeddings": 128,
        "num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 4,
        "init_method_std": 0.05, "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0,
        "kv_channels": None, "apply_query_key_layer_scaling": False, "layernorm_epsilon": 1e-5,
        "make_vocab_size_divisible_by": 1, "pre_process": True, "post_process": True, "persist_layer_norm": False,
        "bias": False, "qkv_bias": True, "normalization": "rmsnorm", "activation": "fast-swiglu",
        "position_embedding_type": "rope",
        "rotary_base": 10000, "share_embeddings_and_output_weights": False,
        "tokenizer": {"library": "huggingface", "type": tok_dir, "use_fast": True},
        "megatron_amp_O2": False, "seed": 1234, "mcore_gpt": True, "transformer_engine": True,
        "activations_checkpoint_method": None, "activations_checkpoint_num_layers": None,
        "activations_checkpoint_granularity": None, "sequence_parallel": False,
        "data": {"data_prefix": None, "seq_length": 128, "reset_position_ids": False, "reset_attention_mask": False,
                 "eod_mask_loss": False},
        "optim": {"name": "fused_adam", "lr": 1e-4},
        "dapo": {"algorithm": {"eps_low": 0.2, "eps_high": 0.28, "clip_c": 10.0, "agg": "token-mean",
                               "overlong_filter": False, "tis_cap": None, "tis_level": "token",
                               "reject_logp_diff": None},
                 "rollout_micro_batch_size": 4,
                 "forward_micro_batch_size": 4, "sampling_params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                                    "repetition_penalty": 1.0, "end_strings": [],
                                                                    "use_greedy": False},
                 "length_params": {"max_length": 16},
                 "trt_llm": {"enable": True, "reshard": False, "max_input_len": 32, "model_type": "llama",
                             "seed": 0, "unload_engine_train": False,
                             "model_dir": os.path.join(tempfile.mkdtemp(), "trt_engine")}},
    })


def greedy_agreement(actor, prompt_ids, prompt_mask, gen) -> dict:
    """Teacher-force Megatron on prompt + engine response: fraction of response positions where Megatron's argmax is
    the engine's token, and the largest gap between Megatron's max log-prob and its log-prob of the engine token."""
    from nemo_dapo.megatron.layout import pack_rollout
    from nemo_dapo.core.types import RolloutBatch

    b = prompt_ids.shape[0]
    rb = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=gen.response_ids,
                      response_mask=gen.response_mask, group_ids=torch.arange(b), truncated=gen.truncated)
    packed = pack_rollout(rb, actor.tokenizer.eos_id)
    tokens = packed["response_tokens"].cuda()
    attn, _, pos = actor.get_ltor_masks_and_position_ids(tokens)
    with torch.no_grad():
        logits = actor.model(tokens, pos, attn).float()[:, :-1, : actor.tokenizer.vocab_size]
    logp = torch.log_softmax(logits, -1)
    mask = packed["mask"].cuda().bool()
    nxt = tokens[:, 1:]
    agree = (logits.argmax(-1) == nxt)[mask].float().mean().item()
    gap = (logp.max(-1).values - logp.gather(-1, nxt[..., None]).squeeze(-1))[mask].max().item()
    return {"argmax_agreement": agree, "max_logprob_gap": gap, "tokens": int(mask.sum())}


def logprob_agreement(actor, prompt_ids, prompt_mask, gen, engine_logprobs) -> dict:
    """Engine vs actor log-probs of the tokens the engine sampled. ``engine_logprobs`` [B, 1, L]: TensorRT-LLM's
    ``log_probs`` output (GenerationSession: [batch, beam, max_seq_length]), the token at row position j (prompt
    at 0..p_b-1, response token t at p_b + t) stored at index j."""
    from nemo_dapo.megatron.layout import pack_rollout
    from nemo_dapo.core.types import RolloutBatch

    b, r = gen.response_ids.shape
    p = prompt_mask.sum(-1).long()
    idx = (p[:, None] + torch.arange(r)[None, :]).clamp(max=engine_logprobs.shape[-1] - 1)
    by_position = engine_logprobs[:, 0].gather(1, idx)  # [B, R]
    by_step = engine_logprobs[:, 0, :r] if engine_logprobs.shape[-1] >= r else by_position
    rb = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=gen.response_ids,
                      response_mask=gen.response_mask, group_ids=torch.arange(b), truncated=gen.truncated,
                      engine_logp=by_position * gen.response_mask, old_logp=by_step * gen.response_mask)
    packed = pack_rollout(rb, actor.tokenizer.eos_id)
    actor_logp, _ = actor.get_logprobs_and_entropy(packed["response_tokens"])  # [B, S-1], the training path
    mask = packed["mask"].bool()
    diff = (packed["engine_logprobs"] - actor_logp).abs()[mask]
    alt = (packed["prev_logprobs"] - actor_logp).abs()[mask]
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "tokens": int(mask.sum()),
            "mean_engine_logprob": packed["engine_logprobs"][mask].mean().item(),
            "mean_actor_logprob": actor_logp[mask].mean().item(),
            # diagnosis only: the same comparison if the engine indexed log-probs by generation step
            "max_abs_diff_if_indexed_by_step": alt.max().item()}


def sample_with_engine_logprobs(gen, prompt_ids, prompt_mask, seed: int) -> tuple:
    """One seeded sampling call (temperature 1, top_p 1, the configured top_k=0) with TensorRT-LLM's
    ``output_log_probs`` on (a SamplingConfig field; ModelRunner.generate returns ``log_probs`` in its dict),
    captured from every static batch of the call. Returns (Generation, log_probs [B, 1, L])."""
    from tensorrt_llm.runtime import ModelRunner

    captured, original = [], ModelRunner.generate

    def capturing(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        captured.append(out["log_probs"].detach().float().cpu())
        return out

    ModelRunner.generate = capturing
    gen.engine.sampling_config.update(output_log_probs=True)
    try:
        out = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=seed)
    finally:
        ModelRunner.generate = original
        gen.engine.sampling_config.update(output_log_probs=False)
    gbs, b = int(gen.engine.generation_batch_size), prompt_ids.shape[0]
    width = max(c.shape[-1] for c in captured)
    rows = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1])) for c in captured])
    # the generator pads the last static batch with copies of its first row: keep the real rows, in order
    keep = [i for i in range(len(captured) * gbs) if i % gbs < min(gbs, b - (i // gbs) * gbs)]
    return out, rows[keep]


def main() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    from lightning.pytorch import Trainer
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy
    from nemo_dapo.aligner.actor import MegatronGPTDAPOActorModel
    from nemo_dapo.aligner.generation import TRTLLMGenerator
    from nemo_dapo.data.tokenizer import save_tokenizer, train_tokenizer

    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    tok_dir = save_tokenizer(train_tokenizer([f"Question: what is {a} + {b}? Answer: {a + b}\n" for a in range(40)
                                              for b in range(40)], vocab_size=400), tempfile.mkdtemp())
    trainer = Trainer(strategy=NLPDDPStrategy(), accelerator="gpu", devices=1, precision=32, logger=False,
                      enable_checkpointing=False, use_distributed_sampler=False)
    actor = MegatronGPTDAPOActorModel(cfg=tiny_cfg(tok_dir), trainer=trainer).cuda()
    with torch.no_grad():  # Megatron initialises biases to zero: make Qwen2's QKV bias matter from the start
        g = torch.Generator(device="cuda").manual_seed(1)
        for name, p in actor.named_parameters():
            if name.endswith("linear_qkv.bias"):
                p.copy_(0.5 * torch.randn(p.shape, device=p.device, generator=g))
    gen = TRTLLMGenerator(actor)
    exporter = gen.engine.trt_llm_exporter
    counts = {"build": 0, "refit": 0}
    for name in counts:
        orig = getattr(exporter, name)

        def counted(*a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(*a, **k)

        setattr(exporter, name, counted)

    tok = actor.tokenizer
    texts = [f"Question: what is {a} + {a + 3}?" for a in range(6)]
    ids = [tok.text_to_ids(t) for t in texts]
    width = max(len(x) for x in ids)
    prompt_ids = torch.tensor([[tok.eos_id] * (width - len(x)) + x for x in ids])
    prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    report = {}
    t0 = time.time()
    greedy = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=0.0, seed=0)
    report["first_generate_s"] = time.time() - t0  # includes the engine build
    report["greedy"] = greedy_agreement(actor, prompt_ids, prompt_mask, greedy)
    s1 = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=1.0, seed=5)
    s2 = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=1.0, seed=5)
    s3 = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=1.0, seed=6)
    report["sampling_reproducible"] = bool(torch.equal(s1.response_ids, s2.response_ids))
    report["sampling_seed_changes_output"] = not torch.equal(s1.response_ids, s3.response_ids)
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in actor.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, device=p.device, generator=g))
    gen.update_weights(None)
    t0 = time.time()
    after = gen.generate(prompt_ids, prompt_mask, max_new_tokens=16, temperature=0.0, seed=0)
    report["refit_generate_s"] = time.time() - t0
    report["after_refit"] = greedy_agreement(actor, prompt_ids, prompt_mask, after)
    report["refit_changed_output"] = not torch.equal(after.response_ids, greedy.response_ids)
    sampled, engine_lp = sample_with_engine_logprobs(gen, prompt_ids, prompt_mask, seed=7)
    lp = logprob_agreement(actor, prompt_ids, prompt_mask, sampled, engine_lp)
    lp["tolerance"] = {"max_abs": LOGPROB_MAX_ABS, "mean_abs": LOGPROB_MEAN_ABS}
    report["logprob_after_refit"] = lp
    report["calls"] = counts
    report["response_lengths"] = greedy.response_mask.sum(-1).tolist()
    out = os.environ.get("OUT_DIR", ".")
    with open(os.path.join(out, "trtllm.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    if not (lp["tokens"] > 0 and lp["max_abs_diff"] <= LOGPROB_MAX_ABS and lp["mean_abs_diff"] <= LOGPROB_MEAN_ABS):
        raise SystemExit(f"LOG-PROB MISMATCH after the first refit: engine vs actor |diff| max "
                         f"{lp['max_abs_diff']:.4g} (tolerance {LOGPROB_MAX_ABS}), mean {lp['mean_abs_diff']:.4g} "
                         f"(tolerance {LOGPROB_MEAN_ABS}) over {lp['tokens']} sampled tokens: {lp}")


if __name__ == "__main__":
    main()
