"""The DAPO prompt template.

Every DAPO-Math-17k and AIME-2024 row wraps its problem in this single user turn; the verifier then reads the last
``Answer:`` line of the response. The wording is a data fact (it must match the public files byte for byte), so it is
kept verbatim in one constant.
"""
from __future__ import annotations

from typing import Optional

TEMPLATE_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
TEMPLATE_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_TEMPLATE = TEMPLATE_PREFIX + "{problem}" + TEMPLATE_SUFFIX


def apply_template(problem: str) -> str:
    """The user-turn text for ``problem`` (no chat markup; a chat template, if any, is the tokenizer's business)."""
    return TEMPLATE_PREFIX + problem + TEMPLATE_SUFFIX


def extract_problem(content: str) -> Optional[str]:
    """Inverse of :func:`apply_template`: the problem inside a templated prompt, or None if ``content`` is not one."""
    if content.startswith(TEMPLATE_PREFIX) and content.endswith(TEMPLATE_SUFFIX):
        if len(content) >= len(TEMPLATE_PREFIX) + len(TEMPLATE_SUFFIX):
            return content[len(TEMPLATE_PREFIX):len(content) - len(TEMPLATE_SUFFIX)]
    return None


def format_answer_line(answer) -> str:
    """The final line the verifier looks for, e.g. ``Answer: 14``."""
    return f"Answer: {answer}"
