"""One process: what the DAPO actor takes from its config when NeMo 2.1 builds it (tests/support/nemo_cpu.py), the
sequence-length multiple it pads micro-batches to for a few parallel layouts, and the old log-probs of rows that fill
the whole batch width (the last token of such a row), with and without one more padding column. Prints one JSON
line."""
import json

from tests.support import nemo_cpu  # noqa: E402,F401  (patches first)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

# (TP, sequence parallel, CP) layouts whose multiple the test computes by hand
LAYOUTS = [(1, False, 1), (2, True, 1), (4, True, 2), (2, False, 2)]


def main():
    sampling = dict(nemo_cpu.DAPO_DEFAULTS["sampling_params"], temperature=0.6)
    _, actor = nemo_cpu.build_actor(1, 1, dapo={"sampling_params": sampling, "forward_micro_batch_size": 3,
                                                "logprob_chunk_size": 5})
    from nemo_dapo.aligner.actor import _dapo_cfg, seq_len_multiple

    try:
        _dapo_cfg(OmegaConf.create({}))
        missing = None
    except ValueError as e:
        missing = str(e)
    tokens = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))  # no padding: full width
    last = actor.get_logprobs_and_entropy(tokens)[0][:, -1]
    padded = torch.cat([tokens, torch.full((2, 1), actor.tokenizer.eos_id)], dim=1)
    last_padded = actor.get_logprobs_and_entropy(padded)[0][:, -2]  # the same token, one column before the end
    print(json.dumps({
        "last_logp": last.tolist(), "last_logp_padded": last_padded.tolist(),
        "logprob_temperature": actor.logprob_temperature, "forward_micro_batch_size": actor.forward_micro_batch_size,
        "logprob_chunk_size": actor.logprob_chunk_size, "seq_len_multiple": actor.seq_len_multiple,
        "loss_fn": actor.loss_fn, "missing_dapo": missing,
        "multiples": [seq_len_multiple(OmegaConf.create({"tensor_model_parallel_size": tp, "sequence_parallel": sp,
                                                         "context_parallel_size": cp})) for tp, sp, cp in LAYOUTS]}))


if __name__ == "__main__":
    main()
