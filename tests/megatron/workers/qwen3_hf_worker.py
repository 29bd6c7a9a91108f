"""The transformers-5 side of the Qwen3 conversion tests, run INSIDE the vLLM venv (transformers 5.x has Qwen3;
the test venv's 4.47 does not):

    .venv-vllm/bin/python tests/megatron/workers/qwen3_hf_worker.py make OUT
        for each family of qwen3_models: a randomised HF model (weights ~N(0, 1/fan_in), norms 1 + N(0, 0.2^2), so
        a wrong layout or a skipped QK-norm shows) saved with save_pretrained to OUT/<family>/hf, its logits on
        qwen3_models.tokens() to OUT/<family>/hf_logits.pt
    .venv-vllm/bin/python tests/megatron/workers/qwen3_hf_worker.py check OUT
        for each OUT/<family>/<case>/hf (a checkpoint written by the megatron side) with OUT/<family>/<case>/
        megatron_logits.pt: loads it with from_pretrained and prints max |HF logits - megatron logits|

Prints one JSON line last.
"""
import glob
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from qwen3_models import CONFIGS, tokens  # noqa: E402

torch.set_num_threads(1)


@torch.no_grad()
def randomize_(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)
    return model


@torch.no_grad()
def logits(model):
    return model(tokens()).logits.float()


def make(out):
    report = {}
    for family, raw in CONFIGS.items():
        cfg = AutoConfig.for_model(**raw)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        model = randomize_(model, seed=11).eval()
        hf_dir = os.path.join(out, family, "hf")
        model.save_pretrained(hf_dir)
        want = logits(model)
        torch.save(want, os.path.join(out, family, "hf_logits.pt"))
        # the saved checkpoint is what the converters read: loading it back must give the same model
        back = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
        report[family] = {"reload_max_diff": (logits(back) - want).abs().max().item(),
                          "logit_scale": want.abs().max().item()}
    return report


def check(out):
    report = {}
    for path in sorted(glob.glob(os.path.join(out, "*", "*", "megatron_logits.pt"))):
        case_dir = os.path.dirname(path)
        model = AutoModelForCausalLM.from_pretrained(os.path.join(case_dir, "hf"), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
        want = torch.load(path)
        got = logits(model)
        report[os.path.relpath(case_dir, out)] = {"max_diff": (got[..., :want.shape[-1]] - want).abs().max().item(),
                                                   "logit_scale": want.abs().max().item()}
    return report


def main():
    mode, out = sys.argv[1], sys.argv[2]
    report = {"transformers": transformers.__version__, mode: make(out) if mode == "make" else check(out)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
