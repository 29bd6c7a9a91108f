"""The ablation's base recipe (conf/recipes/tiny_cpu_long.yaml): its task really gives the techniques work."""
import random

from nemo_dapo.local.config import load_config
from nemo_dapo.data.task import Sloppiness, sloppy_solution
from nemo_dapo.data.tokenizer import build_task_tokenizer
from nemo_dapo.local.run_data import make_task
from nemo_dapo.local.run_model import warmup_config


def _lengths(tokenizer, texts):
    return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + EOS


def test_long_recipe_lengths_span_the_cap_and_clean_answers_escape_the_penalty():
    cfg = load_config("tiny_cpu_long")
    task = make_task(cfg)
    tokenizer = build_task_tokenizer(task, n_rows=cfg.data.tokenizer_rows, seed=cfg.seed,
                                     vocab_size=cfg.data.tokenizer_vocab_size)
    cap, l_cache = cfg.rollout.max_new_tokens, cfg.algorithm.overlong.l_cache
    rows = task.rows("train", 400, seed=0)
    clean = _lengths(tokenizer, [r["extra_info"]["solution"] for r in rows])
    # Clean answers (format fault aside) sit below the penalty ramp, and vary in length by a factor of >= 2.5.
    assert max(clean) <= cap - l_cache and max(clean) >= 2.5 * min(clean)
    w = warmup_config(cfg)
    rng = random.Random(0)
    sloppy = _lengths(tokenizer, [sloppy_solution(r["extra_info"]["raw_problem"], rng,
                                                  Sloppiness(w.slip_prob, w.format_prob, w.ramble_prob,
                                                             w.ramble_passes)) for r in rows])
    over = sum(n > cap for n in sloppy) / len(sloppy)
    assert 0.1 <= over <= 0.4  # the warm-up teaches the base to run into the cap, often but not mostly


def test_long_recipe_runs_beside_another_and_updates_several_times_per_batch():
    cfg = load_config("tiny_cpu_long")
    t = cfg.trainer
    assert cfg.rollout.processes == 1 and t.max_samples is not None
    updates = t.ppo_epochs * -(-t.train_batch_size * cfg.algorithm.group_size // t.mini_batch_size)
    assert updates >= 4  # the importance ratio moves off 1, so the clip bounds act
    assert load_config("tiny_cpu").rollout.max_new_tokens == 40 and load_config("tiny_cpu").data.max_terms == 5
