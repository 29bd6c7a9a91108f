"""Train a GPT policy with DAPO on NeMo-Aligner 0.7.0: Megatron actor, TensorRT-LLM rollouts, local rule-based reward.

One process per GPU, launched under MPI (TensorRT-LLM needs its MPI rank to equal the torch rank):

    srun --mpi=pmix ... python -u examples/train_gpt_dapo.py --config-name recipes/qwen2.5-32b_h100 \
        pretrained_checkpoint.restore_from_path=/ckpt/qwen2.5-32b.nemo \
        "model.data.data_prefix={train: [/data/dapo-math-17k.parquet], validation: [/data/aime-2024.parquet]}"
    mpirun -n 8 --allow-run-as-root python -u examples/train_gpt_dapo.py ...      # one node, interactive

(containers/dapo.sbatch does the former; docs/cluster.md has the whole procedure.) The structure follows
NeMo-Aligner's examples/nlp/gpt/train_gpt_reinforce_actor.py; the actor and trainer classes come from the algorithm
registry (entry point ``nemo_aligner.algorithms: dapo``), the config from conf/gpt_dapo_actor.yaml + a recipe.
"""
import sys

import torch
import torch.multiprocessing as mp
from megatron.core.utils import divide
from omegaconf import OmegaConf

from nemo.core.config import hydra_runner
from nemo.utils import logging
from nemo.utils.exp_manager import exp_manager
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.distributed import Timer
from nemo_aligner.utils.train_script_utils import (
    CustomLoggerWrapper,
    add_custom_checkpoint_callback,
    extract_optimizer_scheduler_from_ptl_model,
    init_distributed,
    init_using_ptl,
    resolve_and_create_trainer,
)
from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo
from nemo_dapo.aligner.compat import check_versions
from nemo_dapo.cluster.config_load import register_resolvers, reject_moved_overrides
from nemo_dapo.cluster.config_validate import validate_config
from nemo_dapo.aligner.dataset import build_prompt_dataset
from nemo_dapo.aligner.generation import build_generator
from nemo_dapo.cluster.registry import get as get_algorithm
from nemo_dapo.aligner.reward_client import LocalRewardClient

register_resolvers()  # multiply / int_div / subtract, as in NeMo-Aligner's launchers
mp.set_start_method("spawn", force=True)


@hydra_runner(config_path="../conf", config_name="gpt_dapo_actor")
def main(cfg) -> None:
    check_versions()  # warns when the stack is not the one NeMo-Aligner 0.7.0 ships with
    validate_config(cfg)  # layout, batches, lengths, loss ranges: fail before anything is loaded
    cfg.model = load_and_override_model_config(cfg.pretrained_checkpoint.restore_from_path, cfg.model)
    validate_config(cfg)  # again with the checkpoint's architecture (heads, experts; plan.arch must agree)

    logging.info("\n\n************** Experiment configuration ***********")
    logging.info(f"\n{OmegaConf.to_yaml(cfg)}")

    algorithm = get_algorithm("dapo")
    trainer = resolve_and_create_trainer(cfg, "dapo")
    exp_manager(trainer, cfg.exp_manager)
    logger = CustomLoggerWrapper(trainer.loggers)

    ptl_model = load_from_nemo(algorithm.load_actor(), cfg.model, trainer, strict=True,
                               restore_path=cfg.pretrained_checkpoint.restore_from_path)
    init_distributed(trainer, ptl_model, cfg.model.get("transformer_engine", False))

    train_ds = build_prompt_dataset(cfg.model.data, "train", ptl_model.tokenizer)
    val_ds = build_prompt_dataset(cfg.model.data, "validation", ptl_model.tokenizer)

    # NeMo sizes its schedulers from a training dataloader; ours draws prompts itself, so PTL gets a stand-in
    # with NeMo's per-rank batch (global batch / DP) that is never iterated.
    dummy_train_dataloader = torch.utils.data.DataLoader(
        dataset=train_ds, batch_size=divide(cfg.model.global_batch_size, parallel_state.get_data_parallel_world_size())
    )
    init_using_ptl(trainer, ptl_model, dummy_train_dataloader, train_ds)  # also restores a checkpoint, if any
    del ptl_model._train_dl
    del dummy_train_dataloader

    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(ptl_model)
    ckpt_callback = add_custom_checkpoint_callback(trainer, ptl_model)
    logger.log_hyperparams(OmegaConf.to_container(cfg))

    rm = LocalRewardClient(ptl_model.tokenizer, mode=cfg.reward.verifier, num_workers=cfg.reward.num_workers,
                           max_workers=cfg.reward.max_workers)
    generator = build_generator(ptl_model, cfg=cfg)  # trainer.dapo.rollout_engine picks the engine
    timer = Timer(cfg.exp_manager.get("max_time_per_run") if cfg.exp_manager else None)

    # The trainer resumes from the trainer state stored inside the restored checkpoint (counters, prompt sampler,
    # the dynamic-sampling groups carried over), not from the checkpoint's file name.
    dapo_trainer = algorithm.load_trainer()(
        cfg=cfg.trainer.dapo, model=ptl_model, optimizer=optimizer, scheduler=scheduler, train_ds=train_ds,
        val_ds=val_ds, rm=rm, generator=generator, logger=logger, ckpt_callback=ckpt_callback, run_timer=timer,
    )
    try:
        dapo_trainer.fit()
    finally:
        rm.close()


if __name__ == "__main__":
    # Hydra refuses an old algorithm key (trainer.dapo.group_size=8) without naming where it went: say it first
    reject_moved_overrides(a for a in sys.argv[1:] if not a.startswith("-") and "=" in a)
    main()
