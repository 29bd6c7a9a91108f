"""Two DAPO loop steps (core/loop.py) on MegatronPolicy under torchrun (2 ranks, gloo): TP=2, then EP=2 (MoE,
DP=2 with the DPReducer). Generation: a plain sampling decode on the megatron model itself (no KV cache; tiny sizes),
run for exactly ``max_new_tokens`` forwards so that ranks whose forward holds collectives (TP all-reduce, MoE
all-to-all) stay in step. Writes per-rank metrics and weight-change facts to $OUT_DIR/rank{r}.json.
"""
import json
import math
import os

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from nemo_dapo.core.dynamic_sampling import BatchFiller
from nemo_dapo.core.loop import DAPOLoop
from nemo_dapo.core.loop_data import PromptSet
from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.packing import pack_rows
from nemo_dapo.core.types import Generation
from nemo_dapo.core.sampling import sample_next
from nemo_dapo.megatron.model import unwrap
from tests.support.megatron_model import GPTSpec, build_gpt_model, destroy_parallel, initialize_parallel
from nemo_dapo.megatron.reduction import DPReducer
from tests.support.loop_settings import loop_settings
from tests.support.megatron_policy import MegatronPolicy

EOS, PAD, V = 2, 0, 64


class MegatronSampler:
    """Generator over a (PP = 1) megatron GPTModel: full forward per new token, vocab gathered over TP."""

    def __init__(self, model):
        self.model = unwrap(model)

    def update_weights(self, policy) -> None:
        pass  # shares the policy's module

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        b, p = prompt_ids.shape
        gen = torch.Generator().manual_seed(int(seed or 0))
        plen = prompt_mask.long().sum(-1)
        tokens = torch.full((b, p + max_new_tokens), PAD, dtype=torch.long)
        tokens[:, :p] = pack_rows(prompt_ids, plen, prompt_ids[:, :0], PAD, p)
        out = torch.full((b, max_new_tokens), PAD, dtype=torch.long)
        logps = torch.zeros(b, max_new_tokens)
        alive = torch.ones(b, dtype=torch.bool)
        self.model.eval()
        for t in range(max_new_tokens):  # always max_new_tokens forwards: collectives stay aligned across ranks
            s = p + t
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
            logits = self.model(tokens[:, :s], torch.arange(s).expand(b, s), causal)  # [b, s, V/tp]
            logits = gather_from_tensor_model_parallel_region(logits)
            last = logits[torch.arange(b), plen + t - 1].float()
            tok, lp = sample_next(last, temperature, top_p, gen)
            tok = torch.where(alive, tok, torch.full_like(tok, PAD))
            out[:, t], logps[:, t] = tok, torch.where(alive, lp, torch.zeros_like(lp))
            tokens[torch.arange(b), plen + t] = tok
            alive = alive & (tok != EOS)
        mask = torch.zeros(b, max_new_tokens)
        for r in range(b):
            row = out[r].tolist()
            n = row.index(EOS) + 1 if EOS in row else max_new_tokens
            mask[r, :n] = 1.0
        return Generation(response_ids=out * mask.long(), response_mask=mask, truncated=~(out == EOS).any(-1),
                          logprobs=logps * mask)


def reward_fn(response_ids, response_mask, ground_truths):
    """Correct when the first response token is even: about half of each group, so dynamic sampling keeps most."""
    acc = (response_ids[:, 0] % 2 == 0).float() * (response_mask[:, 0] > 0).float()
    return acc, acc, [str(int(a)) for a in acc]


def run(layout, spec, steps=2):
    initialize_parallel(*layout)
    torch.manual_seed(0)
    model = build_gpt_model(spec)
    policy = MegatronPolicy(model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_batch_size=2,
                            max_grad_norm=1.0)
    g = torch.Generator().manual_seed(3)
    prompts = PromptSet(prompt_ids=[torch.randint(3, V, (int(n),), generator=g).tolist()
                                    for n in torch.randint(2, 6, (16,), generator=g)],
                        ground_truths=["0"] * 16, pad_id=PAD)
    settings = loop_settings(group_size=4, mini_batch_size=8, max_new_tokens=6, overlong={"l_cache": 2}, seed=5)
    loop = DAPOLoop(policy=policy, generator=MegatronSampler(model), reward_fn=reward_fn,
                    loss_fn=make_loss_fn(eps_low=0.2, eps_high=0.28), prompts=prompts,
                    filler=BatchFiller(2, on_budget_exhausted="train_partial", max_gen_batches=3),
                    settings=settings, reducer=DPReducer())
    before = [p.detach().clone() for p in model.parameters()]
    metrics = [loop.step() for _ in range(steps)]
    changed = sum(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    finite = all(math.isfinite(v) for m in metrics for v in m.values())
    out = dict(metrics=metrics, params_changed=changed, params=len(before), finite=finite,
               dp=parallel_state.get_data_parallel_world_size())
    destroy_parallel()
    return out


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dense = GPTSpec(vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                    max_sequence_length=64)
    moe = GPTSpec(vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                  num_experts=4, max_sequence_length=64)
    res = {"tp2": run((2, 1, 1), dense), "ep2": run((1, 1, 2), moe)}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
