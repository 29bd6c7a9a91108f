"""GPU worker for test_aligner_trtllm.py: NeMo-Aligner's real TensorRT-LLM engine behind our TRTLLMGenerator.

Run inside the NeMo container that ships NeMo-Aligner 0.7.0 (TensorRT-LLM 0.13, Transformer Engine, apex), one GPU:
    python tests/gpu/aligner_trtllm_worker.py            (OUT_DIR=<dir> for the JSON report)

1. Builds a tiny Llama-style MegatronGPTDAPOActorModel (fp32, so that Megatron and the engine agree to the last bit
   of the argmax) and a TRTLLMGenerator over the real GPTGenerateTRTLLM.
2. Greedy generation; Megatron, teacher-forced on the engine's output, must pick the same token at (almost) every
   response position, and its log-prob of the engine's token must equal its maximum log-prob there.
3. Seeded sampling is reproducible; another seed gives other samples.
4. Refit: the actor's weights are perturbed, the generator told so; the next generation refits (no rebuild) and
   follows the NEW weights (agreement again), and differs from the old output.
Writes ``trtllm.json`` with the measured agreement, call counts and timings.
"""
import json
import os
import tempfile
import time

import torch


def tiny_cfg(tok_dir: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "precision": 32, "micro_batch_size": 4, "global_batch_size": 4, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "encoder_seq_length": 128, "max_position_embeddings": 128,
        "num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 4,
        "init_method_std": 0.05, "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0,
        "kv_channels": None, "apply_query_key_layer_scaling": False, "layernorm_epsilon": 1e-5,
        "make_vocab_size_divisible_by": 128, "pre_process": True, "post_process": True, "persist_layer_norm": False,
        "bias": False, "normalization": "rmsnorm", "activation": "fast-swiglu", "position_embedding_type": "rope",
        "rotary_base": 10000, "share_embeddings_and_output_weights": False,
        "tokenizer": {"library": "huggingface", "type": tok_dir, "use_fast": True},
        "megatron_amp_O2": False, "seed": 1234, "mcore_gpt": True, "transformer_engine": True,
        "activations_checkpoint_method": None, "activations_checkpoint_num_layers": None,
        "activations_checkpoint_granularity": None, "sequence_parallel": False,
        "data": {"data_prefix": None, "seq_length": 128, "reset_position_ids": False, "reset_attention_mask": False,
                 "eod_mask_loss": False},
        "optim": {"name": "fused_adam", "lr": 1e-4},
        "dapo": {"eps_low": 0.2, "eps_high": 0.28, "clip_c": 10.0, "agg": "token-mean", "rollout_micro_batch_size": 4,
                 "forward_micro_batch_size": 4, "sampling_params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                                    "end_strings": [], "use_greedy": False},
                 "length_params": {"max_length": 16},
                 "trt_llm": {"enable": True, "reshard": False, "max_input_len": 32, "model_type": "llama",
                             "seed": 0, "unload_engine_train": False,
                             "model_dir": os.path.join(tempfile.mkdtemp(), "trt_engine")}},
    })


def greedy_agreement(actor, prompt_ids, prompt_mask, gen) -> dict:
    """Teacher-force Megatron on prompt + engine response: fraction of response positions where Megatron's argmax is
    the engine's token, and the largest gap between Megatron's max log-prob and its log-prob of the engine token."""
    from nemo_dapo.aligner.layout import pack_rollout
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
    report["calls"] = counts
    report["response_lengths"] = greedy.response_mask.sum(-1).tolist()
    out = os.environ.get("OUT_DIR", ".")
    with open(os.path.join(out, "trtllm.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
