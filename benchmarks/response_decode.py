"""CPU time to turn generated token ids into the texts the verifier reads, per way of decoding.

    python benchmarks/response_decode.py            # 256 x 512 and 8 x 20,480 tokens, 5 repeats
    python benchmarks/response_decode.py --quick    # 64 x 128 and 2 x 2,048 tokens, 2 repeats
    python benchmarks/response_decode.py --tokenizer DIR    # a Hugging Face tokenizer directory (e.g. Qwen2.5's)
    python benchmarks/response_decode.py --no-nemo  # the Hugging Face rows only (no 10 s NeMo import)
    python benchmarks/response_decode.py --extra-special 19  # 22 special tokens, as many as Qwen2.5's tokenizer

Responses are random token ids (special tokens included) of a fixed length; the default tokenizer is the CPU job's
kind (byte-level BPE, 512 tokens, 3 special tokens), trained here in a second. Rows, each timed over the whole set
(median of the repeats, the variants interleaved within a repeat, one thread):
  hf list       ``tokenizer.decode(ids.tolist(), skip_special_tokens=True)``: the CPU path before this release
  hf tensor     ``tokenizer.decode(ids, skip_special_tokens=True)``: the CPU path now (``core.reward.RuleReward``
                hands ``decode`` the row as a tensor)
  nemo          NeMo's ``AutoTokenizer.ids_to_text(ids.tolist())`` over the same tokenizer: the NeMo-Aligner path
                before this release (skipped, with a note, without NeMo)
  nemo fast     ``aligner.reward_client.response_decoder``: the NeMo-Aligner path now
Every variant's texts are checked equal to its baseline's. Ratios are against the baseline of the same path (hf
list, nemo) measured in the same run. NeMo's cost grows with the number of special tokens (it rebuilds their
list for every token), so a tokenizer with more of them (Qwen2.5 has 22) widens that gap.
Ends with one line ``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def tokenizers(directory: str | None, nemo: bool = True, extra_special: int = 0):
    """(Hugging Face tokenizer, NeMo AutoTokenizer over it or None, its directory's TemporaryDirectory or None).
    ``extra_special`` more special tokens are added to a trained tokenizer (NeMo's cost grows with their number)."""
    from nemo_dapo.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    tmp = None
    if directory is None:
        tmp = tempfile.TemporaryDirectory()
        texts = [f"Question: what is {a} + {b}? Answer: {a + b}\n" for a in range(100) for b in range(0, 100, 3)]
        tok = train_tokenizer(texts, vocab_size=512)
        tok.add_special_tokens({"additional_special_tokens": [f"<|extra_{i}|>" for i in range(extra_special)]})
        directory = save_tokenizer(tok, tmp.name)
    hf = load_tokenizer(directory)
    if not nemo:
        return hf, None, tmp
    try:
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    except ImportError as e:
        print(f"NeMo is not importable ({e}): the nemo rows are skipped")
        return hf, None, tmp
    return hf, AutoTokenizer(directory), tmp


def variants(hf, nemo) -> dict:
    """{name: (baseline name, decode(row [L] int64) -> str)}."""
    out = {"hf list": ("hf list", lambda r: hf.decode(r.tolist(), skip_special_tokens=True)),
           "hf tensor": ("hf list", lambda r: hf.decode(r, skip_special_tokens=True))}
    if nemo is not None:
        from nemo_dapo.aligner.reward_client import response_decoder

        out["nemo"] = ("nemo", lambda r: nemo.ids_to_text(r.tolist()))
        out["nemo fast"] = ("nemo", response_decoder(nemo))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-nemo", action="store_true", help="skip the NeMo rows")
    p.add_argument("--extra-special", type=int, default=0, help="special tokens added to the trained tokenizer")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = [(64, 128), (2, 2048)] if args.quick else [(256, 512), (8, 20480)]
    repeats = args.repeats or (2 if args.quick else 5)
    hf, nemo, _tmp = tokenizers(args.tokenizer, nemo=not args.no_nemo, extra_special=args.extra_special)
    decoders = variants(hf, nemo)
    result = {}
    print(f"{'responses':>9} {'tokens':>7} {'variant':10} {'cpu_s':>8} {'us/token':>9} {'vs baseline':>11}")
    for n, length in shapes:
        rows = torch.randint(0, len(hf), (n, length), generator=torch.Generator().manual_seed(0))
        times = {name: [] for name in decoders}
        texts = {}
        for _ in range(repeats):
            for name, (_, decode) in decoders.items():
                t0 = time.process_time()
                texts[name] = [decode(r) for r in rows]
                times[name].append(time.process_time() - t0)
        for name, (base, _) in decoders.items():
            if texts[name] != texts[base]:
                raise SystemExit(f"{name} decodes differently from {base} at {n} x {length}")
            med, ratio = statistics.median(times[name]), statistics.median(times[name]) / statistics.median(
                times[base])
            print(f"{n:>9} {length:>7} {name:10} {med:8.4f} {1e6 * med / (n * length):9.2f} {ratio:11.3f}")
            result[f"{name.replace(' ', '_')}_vs_base_L{length}"] = round(ratio, 4)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + f" nemo={'yes' if nemo else 'no'} "
          f"special_tokens={len(hf.all_special_tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
