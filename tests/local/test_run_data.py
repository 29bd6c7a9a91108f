"""nemo_dapo.local.run_data.encode: the batched tokenization equals the obvious row-by-row one."""
from nemo_dapo.data.readers import from_verl_rows
from nemo_dapo.data.task import ArithmeticTask
from nemo_dapo.data.tokenizer import build_task_tokenizer
from nemo_dapo.local import run_data


def encode_row_by_row(tokenizer, rows, max_prompt_tokens):
    """The reference: one tokenizer call per prompt, [BOS] first, prompts over the limit left out."""
    ids, truths = [], []
    for row in rows:
        seq = [tokenizer.bos_token_id] + tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
        if len(seq) <= max_prompt_tokens:
            ids.append(seq)
            truths.append(row.ground_truth)
    return ids, truths


def test_batched_encode_equals_row_by_row_across_chunks(monkeypatch):
    task = ArithmeticTask(max_terms=6)
    tok = build_task_tokenizer(task, n_rows=300)
    rows = from_verl_rows(task.rows("train", 50, seed=3), "train")
    lengths = sorted(len(tok(r.prompt, add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    limit = lengths[len(lengths) // 2]  # about half the prompts are over it
    monkeypatch.setattr(run_data, "ENCODE_CHUNK", 7)  # 50 rows: 8 chunks, the last one short
    got = run_data.encode(tok, rows, max_prompt_tokens=limit, what="train set")
    ids, truths = encode_row_by_row(tok, rows, limit)
    assert 0 < len(ids) < len(rows)
    assert len(got) == len(ids) and got.ground_truths == truths
    assert got.prompt_ids == ids
