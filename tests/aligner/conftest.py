"""Fixtures for the NeMo-Aligner plugin tests: skip without the NeMo stack, share one tiny tokenizer per session."""
import importlib.util

import pytest

HAVE_NEMO = all(importlib.util.find_spec(m) is not None for m in ("nemo", "nemo_aligner", "megatron.core"))
needs_nemo = pytest.mark.skipif(not HAVE_NEMO, reason="needs the NeMo stack (bash scripts/install.sh .venv full)")


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer in HF format (NeMo loads it with library=huggingface)."""
    from nemo_dapo.data.tokenizer import save_tokenizer, train_tokenizer

    directory = tmp_path_factory.mktemp("tok")
    texts = [f"Question: what is {a} + {b}? Answer: {a + b}\n" for a in range(30) for b in range(0, 30, 7)]
    return save_tokenizer(train_tokenizer(texts, vocab_size=300), directory)
