"""``nemo-dapo convert``: Hugging Face checkpoint <-> the NeMo checkpoint the launcher restores, shard by shard.

    torchrun --nproc-per-node N -m nemo_dapo.cli convert hf-to-nemo --hf HF_DIR --out NEMO_DIR [--tp T --pp P --ep E]
    torchrun --nproc-per-node N -m nemo_dapo.cli convert nemo-to-hf --nemo NEMO_DIR --out HF_DIR [--tp T --pp P --ep E]

N = T x P x E processes (one node or several; gloo; the weights stay in host memory, but megatron-core 0.10's checkpoint
writer synchronises CUDA, so torch must see a GPU: run it in the NeMo container on GPU nodes). Each process reads and writes only its own
layers / experts (``convert_ckpt``). Importing this module loads neither torch nor megatron (the CLI lists it).
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_BAD_INPUT = 2  # the CLI's code for bad input (nemo_dapo/cli.py)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("direction", choices=("hf-to-nemo", "nemo-to-hf"))
    p.add_argument("--hf", help="hf-to-nemo: the Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--nemo", help="nemo-to-hf: a NeMo checkpoint directory (model_config.yaml + model_weights/; "
                                  "untar a .nemo first) or a training checkpoint's distributed-checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (must not exist; written as OUT.partial, renamed "
                                                "when complete)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages of the conversion: layers split over them")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size: experts split over them (MoE)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="weights dtype (hf-to-nemo default bf16; nemo-to-hf default: the checkpoint's precision)")
    p.add_argument("--hf-config", help="nemo-to-hf: HF directory whose config.json describes the model (default: "
                                       "the hf_config.json that hf-to-nemo kept in the checkpoint)")
    p.add_argument("--tokenizer", help="hf-to-nemo: tokenizer directory written into model_config.yaml "
                                       "(default: --hf)")
    p.add_argument("--padded-vocab", type=int, default=None,
                   help="embedding rows after padding (default: the HF vocabulary to a multiple of 128)")


def _run(args) -> int:
    if args.direction == "hf-to-nemo" and not args.hf:
        raise FileNotFoundError("nemo-dapo convert hf-to-nemo needs --hf HF_DIR")
    if args.direction == "nemo-to-hf" and not args.nemo:
        raise FileNotFoundError("nemo-dapo convert nemo-to-hf needs --nemo NEMO_DIR")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a plain (non-torchrun) call is one process
        os.environ.setdefault(name, "0" if name != "WORLD_SIZE" else "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() and "tests.support.megatron_cpu_shim" not in sys.modules:
        print(f"nemo-dapo convert {args.direction}: error: megatron-core 0.10's checkpoint writer calls "
              "torch.cuda.synchronize(), so torch must see a GPU (the weights stay on the host); run it in the NeMo "
              "container on GPU nodes", file=sys.stderr)
        return EXIT_BAD_INPUT

    from megatron.core import parallel_state

    from nemo_dapo.megatron import convert_ckpt

    try:
        # conversion is host work: gloo on any machine, and no CUDA RNG tracker (nothing is initialised randomly)
        dist.init_process_group("gloo")
        if dist.get_world_size() % (args.tp * args.pp * args.ep):
            raise ValueError(f"--tp {args.tp} x --pp {args.pp} x --ep {args.ep} needs a multiple of "
                             f"{args.tp * args.pp * args.ep} processes, got {dist.get_world_size()}")
        parallel_state.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
        if args.direction == "hf-to-nemo":
            out = convert_ckpt.hf_to_nemo(args.hf, args.out, dtype=args.dtype or "bf16",
                                          padded_vocab=args.padded_vocab, tokenizer_dir=args.tokenizer)
        else:
            out = convert_ckpt.nemo_to_hf(args.nemo, args.out, hf_config_dir=args.hf_config, dtype=args.dtype,
                                          padded_vocab=args.padded_vocab)
        if dist.get_rank() == 0:
            print(f"nemo-dapo convert {args.direction}: wrote {out}")
    except (ValueError, KeyError, FileExistsError) as e:  # bad input: a config, layout or checkpoint mismatch
        print(f"nemo-dapo convert {args.direction}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


CLI = ("convert", "Hugging Face checkpoint <-> the NeMo checkpoint the launcher restores (run under torchrun, one "
       "process per shard: TP x PP x EP)", _arguments, _run)
