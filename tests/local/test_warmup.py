import dataclasses
import json

import pytest
import torch

from nemo_dapo.data.task import ArithmeticTask
from nemo_dapo.data.tokenizer import build_task_tokenizer
from nemo_dapo.local import warmup as W
from nemo_dapo.local.config import load_config
from nemo_dapo.local.run_model import BASE_DIR, prepare_base_model, warmup_config
from nemo_dapo.models.decoder import build_model

SMALL = dict(arch="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tok():
    return build_task_tokenizer(ArithmeticTask(), n_rows=300)


def settings(**over) -> W.WarmupConfig:
    """The main job's warm-up settings (conf: tiny_cpu), with ``over`` replaced."""
    return dataclasses.replace(warmup_config(load_config("tiny_cpu", [])), **over)


def small_model(tok):
    return build_model(SMALL, vocab_size=len(tok), pad_id=tok.pad_token_id, bos_id=tok.bos_token_id,
                       eos_id=tok.eos_token_id)


def test_sft_batch_layout(tok):
    batch = W.sft_batch(tok, ["p1", "a longer prompt"], ["=3\nAnswer: 3", "Answer: 12"])
    assert bool(batch.prompt_mask[:, -1].all()) and batch.prompt_ids[0, -3].item() == tok.bos_token_id
    for b, text in enumerate(["=3\nAnswer: 3", "Answer: 12"]):
        n = int(batch.response_mask[b].sum())
        assert batch.response_ids[b, n - 1].item() == tok.eos_token_id
        assert tok.decode(batch.response_ids[b, :n - 1].tolist()) == text
        assert bool((batch.response_ids[b, n:] == tok.pad_token_id).all())


def test_sft_loss_is_the_token_mean_nll():
    from tests.local.tiny_models import random_batch

    batch = random_batch()
    logp = -torch.rand(batch.response_ids.shape)
    loss, _ = W.sft_loss(logp, None, batch, float(batch.num_tokens()))
    expected = -sum(logp[b, t] for b in range(len(batch)) for t in range(logp.shape[1])
                    if batch.response_mask[b, t] > 0) / batch.num_tokens()
    assert float(loss) == pytest.approx(float(expected))


def test_stops_at_the_step_cap_and_is_deterministic(tok):
    cfg = settings(batch_size=8, max_steps=3, min_steps=1, eval_every=2, probe_size=4, max_new_tokens=8)
    runs = []
    for _ in range(2):
        model, stats = W.supervised_warmup(small_model(tok), tok, ArithmeticTask(), cfg, log=None)
        runs.append((model.lm_head.weight.clone(), stats))
    assert runs[0][1].stop_reason == "max_steps" and runs[0][1].steps == 3
    assert [h["step"] for h in runs[0][1].history] == [2, 3]
    assert torch.equal(runs[0][0], runs[1][0])
    assert [h["loss"] for h in runs[0][1].history] == [h["loss"] for h in runs[1][1].history]


@pytest.mark.parametrize("probes, reason, steps", [
    ([0.0, 0.1, 0.3], "in_band", 6),
    ([0.0, 0.8], "overshot", 4),
    ([0.0, 0.0, 0.0, 0.0], "max_steps", 8),
])
def test_stopping_rule(tok, monkeypatch, probes, reason, steps):
    scripted = iter(probes)
    monkeypatch.setattr(W, "sample_accuracy", lambda *a, **k: next(scripted))
    cfg = settings(batch_size=4, max_steps=8, min_steps=2, eval_every=2, target_low=0.2, target_high=0.5)
    _, stats = W.supervised_warmup(small_model(tok), tok, ArithmeticTask(), cfg, log=None)
    assert (stats.stop_reason, stats.steps) == (reason, steps)
    assert stats.probe_accuracy == probes[len(stats.history) - 1]


def test_sample_accuracy_scores_with_the_verifier(tok):
    rows = ArithmeticTask().rows("dev", 3, seed=0)
    model = small_model(tok)
    # a scorer that accepts everything / nothing brackets the verifier's answer
    always = W.sample_accuracy(model, tok, rows, temperature=1.0, max_new_tokens=4, seed=0, score=lambda t, g: True)
    never = W.sample_accuracy(model, tok, rows, temperature=1.0, max_new_tokens=4, seed=0, score=lambda t, g: False)
    real = W.sample_accuracy(model, tok, rows, temperature=1.0, max_new_tokens=4, seed=0)
    assert (always, never) == (1.0, 0.0) and real == 0.0  # 4 random tokens never spell "Answer: <right number>"


def test_save_warmup_writes_a_loadable_directory(tok, tmp_path):
    from nemo_dapo.data.tokenizer import load_tokenizer
    from nemo_dapo.models.decoder import load_model

    model = small_model(tok)
    W.save_warmup(tmp_path / "base", model, tok, W.WarmupStats(steps=3, stop_reason="max_steps"), settings())
    assert torch.equal(load_model(tmp_path / "base").lm_head.weight, model.lm_head.weight)
    assert load_tokenizer(tmp_path / "base").get_vocab() == tok.get_vocab()
    info = json.loads((tmp_path / "base" / "warmup.json").read_text())
    assert info["stats"]["steps"] == 3 and info["config"]["target_low"] == settings().target_low


@pytest.mark.slow
def test_the_main_jobs_base_model_reaches_the_band_before_the_step_cap(tmp_path):
    """The real thing: the base model of `nemo-dapo train` (conf: tiny_cpu), built as the job builds it (task,
    tokenizer, model, warm-up, cache), enters the probe band before the step cap."""
    cfg = load_config("tiny_cpu", [f"run_dir={tmp_path}"])
    _, _, info = prepare_base_model(cfg)
    stats = info["stats"]
    assert info["source"] == "warmup" and stats["stop_reason"] == "in_band", stats
    assert cfg.warmup.target_low <= stats["probe_accuracy"] <= cfg.warmup.target_high
    assert stats["steps"] < cfg.warmup.max_steps
    assert (tmp_path / BASE_DIR / "warmup.json").is_file()  # the job's next run reuses it


@pytest.mark.parametrize("probe, reason", [(0.2, "in_band"), (0.5, "in_band"), (0.5 + 1e-9, "overshot")])
def test_the_band_includes_both_of_its_ends(tok, monkeypatch, probe, reason):
    monkeypatch.setattr(W, "sample_accuracy", lambda *a, **k: probe)
    cfg = settings(batch_size=4, max_steps=8, min_steps=2, eval_every=2, target_low=0.2, target_high=0.5)
    _, stats = W.supervised_warmup(small_model(tok), tok, ArithmeticTask(), cfg, log=None)
    assert (stats.stop_reason, stats.steps) == (reason, 2)


def test_the_probe_is_drawn_from_the_dev_split_never_the_evaluation_split(tok, monkeypatch):
    task, seen = ArithmeticTask(), []
    monkeypatch.setattr(W, "sample_accuracy", lambda model, tokenizer, rows, **k: seen.append(rows) or 0.0)
    cfg = settings(batch_size=4, max_steps=1, min_steps=1, eval_every=1, probe_size=4)
    W.supervised_warmup(small_model(tok), tok, task, cfg, log=None)
    assert seen == [task.rows("dev", 4, seed=cfg.seed)] and seen[0] != task.rows("heldout", 4, seed=cfg.seed)


def test_the_time_cap_stops_the_warmup_with_a_last_probe(tok, monkeypatch):
    monkeypatch.setattr(W, "sample_accuracy", lambda *a, **k: 0.0)
    cfg = settings(batch_size=4, max_steps=5, min_steps=1, eval_every=10, max_seconds=1e-9)
    _, stats = W.supervised_warmup(small_model(tok), tok, ArithmeticTask(), cfg, log=None)
    assert (stats.stop_reason, stats.steps, [h["step"] for h in stats.history]) == ("max_seconds", 1, [1])
