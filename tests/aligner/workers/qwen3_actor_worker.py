"""torchrun worker: the DAPO actor on a tiny Qwen3 / Qwen3-MoE restored the launcher's way from the checkpoint that
the conversion command writes, and one training step through NeMo-Aligner on CPU.

Env: FAMILY (qwen3 | qwen3_moe), TP, PP (world = 2, or 1 at TP = PP = 1; NeMo 2.1 refuses EP without
megatron_amp_O2 and MoE with TP without sequence parallelism, neither of which the CPU local spec runs), HF_DIR (a
transformers-5 checkpoint made by tests/megatron/workers/qwen3_hf_worker.py; HF_LOGITS its logits), TOK_DIR,
OUT_DIR. Steps, on every rank:
  1. convert_ckpt.hf_to_nemo at the same layout -> OUT_DIR/nemo (model_config.yaml carries qk_layernorm: true);
  2. cfg = load_and_override_model_config(ckpt, runtime keys) and load_from_nemo(MegatronGPTDAPOActorModel, ...),
     as examples/train_gpt_dapo.py does: NeMo builds the model through the actor's model_provider_func;
  3. the actor's log-probs of the HF test tokens vs log_softmax of the HF logits (real vocabulary);
  4. one ActorPolicy.train_step (SGD) on 4 samples with advantage +1: the loss is finite, every parameter
     (QK-norm weights included) gets a gradient step, and the trained responses' mean log-prob rises.
Writes rank<r>.json.
"""
import json
import os

from tests.support import nemo_cpu  # noqa: F401  (patches first)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject  # noqa: E402

from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo  # noqa: E402
from nemo_dapo.aligner.actor import MegatronGPTDAPOActorModel  # noqa: E402
from nemo_dapo.aligner.trainer import ActorPolicy, algorithm_settings  # noqa: E402
from nemo_dapo.core.settings import build_loss  # noqa: E402
from nemo_dapo.core.types import RolloutBatch  # noqa: E402
from tests.support.policy_inputs import NoSchedule  # noqa: E402
from nemo_dapo.megatron.convert_ckpt import hf_to_nemo  # noqa: E402
from tests.megatron.workers.qwen3_models import PADDED_VOCAB, VOCAB, tokens  # noqa: E402

FAMILY, TP, PP = os.environ["FAMILY"], int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
OUT = os.environ["OUT_DIR"]
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "normalization",
             "position_embedding_type", "share_embeddings_and_output_weights", "make_vocab_size_divisible_by",
             "bias", "activation", "layernorm_epsilon", "encoder_seq_length", "max_position_embeddings")


def runtime_cfg():
    """The run's model keys (what conf/gpt_dapo_actor.yaml + a recipe give), architecture keys left to the checkpoint."""
    cfg = nemo_cpu.tiny_gpt_cfg(os.environ["TOK_DIR"], tp=TP, pp=PP, mbs=2, gbs=4, dapo=nemo_cpu.DAPO_DEFAULTS,
                                moe_token_dispatcher_type="alltoall",
                                optim={"name": "sgd", "lr": 0.0, "momentum": 0.0})
    for key in ARCH_KEYS:
        cfg.pop(key, None)
    return cfg


def rollout(n=4, prompt=4):
    ids = tokens()
    ids = torch.cat([ids, ids.flip(0)])[:n]
    return RolloutBatch(prompt_ids=ids[:, :prompt], prompt_mask=torch.ones(n, prompt, dtype=torch.long),
                        response_ids=ids[:, prompt:], response_mask=torch.ones(n, ids.shape[1] - prompt),
                        group_ids=torch.zeros(n, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool),
                        advantages=torch.ones(n))


def main():
    nemo_cpu.allow_full_checkpoint_loads()
    nemo_cpu.init_parallel(TP, PP)  # torch.distributed + megatron's groups, for the conversion and NeMo
    ckpt = os.path.join(OUT, "nemo")
    hf_to_nemo(os.environ["HF_DIR"], ckpt, dtype="fp32", padded_vocab=PADDED_VOCAB, tokenizer_dir=os.environ["TOK_DIR"])
    res = {"checkpoint_qk_layernorm": OmegaConf.load(os.path.join(ckpt, "model_config.yaml")).qk_layernorm}

    nemo_cpu.quiet_nemo()
    cfg = load_and_override_model_config(ckpt, runtime_cfg())
    actor = load_from_nemo(MegatronGPTDAPOActorModel, cfg, nemo_cpu.cpu_trainer(), strict=True, restore_path=ckpt)
    actor.valid_vocab = VOCAB  # as generation.build_generator sets it: the engine's vocabulary
    inner = actor.model[0] if isinstance(actor.model, list) else actor.model
    inner = getattr(inner, "module", inner)
    norm = inner.decoder.layers[0].self_attention.q_layernorm
    res["q_layernorm"] = [type(norm).__name__, list(norm.normalized_shape)]
    # the modules' _extra_state is neither saved nor loaded (megatron/extra_state.py): none stays a ShardedObject
    values = list(nested_values(actor.sharded_state_dict()))
    res["extra_state"] = dict(
        persistent=sum(isinstance(v, ShardedObject) and v.key.endswith("_extra_state") for v in values),
        local=sum(isinstance(v, LocalNonpersistentObject) for v in values))

    # 3. log-probs against transformers 5
    ids = tokens()
    want = torch.log_softmax(torch.load(os.environ["HF_LOGITS"])[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    actor.eval()
    with torch.no_grad():
        logp, _ = actor.get_logprobs_and_entropy(ids)
    res["logp_max_diff"] = (logp - want).abs().max().item()

    # 4. one training step
    batch = rollout()
    policy = ActorPolicy(actor, torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.5),
                         NoSchedule(), gradient_clip_val=None)
    old, _ = policy.logprobs(batch)
    batch.old_logp = old
    before = {n: p.detach().clone() for n, p in inner.named_parameters()}
    actor.train()
    # the loss of model.dapo.algorithm, as the trainer's builder makes it
    loss_fn = build_loss(algorithm_settings(cfg).loss, max_new_tokens=int(cfg.dapo.length_params.max_length))
    metrics = policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=loss_fn)
    new, _ = policy.logprobs(batch)
    changed = {n: not torch.equal(before[n], p.detach()) for n, p in inner.named_parameters()}
    res["qk_norm_values"] = {n: p.detach().flatten().tolist() for n, p in inner.named_parameters()
                             if "q_layernorm" in n or "k_layernorm" in n}
    res.update(loss=float(metrics["loss"]), skipped=metrics["skipped"],
               unchanged=[n for n, c in changed.items() if not c],
               qk_norm_params=[(n, c) for n, c in changed.items() if "q_layernorm" in n or "k_layernorm" in n],
               mean_logp_before=float((old * batch.response_mask).sum() / batch.response_mask.sum()),
               mean_logp_after=float((new * batch.response_mask).sum() / batch.response_mask.sum()))
    with open(os.path.join(OUT, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
