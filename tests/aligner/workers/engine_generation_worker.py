"""Worker: the DAPO trainer on CPU (real NeMo / NeMo-Aligner stack, TP=2 over gloo) generating through an engine
server that the test started (``rollout_engine: local``), wired by ``generation.build_generator(actor, cfg=...)``.

Env: TOK_DIR, OUT_DIR, HF_DIR (what the server loaded), ENGINE_ADDRESS, ENGINE_DUMP_DIR (the server's dumps),
ROLLOUT (trainer.dapo.rollout.on_filler_full; suspend: partial rollouts in rounds of 2 tokens), STEPS, TP (2: one
engine that rank 0 owns; 1: data parallelism, an engine per rank, ENGINE_ADDRESS and ENGINE_DUMP_DIR templates with
``{local}`` / ``{rank}``).
Writes ``engine_rank<r>.json``: the owners, rank 0's comparison of the engine's weights (after the initial push and
after the trained rollout steps) with the actor's HF-named gather, and the steps' metrics.
"""
import glob
import json
import os

from tests.support import nemo_cpu  # noqa: F401  (patches first)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nemo.utils.exp_manager import exp_manager  # noqa: E402
from nemo_aligner.utils.distributed import Timer  # noqa: E402
from nemo_aligner.utils.train_script_utils import (  # noqa: E402
    CustomLoggerWrapper, add_custom_checkpoint_callback, extract_optimizer_scheduler_from_ptl_model,
    init_distributed, init_using_ptl)
from nemo_dapo.aligner.compat import pack_state, unpack_state  # noqa: E402
from nemo_dapo.aligner.dataset import DAPOPromptDataset  # noqa: E402
from nemo_dapo.aligner.engine_generation import AlignerEngineGenerator, _ActorWeights  # noqa: E402
from nemo_dapo.aligner.generation import build_generator  # noqa: E402
from nemo_dapo.aligner.reward_client import LocalRewardClient  # noqa: E402
from nemo_dapo.aligner.trainer import DAPOTrainer  # noqa: E402
from tests.aligner.workers.trainer_worker import RecordingLogger, rows, warm_up  # noqa: E402

TP = int(os.environ.get("TP", "2"))
PLACEMENT = os.environ.get("PLACEMENT", "colocated")  # separate: engines on TCP, refit over a gloo weight group
OUT = os.environ["OUT_DIR"]


def dump_dir() -> str:
    return os.environ["ENGINE_DUMP_DIR"].format(rank=dist.get_rank())


def compare_with_engine(actor, hf_config, update: int, owns: bool) -> dict:
    """Every rank gathers the actor's HF tensors; an owner compares them with its engine's dump ``update``."""
    mine = {}
    for bucket in _ActorWeights(actor, hf_config, None).hf_weight_buckets(1 << 20):
        mine.update({n: t.detach().clone() for n, t in bucket})
    if not owns:
        return {}
    engine = torch.load(os.path.join(dump_dir(), f"update{update}.pt"))
    return {"names_equal": sorted(mine) == sorted(engine), "n": len(mine),
            "max_abs_diff": max(float((mine[k].float() - engine[k].float()).abs().max()) for k in mine)}


def main() -> None:
    nemo_cpu.init_parallel(TP, 1)
    nemo_cpu.quiet_nemo()
    ptl_trainer = nemo_cpu.cpu_trainer(max_steps=20)
    exp_manager(ptl_trainer, OmegaConf.create({
        "explicit_log_dir": os.path.join(OUT, "run"), "exp_dir": None, "name": "dapo",
        "create_tensorboard_logger": False, "create_wandb_logger": False, "resume_if_exists": False,
        "create_checkpoint_callback": True,
        "seconds_to_sleep": 0,  # NeMo sleeps ranks > 0 for 5 s so that rank 0 makes the log directory: one machine
        "checkpoint_callback_params": {"monitor": "step", "mode": "max", "save_top_k": -1, "save_last": False,
                                       "always_save_nemo": False, "save_nemo_on_train_end": False,
                                       "filename": "dapo-{step}", "model_parallel_size": TP}}))
    mode, steps = os.environ.get("ROLLOUT", "abort"), int(os.environ.get("STEPS", "1"))
    overlap = mode == "overlap"  # partial rollouts with a round run while the trainer trains
    mode = "suspend" if overlap else mode
    dapo = dict(nemo_cpu.DAPO_DEFAULTS, algorithm=dict(nemo_cpu.ALGORITHM_DEFAULTS, clip_c=3.0, tis_cap=2.0),
                length_params={"max_length": 6},
                sampling_params={"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                 "repetition_penalty": 1.0, "end_strings": []})
    _, actor = nemo_cpu.build_actor(TP, 1, mbs=2, gbs=4, tokenizer_dir=os.environ["TOK_DIR"], dapo=dapo,
                                    trainer=ptl_trainer,
                                    optim={"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0,
                                           "sched": {"name": "CosineAnnealing", "warmup_steps": 1,
                                                     "constant_steps": 0, "min_lr": 0.005}})
    init_distributed(ptl_trainer, actor, use_te=False)
    train_ds = DAPOPromptDataset(rows(40, 2), actor.tokenizer, max_prompt_len=32)
    warm_up(actor, steps=30)
    init_using_ptl(ptl_trainer, actor, torch.utils.data.DataLoader(train_ds, batch_size=2,
                                                                   collate_fn=lambda items: items), train_ds)
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(actor)
    cfg = OmegaConf.create({"trainer": {"devices": 2, "dapo": {"rollout_engine": "local", "engine_server": {
        "hf_model_dir": os.environ["HF_DIR"], "tensor_parallel_size": TP, "pipeline_parallel_size": 1,
        "address": os.environ["ENGINE_ADDRESS"], "address_env": "UNSET_IN_THIS_TEST", "base_port": 0,
        "authkey_env": "NEMO_DAPO_ENGINE_AUTHKEY", "connect_timeout_s": 120.0, "request_timeout_s": 300.0,
        "weight_timeout_s": 60.0, "bucket_mb": 1, "dtype": None,
        "sleep_level": 0 if PLACEMENT == "separate" or overlap else 1, "placement": PLACEMENT,
        "weight_transport": "gloo" if PLACEMENT == "separate" else "shm"}}}})
    generator = build_generator(actor, cfg=cfg)  # connects (rank 0 owns the one engine) and pushes the weights
    assert isinstance(generator, AlignerEngineGenerator)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(os.environ["HF_DIR"])
    result = {"owners": generator.owners, "owns": generator.engine is not None, "valid_vocab": actor.valid_vocab,
              "hf_vocab": hf_config.vocab_size, "padded_vocab": actor.padded_vocab_size,
              "initial": compare_with_engine(actor, hf_config, 1, generator.engine is not None)}
    recorder = RecordingLogger()
    trainer_cfg = OmegaConf.create({
        "max_epochs": 10, "max_steps": steps, "val_check_interval": 0, "save_interval": 0, "gradient_clip_val": 1.0,
        "save_time_s": 600, "prompts_per_step": 2, "ppo_epochs": 1, "seed": 5, "shuffle_minibatches": True,
        "rollout": {"on_filler_full": mode, "max_staleness": 1, "round_tokens": 2, "overlap": overlap}})
    dapo_trainer = DAPOTrainer(trainer_cfg, actor, optimizer, scheduler, train_ds, None,
                               LocalRewardClient(actor.tokenizer, num_workers=1), generator,
                               CustomLoggerWrapper([recorder]), add_custom_checkpoint_callback(ptl_trainer, actor),
                               Timer(None))
    train_step, result["round_in_flight"] = dapo_trainer.policy.train_step, []

    def watched(*args, **kw):  # a round submitted to the engines and not collected yet, while the trainer trains
        result["round_in_flight"].append(dapo_trainer.loop._ahead is not None)
        return train_step(*args, **kw)
    dapo_trainer.policy.train_step = watched
    dapo_trainer.fit()
    # what a checkpoint of the trainer holds (packed as the NeMo checkpoint stores it): the suspended groups
    state = unpack_state(pack_state(dapo_trainer.state_dict()))["loop"]
    result["saved_suspended"] = [g["uid"] for g in state["partial"]["suspended"]] if "partial" in state else None
    updates = len(glob.glob(os.path.join(dump_dir(), "update*.pt")))
    result.update(records=recorder.records, updates=updates, last_update=generator.last_update,
                  after_step=compare_with_engine(actor, hf_config, updates, generator.engine is not None))
    generator.close()
    with open(os.path.join(OUT, f"engine_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    dist.barrier()


if __name__ == "__main__":
    main()
