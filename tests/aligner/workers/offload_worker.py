"""Worker (one process, the CPU NeMo stack): NeMo-Aligner 0.7's own optimizer offload, driven as the engine path
drives it (aligner/engine_generation.offload_optimizer_states at the refit, ``onload_adam_states`` through
``prepare_for_training`` before the next update), on an optimizer with apex DistributedFusedAdam's state layout.

apex's DistributedFusedAdam needs its CUDA extensions, so ``BucketAdam`` stands in for it with exactly what
NeMo-Aligner's helper touches (nemo_aligner/utils/utils.py: ``offload_distributed_adam``,
``dist_adam_load_state_bucket_into_device``): ``state_dict(state_dict_format=1, gather_on_root=False)["state"]
["buckets"]`` are the live state buckets, each with ``params_shard`` (fp32 master), ``param_remainders_shard``,
``exp_avg_shard`` and ``exp_avg_sq_shard``, which the step reads from the bucket every time.

Env: OUT_DIR, DEVICE (cpu | cuda). Writes offload.json.
"""
import json
import os
import types

from tests.support import nemo_cpu  # noqa: F401  (patches first)

import torch  # noqa: E402

from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel  # noqa: E402
from nemo_dapo.aligner.actor import MegatronGPTDAPOActorModel  # noqa: E402
from nemo_dapo.aligner.engine_generation import offload_optimizer_states  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cpu")


class BucketAdam:
    """AdamW over flat fp32 master shards kept in state buckets (the layout above); one bucket per parameter."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
        self.params, self.lr, self.betas, self.eps, self.wd, self.t = list(params), lr, betas, eps, weight_decay, 0
        self.state = {"buckets": [types.SimpleNamespace(
            params_shard=p.detach().float().flatten().clone(), param_remainders_shard=None,
            exp_avg_shard=torch.zeros(p.numel(), device=p.device),
            exp_avg_sq_shard=torch.zeros(p.numel(), device=p.device)) for p in self.params]}

    def state_dict(self, state_dict_format=2, gather_on_root=True):
        assert (state_dict_format, gather_on_root) == (1, False), "NeMo-Aligner asks for the local v1 layout"
        return {"state": {"buckets": self.state["buckets"]}, "param_groups": []}

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for p, b in zip(self.params, self.state["buckets"]):
            g = p.grad.float().flatten()
            b.exp_avg_shard.mul_(b1).add_(g, alpha=1 - b1)
            b.exp_avg_sq_shard.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (b.exp_avg_sq_shard / (1 - b2 ** self.t)).sqrt().add_(self.eps)
            b.params_shard.mul_(1 - self.lr * self.wd).addcdiv_(b.exp_avg_shard, denom, value=-self.lr / (1 - b1 ** self.t))
            p.copy_(b.params_shard.view_as(p))


class Actor:
    """The DAPO actor's offload / onload methods (inherited unchanged from NeMo-Aligner's PPO actor)."""

    offload_adam_states = MegatronGPTDAPOActorModel.offload_adam_states
    onload_adam_states = MegatronGPTDAPOActorModel.onload_adam_states

    def __init__(self, seed, offload):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(16, 8).to(DEVICE)
        self._optimizer = BucketAdam(self.model.parameters())
        self.to_offload_adam_states = offload
        self.distributed_adam_offload_manager = None

    def update(self, seed):
        torch.manual_seed(seed)
        x = torch.randn(4, 16, device=DEVICE)
        self.model.zero_grad()
        self.model(x).pow(2).mean().backward()
        self._optimizer.step()


def snapshot(actor):
    return [{k: getattr(b, k).detach().clone() for k in ("params_shard", "exp_avg_shard", "exp_avg_sq_shard")}
            for b in actor._optimizer.state["buckets"]]


def devices(actor):
    return sorted({getattr(b, k).device.type for b in actor._optimizer.state["buckets"]
                   for k in ("params_shard", "exp_avg_shard", "exp_avg_sq_shard")})


def main():
    out = {"inherited": MegatronGPTDAPOActorModel.offload_adam_states is MegatronGPTActorModel.offload_adam_states
           and MegatronGPTDAPOActorModel.onload_adam_states is MegatronGPTActorModel.onload_adam_states}
    with_offload, plain = Actor(0, offload=True), Actor(0, offload=False)
    for step in range(3):  # update, refit (offload), generation, onload, next update: as the engine path runs
        for a in (with_offload, plain):
            a.update(100 + step)
        before = snapshot(with_offload)
        buckets_before = [id(b) for b in with_offload._optimizer.state["buckets"]]
        offload_optimizer_states(with_offload)
        offload_optimizer_states(plain)  # to_offload False: NeMo-Aligner enters a nullcontext
        out.setdefault("devices_offloaded", devices(with_offload))
        out.setdefault("manager_entered", with_offload.distributed_adam_offload_manager is not None)
        offload_optimizer_states(with_offload)  # a second offload (e.g. validation after the refit) is a no-op
        with_offload.onload_adam_states()
        plain.onload_adam_states()
        after = snapshot(with_offload)
        out.setdefault("states_equal", []).append(all(torch.equal(x[k], y[k]) for x, y in zip(before, after)
                                                      for k in x))
        out.setdefault("same_buckets", []).append(
            buckets_before == [id(b) for b in with_offload._optimizer.state["buckets"]])
        out.setdefault("devices_onloaded", devices(with_offload))
    for a in (with_offload, plain):
        a.update(200)
    out["params_equal"] = all(torch.equal(p, q) for p, q in zip(with_offload.model.parameters(),
                                                                  plain.model.parameters()))
    out["params_moved"] = not torch.equal(with_offload.model.weight, Actor(0, offload=False).model.weight)
    with open(os.path.join(os.environ["OUT_DIR"], "offload.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
