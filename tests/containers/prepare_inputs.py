"""The inputs a user brings to ``containers/dapo.sbatch``, at test size (run once per test session, one process).

    python tests/containers/prepare_inputs.py OUT_DIR

writes, for the CPU task (``nemo_dapo.data.task.ArithmeticTask``, two-term chains of operands <= 4, answers 0..8):

* ``tokenizer/``: the task's byte-level BPE tokenizer, the TOKENIZER the checkpoint was converted with: 384
  tokens, a multiple of 64, so that Megatron pads the vocabulary alike at TP=1 (the checkpoint) and TP=2 (the
  run); a templated prompt is ~20 tokens;
* ``data/train.jsonl`` (16 training problems) and ``data/val.jsonl`` (the 2 held-out problems), verl schema;
* ``checkpoint/``: the NeMo checkpoint directory (``model_config.yaml`` + ``model_weights/``) a user brings: written
  by ``nemo-dapo convert hf-to-nemo``'s function from a Hugging Face export (``hf_warm/``, by ``nemo-to-hf``'s) of
  the tiny megatron-core GPT of ``tests/support/nemo_cpu.py`` (2 layers, width 32), warmed up at TP=1 for a few
  supervised updates on ``Answer: <ground truth>`` so that it writes the verifier's format and is right now and
  then: groups of mixed accuracy, which dynamic sampling keeps. Its config holds only the converter's keys (NeMo's
  own save, ``nemo_saved/``, carries every NeMo key, which hid a launch failure);
* ``hf/``: a Hugging Face Llama of the same shape with RANDOM weights, the HF_MODEL the engine servers load (they
  only get the policy's weights through the refit, so a wrong refit shows up as a wrong policy);
* ``inputs.json``: these paths and the sizes.
"""
from __future__ import annotations

import json
import random
import sys
import tarfile
from pathlib import Path

from tests.support import nemo_cpu  # noqa: F401  (patches first)

import torch  # noqa: E402

TASK = dict(min_terms=2, max_terms=2, max_operand=4, max_value=8)
SEQ_LEN, HIDDEN, LAYERS = 96, 32, 2


def write_data(out: Path, task) -> dict:
    (out / "data").mkdir(parents=True, exist_ok=True)
    files = {}
    for name, split, n in (("train", "train", 16), ("val", "heldout", 2)):
        path = out / "data" / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in task.rows(split, n, seed=0)))
        files[name] = str(path)
    return files


def warm_up(actor, rows: list, steps: int) -> None:
    """Supervised updates on ``prompt -> 'Answer: <ground truth>' EOS`` through the actor's own loss path."""
    from nemo_dapo.megatron.layout import pack_rollout
    from nemo_dapo.core.loop_data import PromptSet
    from nemo_dapo.core.types import RolloutBatch

    class SFTLoss:  # token-mean NLL as a core LossFn
        tis_cap = None

        def normalizer(self, batch):
            return batch.mask.float().sum()

        def __call__(self, logp, entropy, mb, num_tokens):
            return -(logp * mb.mask).sum() / max(float(num_tokens), 1.0), {}

    tok, rng = actor.tokenizer, random.Random(0)
    opt = torch.optim.Adam([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        picked = [rows[rng.randrange(len(rows))] for _ in range(8)]
        prompt_ids, prompt_mask = PromptSet([tok.text_to_ids(r["prompt"][0]["content"]) for r in picked],
                                            ["0"] * 8, pad_id=tok.eos_id).collate(range(8))
        resp = [tok.text_to_ids(f"Answer: {r['reward_model']['ground_truth']}") + [tok.eos_id] for r in picked]
        width = max(len(r) for r in resp)
        ids = torch.tensor([r + [tok.eos_id] * (width - len(r)) for r in resp])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in resp])
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=mask,
                             group_ids=torch.arange(8), truncated=torch.zeros(8, dtype=torch.bool),
                             old_logp=torch.zeros_like(mask), advantages=torch.zeros(8))
        opt.zero_grad()
        actor.prepare_for_training_step()
        actor.get_loss_and_metrics(pack_rollout(batch, tok.eos_id), forward_only=False, loss_fn=SFTLoss())
        actor.finish_training_step()
        opt.step()


def write_hf(out: Path, tok_dir: str) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(hf).save_pretrained(out / "hf")
    tok.save_pretrained(out / "hf")
    return str(out / "hf")


def converted(saved: Path, out: Path, hf_model: str, tok_dir: str) -> Path:
    """The checkpoint as a user brings it: the warmed-up policy exported to Hugging Face and converted back with
    ``nemo-dapo convert``'s functions (its ``model_config.yaml`` then holds only the converter's keys, not NeMo's)."""
    from nemo_dapo.megatron.convert_ckpt import hf_to_nemo, nemo_to_hf

    warm_hf = out / "hf_warm"
    nemo_to_hf(str(saved), str(warm_hf), hf_config_dir=hf_model, dtype="fp32")
    return Path(hf_to_nemo(str(warm_hf), str(out / "checkpoint"), dtype="fp32", tokenizer_dir=tok_dir))


def main(out: Path) -> None:
    from nemo_dapo.data.task import ArithmeticTask
    from nemo_dapo.data.tokenizer import build_task_tokenizer, save_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(**TASK)
    tok_dir = save_tokenizer(build_task_tokenizer(task, n_rows=500, vocab_size=384), out / "tokenizer")
    files = write_data(out, task)
    _, actor = nemo_cpu.build_actor(1, 1, mbs=2, gbs=8, tokenizer_dir=tok_dir, seq_len=SEQ_LEN, hidden=HIDDEN,
                                    num_layers=LAYERS)
    warm_up(actor, [json.loads(line) for line in Path(files["train"]).read_text().splitlines()], steps=40)
    packed = out / "policy.nemo"
    actor.save_to(str(packed))
    saved = out / "nemo_saved"
    with tarfile.open(packed) as tar:
        tar.extractall(saved)
    packed.unlink()
    hf_model = write_hf(out, tok_dir)
    ckpt = converted(saved, out, hf_model, tok_dir)
    info = {"tokenizer": tok_dir, "checkpoint": str(ckpt), "hf_model": hf_model, **files, "task": TASK,
            "seq_len": SEQ_LEN}
    (out / "inputs.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
