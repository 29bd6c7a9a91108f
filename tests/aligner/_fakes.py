"""Small stand-ins shared by the in-process tests (no model, no NeMo state)."""
from dataclasses import dataclass


class CharTokenizer:
    """NeMo tokenizer interface on characters: id = code point (< 256), plus BOS 1 and EOS 2 (decoded as nothing)."""

    bos_id, eos_id, pad_id = 1, 2, 0
    vocab_size = 256

    def text_to_ids(self, text):
        return [ord(c) for c in text]

    def ids_to_text(self, ids):
        return "".join(chr(i) for i in ids if i > 2)


@dataclass
class Row:
    prompt: str
    ground_truth: str
    id: str = ""
