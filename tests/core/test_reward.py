"""Rule-based verifier: reference probes in both modes, strictness, a regex reference, property tests, batching."""
import re
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dapo.core import answer_normalize as an
from nemo_dapo.core import reward
from nemo_dapo.core.reward import RuleReward, Verdict, verify, verify_batch
from nemo_dapo.core.types import RewardFn

# Probes the reference verifier was run on (ANCHORS.md 1.5); ground truth 540 unless given.
REFERENCE_CORRECT = [
    ("Answer: 540", "540"), ("answer: 540", "540"), ("ANSWER: 540", "540"), ("Answer:540", "540"),
    ("Answer: $540$", "540"), ("Answer: \\boxed{540}", "540"), ("Answer: $\\boxed{540}$.", "540"),
    ("Answer: x = 540", "540"), ("Answer: 1,000", "1000"), ("Answer: 540 degrees", "540"),
    ("Answer: 540 students", "540"), ("Answer: -3", "-3"), ("Answer: 7\nSo...\nAnswer: 540", "540"),
]
REFERENCE_FALSE_NEGATIVES = [
    "Answer: 540.", "Answer: 540.0", "Answer: **540**", "Answer: \\(540\\)", "Answer: 0540",
    "The answer is \\boxed{540}", "Final Answer: The final answer is 540. I hope it is correct.",
]
# Wrong values that no mode may accept for 540.
WRONG = ["Answer: 541", "Answer: 5400", "Answer: 54", "Answer: 540.5", "Answer: -540", "Answer: 540/2",
         "Answer: 540 or 541", "Answer: \\frac{540}{2}", "Answer: 540^2", "Answer: 2*270", "Answer: 539.9999999",
         "Answer: 540.01", "\\boxed{541}", "Answer: [INVALID]", "Answer:  ", "no answer at all", ""]
# A 540 in the reasoning followed by a different final answer, or only outside the final answer.
BURIED = [
    "We first try 540.\nThat fails.\nAnswer: 541",
    "Maybe \\boxed{540}? Let me re-check.\nAnswer: 541",
    "The sum is 540, and the product is 541.",
    "Answer: 540\n" + "Then I kept writing without a final answer. " * 10,
    "\\boxed{540}\n" + "More reasoning, no box and no answer line here. " * 10,
    "So \\boxed{540} but actually the final value is \\boxed{541}",
    "Answer: 541\n\\boxed{540",  # truncated box: the earlier line stands
]
RULE_MODES = ["dapo", "tolerant"]


@pytest.mark.parametrize("mode", RULE_MODES)
@pytest.mark.parametrize("response, gt", REFERENCE_CORRECT)
def test_reference_correct_probes(response, gt, mode):
    v = verify(response, gt, mode=mode)
    assert v == Verdict(1.0, True, v.pred) and v.pred == gt


@pytest.mark.parametrize("response", REFERENCE_FALSE_NEGATIVES)
def test_reference_false_negatives_kept_in_dapo_mode(response):
    assert verify(response, "540") == Verdict(-1.0, False, verify(response, "540").pred)


@pytest.mark.parametrize("response", REFERENCE_FALSE_NEGATIVES + ["**Answer:** 540", "Answer: 540.00.",
                                                                  "Answer: \\[540\\]", "Answer: +540"])
def test_tolerant_fixes_reference_false_negatives(response):
    assert verify(response, "540", mode="tolerant") == Verdict(1.0, True, "540")


@pytest.mark.parametrize("mode", RULE_MODES)
@pytest.mark.parametrize("response", WRONG + BURIED)
def test_wrong_and_buried_answers_rejected(response, mode):
    v = verify(response, "540", mode=mode)
    assert (v.score, v.acc) == (-1.0, False)


def test_dapo_predictions_are_the_reference_normalised_strings():
    assert verify("Answer: 540.", "540").pred == "540."
    assert verify("Answer: **540**", "540").pred == "**540**"
    assert verify("The answer is \\boxed{540}", "540").pred == an.INVALID
    assert verify("Answer: $\\frac12$", "1/2").pred == "\\frac{1}{2}"


def test_tolerant_final_box_after_answer_line_wins():
    assert verify("Answer: 541\nWait, I made an error.\n\\boxed{540}", "540", mode="tolerant").acc
    assert not verify("Answer: 541\nWait, I made an error.\n\\boxed{540}", "540", mode="dapo").acc


def test_tolerant_equal_values_in_other_forms():
    assert verify("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", mode="tolerant").acc
    assert verify("Answer: 0.5", "\\frac12", mode="tolerant").acc
    assert verify("Answer: 1\\,000", "1000", mode="tolerant").acc
    assert verify("Answer: -\\frac{3}{4}", "-3/4", mode="tolerant").acc
    assert not verify("Answer: \\frac{3}{4}", "-3/4", mode="tolerant").acc
    assert not verify("Answer: \\frac{1}{0}", "0", mode="tolerant").acc


@pytest.mark.parametrize("response, gt", [("Answer: 5!", "5"), ("Answer: 10!", "10"),
                                          ("Answer: \\leftarrow", "\\rightarrow"),
                                          ("Answer: \\leftrightarrow", "\\rightarrow")])
def test_tolerant_never_takes_a_different_value(response, gt):
    """What reads as formatting only as a whole command or as sentence punctuation: 5! is a factorial, and
    \\leftarrow is not \\rightarrow with its "left" dropped."""
    assert not verify(response, gt, mode="tolerant").acc
    assert verify("Answer: \\left(1, 2\\right)", "(1, 2)", mode="tolerant").acc  # the delimiters still go


def test_unit_words_from_the_reference_table():
    for response in ["Answer: 5 cm", "Answer: 5 \\text{ inches}", "Answer: 5^\\circ", "Answer: 5 units",
                     "Answer: 5 mph", "Answer: \\$5", "Answer: 5\\text{ dollars}"]:
        assert verify(response, "5").acc, response


def test_ground_truth_normalisation():
    assert verify("Answer: 540", "$540$").acc and verify("Answer: 540", "\\boxed{540}").acc
    assert verify("Answer: 1000", "1,000").acc
    # Leading zeros in stored ground truths are a data problem: the reference rejects; loaders must use str(int(x)).
    assert not verify("Answer: 25", "025").acc
    assert verify("Answer: 25", "025", mode="tolerant").acc


def test_only_the_last_300_characters_count():
    tail = "\n" + "x" * (an.ANSWER_TAIL_CHARS - len("Answer: 540") - 1)
    assert verify("Answer: 540" + tail, "540").acc
    assert not verify("Answer: 540" + tail + "x", "540").acc


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="mode"):
        verify("Answer: 1", "1", mode="strict")
    with pytest.raises(TypeError, match="str"):
        verify("Answer: 1", 1)
    with pytest.raises(ValueError, match="one ground truth per response"):
        verify_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="num_workers"):
        verify_batch(["a"], ["1"], num_workers=0)


# ---------------------------------------------------------------------------------------------------------------
# The reference stated as regex substitutions ('.' stops at newlines); the module uses linear scans instead.
# ---------------------------------------------------------------------------------------------------------------

def regex_minerva_normalize(answer):
    s = answer.split("=")[-1]
    for before, after in an.MINERVA_SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in an.MINERVA_REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"[^\n$]*\$([^\n$]*)\$[^\n]*", lambda m: "$" + m.group(1) + "$", s)
    for opener in ("text", "textbf", "overline"):
        s = re.sub(r"\\" + opener + r"\{([^\n}]*)\}", lambda m: m.group(1), s)
    s = re.sub(r"\\boxed\{(.*)\}", lambda m: m.group(1), s)
    s = re.sub(r"frac([^{])(.)", lambda m: "frac{" + m.group(1) + "}{" + m.group(2) + "}", s)
    s = re.sub(r"sqrt([^{])", lambda m: "sqrt{" + m.group(1) + "}", s)
    s = s.replace("$", "")
    return (s.replace(",", "") if s.replace(",", "").isdigit() else s).strip()


def regex_dapo(response, gt):
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    pred = regex_minerva_normalize(found[-1] if found else "[INVALID]")
    return pred == regex_minerva_normalize(gt), pred


ATOMS = ["$", "{", "}", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "frac", "sqrt", "\n", ",", "=", " ",
         "a ", "an ", ".", "\\", "Answer:", "answer :", "degrees", "\\text{m}", "1", "2", "0", "x", "\u00b2", "\t",
         "{,}", ",\\!", "**", "\\(", "\\)", "I hope it is correct.", "The final answer is "]
fragments = st.lists(st.sampled_from(ATOMS), max_size=16).map("".join)
PROP = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(fragments)
def test_minerva_normalize_matches_regex_formulation(s):
    assert an.minerva_normalize(s) == regex_minerva_normalize(s)


@PROP
@given(fragments, st.sampled_from(["12", "1", "2,0", "$1$", "\\frac12", "x=1", ""]))
def test_dapo_mode_matches_regex_formulation(response, gt):
    ok, pred = regex_dapo(response, gt)
    assert verify(response, gt) == Verdict(1.0 if ok else -1.0, ok, pred)


@PROP
@given(fragments, st.sampled_from(["12", "1", "0", "-2", "10"]))
def test_tolerant_accepts_everything_dapo_accepts(response, gt):
    if verify(response, gt).acc:
        assert verify(response, gt, mode="tolerant").acc


@PROP
@given(st.one_of(st.text(), fragments), st.one_of(st.text(max_size=20), fragments), st.sampled_from(RULE_MODES))
def test_never_crashes_on_arbitrary_text(response, gt, mode):
    v = verify(response, gt, mode=mode)
    assert isinstance(v.pred, str) and v.score == (1.0 if v.acc else -1.0)


ADVERSARIAL = {
    "1MB letters": "a" * 1_000_000,
    "1MB answer words": "Answer:" * 150_000,
    "answer then 1MB spaces": "Answer:" + " " * 1_000_000,
    "1e5 nested braces": "{" * 100_000 + "}" * 100_000,
    "1e5 nested boxes": "\\boxed{" * 100_000 + "}" * 100_000,
    "1e5 unclosed boxes": "\\boxed{" * 100_000,
    "1e5 unclosed text": "\\text{" * 100_000,
    "dollars and newlines": "$\n$ " * 250_000,
    "frac shorthand": "frac" * 250_000,
}


@pytest.mark.parametrize("mode", RULE_MODES)
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_bounded_time_on_adversarial_responses(name, mode):
    text = ADVERSARIAL[name]
    start = time.process_time()  # CPU time: the bound is on work done, not on how busy the machine is
    v = verify(text + "\nAnswer: 540", "540", mode=mode)
    w = verify(text, "540", mode=mode)
    assert time.process_time() - start < 0.5 and v.acc and not w.acc


@pytest.mark.parametrize("name", ["1MB letters", "1e5 nested braces", "1e5 unclosed text", "dollars and newlines"])
def test_bounded_time_on_adversarial_ground_truths(name):
    start = time.process_time()
    for mode in RULE_MODES:
        assert not verify("Answer: 540", ADVERSARIAL[name], mode=mode).acc
    # Ground truths are data, not model output: linear time, looser bound (tolerant normalises them twice).
    assert time.process_time() - start < 1.0


# ---------------------------------------------------------------------------------------------------------------
# Batching, RewardFn, math-verify backend
# ---------------------------------------------------------------------------------------------------------------

BATCH_RESPONSES = [r for r, _ in REFERENCE_CORRECT] + REFERENCE_FALSE_NEGATIVES + WRONG + BURIED
BATCH_GTS = [g for _, g in REFERENCE_CORRECT] + ["540"] * (len(BATCH_RESPONSES) - len(REFERENCE_CORRECT))


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    reward.shutdown_pools()


@pytest.mark.parametrize("mode", RULE_MODES)
def test_verify_batch_in_process_equals_verify(mode):
    expected = [verify(r, g, mode=mode) for r, g in zip(BATCH_RESPONSES, BATCH_GTS)]
    assert verify_batch(BATCH_RESPONSES, BATCH_GTS, mode=mode) == expected
    assert verify_batch(BATCH_RESPONSES[::-1], BATCH_GTS[::-1], mode=mode) == expected[::-1]


def test_verify_batch_pool_equals_verify_and_keeps_order():
    responses, gts = BATCH_RESPONSES * 3, BATCH_GTS * 3
    for mode in RULE_MODES:
        expected = [verify(r, g, mode=mode) for r, g in zip(responses, gts)]
        assert verify_batch(responses, gts, mode=mode, num_workers=2, in_process_below=0) == expected


def _char_decode(ids):
    assert isinstance(ids, torch.Tensor) and ids.dim() == 1  # one response's kept ids, in one object
    return "".join(chr(i) for i in ids.tolist())


def test_rule_reward_decodes_only_masked_tokens():
    texts = ["Answer: 540</s>", "Answer: 54", "Answer: 7"]
    width = max(map(len, texts)) + 2
    ids = torch.full((3, width), ord("0"))  # padding decodes to digits: it would change answers if it leaked in
    mask = torch.zeros(3, width)
    for b, t in enumerate(texts):
        ids[b, :len(t)] = torch.tensor([ord(c) for c in t])
        mask[b, :len(t)] = 1
    fn = RuleReward(_char_decode, eos_text="</s>")
    assert isinstance(fn, RewardFn)
    score, acc, preds = fn(ids, mask, ["540", "540", "7"])
    assert score.tolist() == [1.0, -1.0, 1.0] and acc.tolist() == [1.0, 0.0, 1.0] and preds == ["540", "54", "7"]
    assert score.dtype == acc.dtype == torch.float32
    with pytest.raises(ValueError, match="ground_truths"):
        fn(ids, mask, ["540"])


def test_math_verify_missing_package_is_a_clear_error(monkeypatch):
    real = reward.importlib.util.find_spec
    monkeypatch.setattr(reward.importlib.util, "find_spec", lambda n, *a: None if n == "math_verify" else real(n))
    with pytest.raises(ModuleNotFoundError, match="pip install math-verify"):
        verify("Answer: 1", "1", mode="math_verify")


MV_RESPONSES = ["The answer is $\\boxed{\\frac{1}{2}}$", "Answer: 0.5", "\\boxed{3}", "nothing here"]
MV_GTS = ["0.5", "\\frac12", "4", "1"]


def test_math_verify_mode_in_main_thread():
    pytest.importorskip("math_verify")
    assert [verify(r, g, mode="math_verify").acc for r, g in zip(MV_RESPONSES, MV_GTS)] == [True, True, False, False]


@pytest.mark.slow
def test_math_verify_mode_in_worker_processes():
    pytest.importorskip("math_verify")
    direct = [verify(r, g, mode="math_verify") for r, g in zip(MV_RESPONSES, MV_GTS)]
    assert verify_batch(MV_RESPONSES, MV_GTS, mode="math_verify", num_workers=2, in_process_below=0) == direct
    box = {}

    def off_main_thread():
        box["v"] = verify(MV_RESPONSES[0], MV_GTS[0], mode="math_verify")

    worker = threading.Thread(target=off_main_thread)
    worker.start()
    worker.join(timeout=120)
    assert box["v"] == direct[0]  # off the main thread it ran in a worker process instead of failing on signals


def test_only_a_trailing_eos_text_is_stripped():
    ids = torch.tensor([[1, 2]])
    reward = RuleReward(lambda t: "Answer: 1</s>2</s>", eos_text="</s>")
    assert reward.decode_responses(ids, torch.ones_like(ids)) == ["Answer: 1</s>2"]


def test_a_box_inside_the_answer_line_is_not_the_candidate():
    # The candidate is the answer line's text, or a \boxed{} that starts AFTER that line ends.
    assert an.match_tolerant("Answer: 3, so \\boxed{5}", "5")[0] is False
    assert an.match_tolerant("Answer: 3\n\\boxed{5}", "5")[0] is True


def test_the_reference_fallback_applies_to_the_answer_line_only():
    # canonical forms differ ("5" vs "theansweris5"), the Minerva forms agree: accepted only on an answer line.
    assert an.match_tolerant("Answer: the answer is 5", "theansweris5")[0] is True
    assert an.match_tolerant("\\boxed{the answer is 5}", "theansweris5")[0] is False


def test_a_ground_truth_of_exactly_the_bound_is_normalised():
    gt = "x" * (an.MAX_GROUND_TRUTH_CHARS - 2) + "=5"  # Minerva keeps the text after the last '=': "5"
    assert len(gt) == an.MAX_GROUND_TRUTH_CHARS
    assert verify("Answer: 5", gt).acc
    assert not verify("Answer: 5", "x" + gt).acc  # one longer: never normalised, never matched
