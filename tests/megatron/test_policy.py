"""MegatronPolicy: packing (fast, one process) and parity with a single-rank reference under TP=2, PP=2 and EP=2
(slow: tests/megatron/workers/policy_worker.py), plus two DAPO loop steps on the megatron policy
(tests/megatron/workers/policy_loop_worker.py)."""
import json
from pathlib import Path

import pytest
import torch

from nemo_dapo.core.types import Policy, RolloutBatch
from nemo_dapo.megatron.policy import MegatronPolicy, blank_rows, pack_left_aligned
from tests.support.dist import run_torchrun

WORKERS = Path(__file__).parent / "workers"
LOGP_TOL = 5e-6  # fp32; the reference runs each row unpadded through full logits
UPDATE_TOL = 2e-6  # relative to the largest reference weight change


def batch(prompt_lens, resp_lens, P=5, R=4, pad=0):
    g = torch.Generator().manual_seed(0)
    plen, rlen = torch.tensor(prompt_lens), torch.tensor(resp_lens)
    b = len(prompt_lens)
    prompt_mask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    resp_mask = (torch.arange(R)[None] < rlen[:, None]).float()
    return RolloutBatch(prompt_ids=torch.randint(1, 50, (b, P), generator=g) * prompt_mask + pad * (1 - prompt_mask),
                        prompt_mask=prompt_mask,
                        response_ids=torch.randint(1, 50, (b, R), generator=g) * resp_mask.long(),
                        response_mask=resp_mask, group_ids=torch.zeros(b).long(), truncated=torch.zeros(b).bool(),
                        pad_id=pad)


def test_pack_left_aligned_matches_row_by_row():
    mb = batch([2, 5, 1], [4, 0, 2])
    S = 9
    out = pack_left_aligned(mb, S)
    for b in range(3):
        prompt = mb.prompt_ids[b][mb.prompt_mask[b].bool()].tolist()
        resp = mb.response_ids[b].tolist()
        row = prompt + resp
        assert out["tokens"][b].tolist() == row + [mb.pad_id] * (S - len(row))
        n = int(mb.response_mask[b].sum())
        for t in range(n):  # the output at pred_pos predicts response token t
            assert out["pred_pos"][b, t] == len(prompt) - 1 + t
            assert out["tokens"][b, out["pred_pos"][b, t] + 1] == resp[t] == out["targets"][b, t]
        assert out["mask"][b].sum() == n


def test_pack_rejects_right_padded_prompts_and_short_seq_len():
    mb = batch([2, 3], [1, 1])
    bad = RolloutBatch(**{**mb.__dict__, "prompt_mask": mb.prompt_mask.flip(-1)})
    with pytest.raises(ValueError, match="LEFT-padded"):
        pack_left_aligned(bad, 9)
    with pytest.raises(ValueError, match="seq_len"):
        pack_left_aligned(mb, 3)
    empty_prompt = batch([0, 3], [2, 1])
    with pytest.raises(ValueError, match="empty prompt"):
        pack_left_aligned(empty_prompt, 9)


def test_blank_rows_are_fully_masked_and_mirror_optional_fields():
    mb = batch([2, 3], [1, 4])
    mb.old_logp = torch.randn(2, 4)
    mb.advantages = torch.randn(2, 4)
    blank = blank_rows(mb, 3)
    assert blank.response_mask.sum() == 0 and blank.response_ids.shape == (3, 4)
    assert blank.old_logp.shape == (3, 4) and blank.advantages.shape == (3, 4)
    assert blank.engine_logp is None and blank.rewards is None  # absent in `mb`, absent here
    joined = RolloutBatch.cat([mb, blank])
    assert len(joined) == 5 and joined.old_logp is not None
    packed = pack_left_aligned(blank, 5)
    assert not packed["mask"].any()
    full = blank_rows(None, 2)  # a rank with no sample: every optional field present
    assert all(getattr(full, f) is not None for f in ("old_logp", "advantages", "engine_logp"))


def test_policy_class_satisfies_protocol_surface():
    for name in ("logprobs", "train_step", "state_dict", "load_state_dict"):
        assert callable(getattr(MegatronPolicy, name))
    assert issubclass(MegatronPolicy, Policy)  # runtime_checkable: method names only


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    # level 4: megatron's optimizer insists on 'torch.cuda.FloatTensor' grads (tp2_megatron_opt)
    run_torchrun(WORKERS / "policy_worker.py", nproc=2, out_dir=out, env={"SHIM_LEVEL": "4"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2", "pp2", "pp2_tied", "ep2", "tp2_megatron_opt", "tp2_valid_vocab"])
def test_logprobs_and_update_equal_reference(parity, case):
    for rank, res in enumerate(parity):
        r = res[case]
        assert r["logp_shape"] == [r["rows"], 7]
        assert r["logp_err"] < LOGP_TOL and r["ent_err"] < LOGP_TOL, (case, rank, r)
        assert r["skipped"] == 0.0
        assert r["grad_norm"] == pytest.approx(r["ref_norm"], rel=1e-5), (case, rank)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), (case, rank)
        assert r["delta_rel_err"] < UPDATE_TOL, (case, rank, r)
    if case == "ep2":  # DP = 2 over EP: 5 + 3 rows (rank 1 runs a blank micro-batch to match rank 0's count)
        assert [res[case]["rows"] for res in parity] == [5, 3]


@pytest.mark.slow
def test_non_finite_loss_skips_update(parity):
    for res in parity:
        r = res["tp2_skip"]
        assert r["skipped"] == 1.0 and r["unchanged"] and r["next_skipped"] == 0.0


@pytest.mark.slow
def test_state_dict_round_trip(parity):
    for res in parity:
        r = res["tp2_state"]
        assert r["moved"] and r["restored"] and r["refused_other_layout"]


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy_loop")
    run_torchrun(WORKERS / "policy_loop_worker.py", nproc=2, out_dir=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_two_loop_steps_on_megatron_policy(loop_runs, layout):
    runs = [res[layout] for res in loop_runs]
    for run in runs:
        assert len(run["metrics"]) == 2 and run["finite"]
        last = run["metrics"][-1]
        assert last["counters/rollout_steps"] == 2.0
        assert last["counters/optimizer_steps"] >= 1.0 and last["counters/skipped_updates"] == 0.0
        assert run["params_changed"] == run["params"] > 0  # AdamW touched every local parameter
    assert [run["dp"] for run in runs] == ([1, 1] if layout == "tp2" else [2, 2])

    def untimed(m):
        return {k: v for k, v in m.items() if not k.startswith(("timing/", "perf/"))}

    # TP ranks hold one replica and DP ranks share every reduced number: the logs agree everywhere
    assert [untimed(m) for m in runs[0]["metrics"]] == [untimed(m) for m in runs[1]["metrics"]]
