"""benchmarks/update_attribution.py: its split of an AdamW step against torch's own AdamW, and its count of responses
that restate a problem's first operator as another one."""
import pytest
import torch

from tests.support.benchmark_module import load_benchmark


def adam_steps(grads: list, lr: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8, wd: float = 0.0) -> list:
    """torch.optim.AdamW on two parameters, one step per gradient; the recorder's view after each step."""
    torch.manual_seed(0)
    params = {"a": torch.nn.Parameter(torch.randn(3, 2)), "b": torch.nn.Parameter(torch.randn(4))}
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    out = [{"weights": {n: p.detach().clone() for n, p in params.items()}}]
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
        out.append({"weights": {n: p.detach().clone() for n, p in params.items()}, "lr": lr, "betas": betas,
                    "eps": eps, "weight_decay": wd,
                    "adam": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}})
    return out


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_first_order_parts_match_torch_adamw(wd):
    first_order_parts = load_benchmark("update_attribution").first_order_parts
    torch.manual_seed(1)
    grads = [{"a": torch.randn(3, 2), "b": torch.randn(4)} for _ in range(3)]
    probe = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    lr, (b1, b2), eps = 0.01, (0.9, 0.999), 1e-8
    states = adam_steps(grads, lr, (b1, b2), eps, wd)
    before, after = states[2], states[3]  # the third step: momentum from the first two
    total, momentum, own, decay = first_order_parts(probe, before["weights"], after, before["adam"])
    # AdamW by hand: theta (1 - lr wd), m_3 = b1 m_2 + (1 - b1) g_3, step -lr (m_3 / bc1) / (sqrt(v_3 / bc2) + eps)
    bc1, bc2 = 1 - b1 ** 3, 1 - b2 ** 3
    want_m = want_o = want_d = want_t = 0.0
    for n in probe:
        denom = (after["adam"][n]["exp_avg_sq"] / bc2).sqrt() + eps
        want_m += float((probe[n] * -lr * b1 * before["adam"][n]["exp_avg"] / bc1 / denom).sum())
        want_o += float((probe[n] * -lr * (1 - b1) * grads[2][n] / bc1 / denom).sum())
        want_d += float((probe[n] * -lr * wd * before["weights"][n]).sum())
        want_t += float((probe[n] * (after["weights"][n] - before["weights"][n])).sum())
    assert total == pytest.approx(want_t, rel=1e-5)
    assert momentum == pytest.approx(want_m, rel=1e-4) and own == pytest.approx(want_o, rel=1e-4)
    assert decay == pytest.approx(want_d, rel=1e-4, abs=1e-12)
    assert momentum + own + decay == pytest.approx(total, rel=1e-4)  # the parts are the whole step
    # the first step has no momentum yet: all of it is the step's own gradient (and the decay)
    total, momentum, own, decay = first_order_parts(probe, states[0]["weights"], states[1], None)
    assert momentum == 0.0 and own + decay == pytest.approx(total, rel=1e-4)
    # a skipped step moved nothing
    assert first_order_parts(probe, before["weights"], {**after, "skipped": True}, before["adam"]) == (0, 0, 0, 0)


def test_swapped_rows_counts_first_operator_restated_as_another():
    from nemo_dapo.data.task import ArithmeticTask
    from nemo_dapo.data.template import apply_template
    from nemo_dapo.data.tokenizer import build_task_tokenizer, encode_prompts, token_ids

    swapped_rows = load_benchmark("update_attribution").swapped_rows
    tok = build_task_tokenizer(ArithmeticTask(), n_rows=200)
    cases = [("9-8+7", "9+8=17\n17-7=10\nAnswer: 10"),  # swapped
             ("9-8+7", "9-8=1\n1+7=8\nAnswer: 8"),  # kept
             ("6-2", "6-2=4\nAnswer: 4"),  # kept
             ("3+4", "3-4=-1\nAnswer: -1"),  # another first operator: not counted for "-"
             ("7-1", "")]  # empty response: not counted
    prompt_ids, prompt_mask = encode_prompts(tok, [apply_template(p) for p, _ in cases])
    responses = token_ids(tok, [r for _, r in cases])
    width = max(len(r) for r in responses)
    response_ids = torch.zeros(len(cases), width, dtype=torch.long)
    response_mask = torch.zeros(len(cases), width)
    for i, r in enumerate(responses):
        response_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, :len(r)] = 1
    rows = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                response_mask=response_mask)
    assert swapped_rows(rows, tok, "-") == (3, 1)
    assert swapped_rows(rows, tok, "+") == (1, 1)


def test_largest_stale_mismatch_and_reevaluated_read_a_run_folder(tmp_path):
    import json
    import math

    ua = load_benchmark("update_attribution")
    rows = [{"kind": "eval", "step": 0}, {"kind": "train", "partial/logp_mismatch_stale": 0.02},
            {"kind": "train", "partial/logp_mismatch_stale": float("nan")},
            {"kind": "train", "partial/logp_mismatch_stale": 7.5}, {"kind": "train"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ua.largest_stale_mismatch(str(tmp_path)) == 7.5
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train"}) + "\n")  # no stale tokens ever
    assert math.isnan(ua.largest_stale_mismatch(str(tmp_path)))
    assert math.isnan(ua.reevaluated(str(tmp_path)))
    final = str(tmp_path / "final_model")
    (tmp_path / "reeval_512_2.json").write_text(json.dumps({"model": final, "avg@2": 0.5}))
    (tmp_path / "reeval_1024_4.json").write_text(json.dumps({"model": final, "avg@4": 0.4375, "pass@4": 0.7}))
    assert ua.reevaluated(str(tmp_path)) == 0.4375  # the largest, not the last name in string order
    (tmp_path / "reeval_1024_4.json").write_text(json.dumps({"model": "/elsewhere/final_model", "avg@4": 0.4375}))
    assert ua.reevaluated(str(tmp_path)) == 0.5  # a cache of another model is not this run's
