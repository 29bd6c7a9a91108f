"""Worker: the DAPO trainer end to end on CPU, wired like an NeMo-Aligner launch script.

exp_manager (checkpoint callback, resume) -> DAPO actor -> init_using_ptl (optimizer, LR schedule, restore) ->
DAPOPromptDataset -> LocalRewardClient (rule-based verifier) -> MegatronSampler (debug generator) -> DAPOTrainer.fit.

Env: TP, PP (world = TP x PP x DP), TOK_DIR, OUT_DIR, MAX_STEPS, RESUME_FROM (a checkpoint path, optional), OPTIM
(``sgd``, the default, or ``mcore``: ``mcore_distributed_optim``, megatron-core's DDP and distributed Adam as the MoE
recipes train, warmed up with that optimizer after ``init_using_ptl`` since its gradients live in DDP's buffers),
PHASE (name of the metrics file; ``deadline``: the run's time limit comes after the first generation batch of
step 2, so the trainer must save that partial step and stop). The tiny model first gets a short supervised warm-up (fresh runs only) so that it
answers "Answer: 1" or "Answer: 2" about half the time: groups then have mixed accuracy and dynamic sampling has
something to keep and something to filter. Writes ``<PHASE>_rank<r>.json`` with every logged metric.
"""
import json
import os
import random
from dataclasses import dataclass

if os.environ.get("OPTIM") == "mcore":
    os.environ.setdefault("SHIM_LEVEL", "4")  # megatron's optimizer checks param.type() == 'torch.cuda.*'
from tests.support import nemo_cpu  # noqa: F401,E402  (patches first)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nemo.utils.exp_manager import exp_manager  # noqa: E402
from nemo_aligner.utils.distributed import Timer  # noqa: E402
from nemo_aligner.utils.train_script_utils import (  # noqa: E402
    CustomLoggerWrapper,
    add_custom_checkpoint_callback,
    extract_optimizer_scheduler_from_ptl_model,
    init_distributed,
    init_using_ptl,
)
from nemo_dapo.aligner.dataset import DAPOPromptDataset  # noqa: E402
from nemo_dapo.aligner.generation import MegatronSampler  # noqa: E402
from nemo_dapo.aligner.reward_client import (LocalRewardClient, check_installed_nemo,  # noqa: E402
                                              check_response_decoder)
from nemo_dapo.aligner.trainer import DAPOTrainer  # noqa: E402
from tests.support.dist import forbid_fork  # noqa: E402

TP, PP = int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
OUT, PHASE = os.environ["OUT_DIR"], os.environ.get("PHASE", "run")
RESUME = os.environ.get("RESUME_FROM")
MCORE = os.environ.get("OPTIM", "sgd") == "mcore"
OPTIMIZER = {"name": "mcore_distributed_optim", "betas": [0.9, 0.98], "weight_decay": 0.0} if MCORE else \
    {"name": "sgd", "momentum": 0.9, "weight_decay": 0.0}


@dataclass
class Row:
    prompt: str
    ground_truth: str
    id: str


def rows(n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        out.append(Row(f"Question: what is {a} + {b}?", str(rng.choice([1, 2])), f"p{seed}-{i}"))
    return out


class RecordingLogger:
    """A PTL-logger stand-in that keeps what CustomLoggerWrapper sends it."""

    def __init__(self):
        self.records = []

    def log_metrics(self, metrics, step):
        self.records.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    def finalize(self, status):
        self.records.append({"finalized": status})


class DeadlineTimer:
    """NeMo-Aligner's run Timer API (start_time / get_time_remaining) with the time limit reached once ``expired()``
    says so: a clock driven by the trainer's progress instead of the wall clock."""

    def __init__(self, expired):
        self.expired = expired

    def start_time(self):
        pass

    def get_time_remaining(self):
        return 0.0 if self.expired() else 1e9


class SFTLoss:
    """Token-mean negative log-likelihood as a core LossFn (used for the warm-up only)."""

    tis_cap = None

    def normalizer(self, batch):
        return batch.mask.float().sum()

    def __call__(self, logp, entropy, mb, num_tokens):
        return -(logp * mb.mask).sum() / max(float(num_tokens), 1.0), {}


def warm_up(actor, steps: int = 60, opt=None) -> None:
    """Teach the random model to end with ' Answer: 1' or ' Answer: 2' (50/50) and EOS, with its own loss path
    (``opt``: the run's own optimizer, at its current learning rate; default a torch Adam at 1e-2)."""
    from nemo_dapo.megatron.layout import pack_rollout
    from nemo_dapo.core.loop_data import PromptSet
    from nemo_dapo.core.types import RolloutBatch

    tok = actor.tokenizer
    rng = random.Random(0)
    params = [p for p in actor.parameters() if p.requires_grad]
    opt = opt or torch.optim.Adam(params, lr=1e-2)
    data = rows(64, 1)
    for _ in range(steps):
        picked = [data[rng.randrange(len(data))] for _ in range(8)]
        prompt_ids, prompt_mask = PromptSet([tok.text_to_ids(r.prompt) for r in picked], ["0"] * 8,
                                            pad_id=tok.eos_id).collate(range(8))
        resp = [tok.text_to_ids(f" Answer: {rng.choice([1, 2])}") + [tok.eos_id] for _ in picked]
        width = max(len(r) for r in resp)
        ids = torch.tensor([r + [tok.eos_id] * (width - len(r)) for r in resp])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in resp])
        b = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=mask,
                         group_ids=torch.arange(8), truncated=torch.zeros(8, dtype=torch.bool),
                         old_logp=torch.zeros_like(mask), advantages=torch.zeros(8))
        opt.zero_grad()
        actor.prepare_for_training_step()
        actor.get_loss_and_metrics(pack_rollout(b, tok.eos_id), forward_only=False, loss_fn=SFTLoss())
        actor.finish_training_step()
        opt.step()
    opt.zero_grad()


def main() -> None:
    """A spawned process (a verifier pool, say) re-imports this file: everything runs under main()."""
    max_steps = int(os.environ.get("MAX_STEPS", "2"))
    nemo_cpu.init_parallel(TP, PP)
    nemo_cpu.quiet_nemo()
    nemo_cpu.allow_full_checkpoint_loads()
    # megatron-core's optimizer clips inside its step with the trainer's value (the launch sets it)
    ptl_trainer = nemo_cpu.cpu_trainer(max_steps=20, **({"gradient_clip_val": 1.0} if MCORE else {}))
    exp_cfg = OmegaConf.create({
        "explicit_log_dir": os.path.join(OUT, "run"), "exp_dir": None, "name": "dapo",
        "create_tensorboard_logger": False,
        "create_wandb_logger": False, "resume_if_exists": False, "resume_from_checkpoint": RESUME,
        "seconds_to_sleep": 0,  # NeMo sleeps ranks > 0 for 5 s so that rank 0 makes the log directory: one machine
        "create_checkpoint_callback": True,
        "checkpoint_callback_params": {"monitor": "step", "mode": "max", "save_top_k": -1, "save_last": False,
                                       "always_save_nemo": False, "save_nemo_on_train_end": False,
                                       "filename": "dapo-{step}-{consumed_samples}", "model_parallel_size": TP * PP}})
    exp_manager(ptl_trainer, exp_cfg)
    algorithm = dict(nemo_cpu.ALGORITHM_DEFAULTS, clip_c=3.0, dynamic_sampling=dict(
        nemo_cpu.ALGORITHM_DEFAULTS["dynamic_sampling"], on_budget_exhausted="raise", max_age=2))
    dapo = dict(nemo_cpu.DAPO_DEFAULTS, algorithm=algorithm, length_params={"max_length": 6},
                sampling_params={"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                 "repetition_penalty": 1.0, "end_strings": []})
    _, actor = nemo_cpu.build_actor(TP, PP, mbs=2, gbs=4, tokenizer_dir=os.environ["TOK_DIR"], dapo=dapo,
                                    trainer=ptl_trainer,
                                    # SGD by default: torch AdamW keeps a 0-dim "step" per parameter, which NeMo
                                    # 2.1's dist-checkpoint optimizer sharding rejects (the GPU path uses fused /
                                    # distributed Adam); NeMo-Aligner's own functional tests train with SGD too.
                                    optim=dict(OPTIMIZER, lr=0.05, sched={
                                        "name": "CosineAnnealing", "warmup_steps": 2, "constant_steps": 0,
                                        "min_lr": 0.005}))
    init_distributed(ptl_trainer, actor, use_te=False)
    train_ds = DAPOPromptDataset(rows(40, 2), actor.tokenizer, max_prompt_len=32)
    val_ds = DAPOPromptDataset(rows(6, 3), actor.tokenizer, max_prompt_len=32)
    dummy_dl = torch.utils.data.DataLoader(train_ds, batch_size=2, collate_fn=lambda items: items)
    if RESUME is None and not MCORE:
        warm_up(actor)
    init_using_ptl(ptl_trainer, actor, dummy_dl, train_ds)
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(actor)
    if RESUME is None and MCORE:
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 1e-2
        warm_up(actor, opt=optimizer)
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
    ckpt_callback = add_custom_checkpoint_callback(ptl_trainer, actor)
    recorder = RecordingLogger()
    trainer_cfg = OmegaConf.create({
        "max_epochs": 10, "max_steps": max_steps, "val_check_interval": 1, "save_interval": 1,
        "gradient_clip_val": 1.0, "save_time_s": 600,
        "prompts_per_step": 2, "ppo_epochs": 1, "seed": 5, "shuffle_minibatches": True,
        "rollout": {"on_filler_full": "abort", "max_staleness": 1, "round_tokens": 8, "overlap": False},
        "val": {"n_samples": 2, "temperature": 1.0, "top_p": 1.0, "seed": 0, "batch_size": 8, "max_problems": None}})
    mark = {}

    def after_first_batch_of_step_2() -> bool:
        if dapo_trainer.step < 1:
            return False
        gen = dapo_trainer.loop.counters["gen_batches"]
        return gen > mark.setdefault("gen_batches_after_step_1", gen)

    timer = DeadlineTimer(after_first_batch_of_step_2) if PHASE == "deadline" else Timer(None)
    dapo_trainer = DAPOTrainer(trainer_cfg, actor, optimizer, scheduler, train_ds, val_ds,
                               LocalRewardClient(actor.tokenizer, num_workers=1), MegatronSampler(actor),
                               CustomLoggerWrapper([recorder]), ckpt_callback, timer)
    start = dapo_trainer.step
    writer_cases = other_checkpoint_ios() if PHASE == "full" else {}
    # the fast path of the rewards' decoder against NeMo's own ids_to_text (this tokenizer and the image build's)
    decoder_problems = check_response_decoder(actor.tokenizer) + check_installed_nemo() if PHASE == "full" else []
    forbid_fork()  # every checkpoint save of fit() writes in this process (nemo_dapo/megatron/dist_save.py)
    dapo_trainer.fit()
    rank = torch.distributed.get_rank()
    with open(os.path.join(OUT, f"{PHASE}_rank{rank}.json"), "w") as f:
        json.dump({"start_step": start, "checkpoint_writer": dapo_trainer.checkpoint_writer,
                   "writer_cases": writer_cases, "decoder_problems": decoder_problems,
                   "records": recorder.records, "state": {
            k: v for k, v in dapo_trainer.state_dict().items() if k not in ("loop", "time_budget")},  # timings vary
            "carried_groups": len(dapo_trainer.loop.filler.state_dict()["groups"]),
            "counters": dict(dapo_trainer.loop.counters)}, f, indent=1)
    torch.distributed.barrier()


def other_checkpoint_ios() -> dict:
    """What write_checkpoints_in_process makes of NeMo's other checkpoint IO settings (real NeMo objects)."""
    from types import SimpleNamespace

    from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO
    from nemo_dapo.aligner.compat import write_checkpoints_in_process

    def on(io):
        return write_checkpoints_in_process(SimpleNamespace(strategy=SimpleNamespace(unwrapped_checkpoint_io=io)))

    parallel = DistributedCheckpointIO("torch_dist", parallel_save=True, torch_dist_multiproc=3)
    return {"async": on(DistributedCheckpointIO("torch_dist", async_save=True)),
            "zarr": on(DistributedCheckpointIO("zarr")), "parallel": on(parallel),
            "parallel_threads": parallel.save_sharded_strategy.base_strategy.thread_count, "torch": on(None)}


if __name__ == "__main__":
    main()
