"""The DAPO prompt template (data/template.py): applied and read back."""
from nemo_dapo.data.template import TEMPLATE_PREFIX, TEMPLATE_SUFFIX, apply_template, extract_problem


def test_extract_problem_inverts_the_template_of_an_empty_problem():
    assert extract_problem(apply_template("7+5")) == "7+5"
    assert extract_problem(apply_template("")) == ""
    assert extract_problem(TEMPLATE_PREFIX + TEMPLATE_SUFFIX[1:]) is None  # one character short: not a template
