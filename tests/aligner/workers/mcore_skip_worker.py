"""One process: the DAPO actor built by NeMo 2.1 with ``model.optim.name=mcore_distributed_optim`` (megatron-core's
DDP and distributed optimizer, wrapped by NeMo as the MoE recipes get it), trained by ``ActorPolicy.train_step``:
step 1 as is, step 2 with the gradients of one parameter turned NaN after the backward (where a bf16 overflow would
leave them; the loss stays finite). Prints one JSON line: both steps' loss / grad_norm / skipped, and whether step 2
left the weights untouched."""
import json
import os

os.environ.setdefault("SHIM_LEVEL", "4")  # megatron's optimizer checks param.type() == 'torch.cuda.*'
from tests.support import nemo_cpu  # noqa: E402  (patches first)

import torch  # noqa: E402

from nemo_dapo.aligner.trainer import ActorPolicy, algorithm_settings  # noqa: E402
from nemo_dapo.core.settings import build_loss  # noqa: E402
from tests.support.policy_inputs import NoSchedule, random_rollout  # noqa: E402


def main():
    optim = {"name": "mcore_distributed_optim", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.98]}
    _, actor = nemo_cpu.build_actor(1, 1, optim=optim, trainer=nemo_cpu.cpu_trainer(gradient_clip_val=1.0))
    actor.setup_mcore_distributed_parallel()  # what NeMo's setup() does for this optimizer
    optimizer = actor.configure_optimizers()
    optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
    policy = ActorPolicy(actor, optimizer, NoSchedule(), gradient_clip_val=1.0)
    loss_fn = build_loss(algorithm_settings(actor.cfg).loss, max_new_tokens=8)
    batch = random_rollout()
    batch.old_logp = policy.logprobs(batch)[0]
    keys = ("loss", "grad_norm", "skipped")
    out = {"optimizer": type(optimizer).__name__}
    out["step1"] = {k: policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=loss_fn).get(k) for k in keys}

    finish = actor.finish_training_step

    def finish_with_a_nan():
        finish()
        next(p for p in actor.parameters() if getattr(p, "main_grad", None) is not None).main_grad.fill_(float("nan"))

    actor.finish_training_step = finish_with_a_nan
    inner = actor.model[0] if isinstance(actor.model, list) else actor.model
    before = [p.detach().clone() for p in inner.parameters()]
    out["step2"] = {k: policy.train_step(batch, norm=float(batch.num_tokens()), loss_fn=loss_fn).get(k) for k in keys}
    out["weights_unchanged"] = all(torch.equal(b, p.detach()) for b, p in zip(before, inner.parameters()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
