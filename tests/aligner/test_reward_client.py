"""LocalRewardClient keeps NeMo-Aligner's ``infer_rm(batch) -> future`` contract with the rule-based verifier."""
from pathlib import Path

import pytest
import torch

from nemo_dapo.aligner import reward_client as rc
from nemo_dapo.aligner.reward_client import ClientReward, LocalRewardClient, response_of
from nemo_dapo.core.reward import verify
from tests.aligner._fakes import CharTokenizer

TOK = CharTokenizer()


def _rollout(prompts, responses, answers):
    """NeMo-Aligner's packed rollout batch: prompt + response + EOS from position 0, right-padded."""
    rows = [TOK.text_to_ids(p) + TOK.text_to_ids(r) + [TOK.eos_id] for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows) + 3
    tokens = torch.tensor([r + [TOK.eos_id] * (width - len(r)) for r in rows])
    p = torch.tensor([len(TOK.text_to_ids(x)) for x in prompts])
    return {"response_tokens": tokens, "prompt_lengths": p, "response_lengths": torch.tensor([len(r) for r in rows]),
            "answers": answers}


def test_infer_rm_future_matches_the_verifier():
    responses = ["so\nAnswer: 42", "Answer: 41", "no answer here", "x\nAnswer: 7"]
    answers = ["42", "42", "1", "7"]
    batch = _rollout(["P1:", "prompt 2:", "3", "prompt four:"], responses, answers)
    client = LocalRewardClient(TOK, num_workers=1)
    try:
        future = client.infer_rm(batch)
        rewards = future.result()
        score, acc, preds = future.details()
    finally:
        client.close()
    expected = [verify(r, a) for r, a in zip(responses, answers)]
    assert rewards.shape == (4, 1)  # NeMo-Aligner's RMFutureResult shape; trainers squeeze(1)
    assert rewards.view(-1).tolist() == [v.score for v in expected] == [1.0, -1.0, -1.0, 1.0]
    assert acc.tolist() == [float(v.acc) for v in expected] and preds == [v.pred for v in expected]


def test_response_of_cuts_the_response_including_eos():
    batch = _rollout(["ab", "c"], ["xyz", "w"], ["", ""])
    ids, mask = response_of(batch)
    assert ids[0][mask[0].bool()].tolist() == TOK.text_to_ids("xyz") + [TOK.eos_id]
    assert ids[1][mask[1].bool()].tolist() == TOK.text_to_ids("w") + [TOK.eos_id]


def test_missing_answers_is_a_clear_error():
    batch = _rollout(["a"], ["b"], None)
    with pytest.raises(ValueError, match="answers"):
        LocalRewardClient(TOK, num_workers=1).infer_rm(batch)


def test_client_reward_is_the_loop_reward_fn():
    ids = torch.tensor([TOK.text_to_ids("Answer: 5") + [TOK.eos_id], TOK.text_to_ids("Answer: 6") + [TOK.eos_id]])
    mask = torch.ones_like(ids, dtype=torch.float)
    reward = ClientReward(LocalRewardClient(TOK, num_workers=1))
    score, acc, preds = reward(ids, mask, ["5", "5"])
    assert score.tolist() == [1.0, -1.0] and acc.tolist() == [1.0, 0.0] and preds == ["5", "6"]


class _ScoreOnlyFuture:
    def __init__(self, rewards):
        self.rewards = rewards

    def result(self):
        return self.rewards.view(-1, 1)


class _RemoteLikeClient:
    """A client that, like NeMo-Aligner's remote RM client, only returns rewards."""

    def infer_rm(self, batch):
        return _ScoreOnlyFuture(torch.tensor([0.5, -0.25]))


def test_client_reward_over_a_rewards_only_client_uses_the_sign_as_accuracy():
    score, acc, _ = ClientReward(_RemoteLikeClient())(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), ["", ""])
    assert score.tolist() == [0.5, -0.25] and acc.tolist() == [1.0, 0.0]


# ---- pool sizing ----------------------------------------------------------------------------------------------------
def test_pool_size_under_srun_uses_the_slurm_task_layout():
    from nemo_dapo.aligner.reward_client import ranks_per_node, reward_pool_size

    # srun, 8 tasks per node, no binding: LOCAL_WORLD_SIZE is unset, the node's 128 cores are split 8 ways
    srun = {"SLURM_NTASKS_PER_NODE": "8", "SLURM_LOCALID": "3"}
    assert ranks_per_node(srun) == 8 and reward_pool_size(srun, 128, 128) == 16
    assert reward_pool_size({"SLURM_TASKS_PER_NODE": "8(x16)"}, 128, 128) == 16
    # --cpus-per-task is the rank's share; a bound affinity is too
    assert reward_pool_size({**srun, "SLURM_CPUS_PER_TASK": "12"}, 128, 128) == 12
    assert reward_pool_size(srun, 14, 128) == 14
    # torchrun
    assert reward_pool_size({"LOCAL_WORLD_SIZE": "4"}, 64, 64) == 16
    # the cap, and never fewer than one
    assert reward_pool_size(srun, 128, 128, max_workers=6) == 6
    assert reward_pool_size({"LOCAL_WORLD_SIZE": "8"}, 4, 4) == 1
    # without any layout: all cores of the process (one rank)
    assert reward_pool_size({}, 32, 32) == 32


def test_client_sizes_its_pool_from_the_environment(monkeypatch):
    import nemo_dapo.aligner.reward_client as rc

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(rc, "default_num_workers", lambda: 64)
    monkeypatch.setattr(rc.os, "cpu_count", lambda: 64)
    client = LocalRewardClient(TOK, max_workers=32)
    try:
        assert client.num_workers == 8
    finally:
        client.close()
    assert LocalRewardClient(TOK, num_workers=3).num_workers == 3


def test_another_tokenizer_decodes_with_its_own_ids_to_text():
    """The fast decoder is NeMo's AutoTokenizer's only (checked on the real class in the NeMo trainer test,
    tests/aligner/test_trainer_e2e.py, and by the image build); any other tokenizer gets a list of ints."""
    seen = []

    class Recording(type(TOK)):
        def ids_to_text(self, ids):
            seen.append(ids)
            return super().ids_to_text(ids)

    decode = rc.response_decoder(Recording())
    assert decode(torch.tensor(TOK.text_to_ids("Answer: 7") + [TOK.eos_id])) == "Answer: 7"
    assert seen == [TOK.text_to_ids("Answer: 7") + [TOK.eos_id]] and type(seen[0][0]) is int
    assert rc.check_response_decoder(TOK) == []


def test_the_check_names_a_decoder_that_differs(monkeypatch):
    monkeypatch.setattr(rc, "response_decoder", lambda tok: lambda ids: TOK.ids_to_text(ids.tolist()[1:]))
    problems = rc.check_response_decoder(TOK)
    assert len(problems) == 1 and problems[0].startswith("response_decoder gives")


def test_the_trainer_image_runs_the_decoder_check():
    dockerfile = Path(__file__).resolve().parents[2] / "containers" / "Dockerfile"
    assert "python -m nemo_dapo.aligner.reward_client" in dockerfile.read_text()


def test_a_ranks_cpu_share_is_capped_by_its_affinity_and_torchrun_beats_slurm():
    from nemo_dapo.aligner.reward_client import ranks_per_node, reward_pool_size

    # --cpus-per-task larger than the CPUs this process may run on: a pool beyond them would only oversubscribe
    assert reward_pool_size({"SLURM_CPUS_PER_TASK": "32"}, 8, 128) == 8
    # torchrun inside a Slurm allocation: its LOCAL_WORLD_SIZE is the processes of this node, not Slurm's tasks
    assert ranks_per_node({"LOCAL_WORLD_SIZE": "4", "SLURM_TASKS_PER_NODE": "1", "SLURM_NTASKS_PER_NODE": "1"}) == 4


def test_a_wrong_number_of_answers_is_refused_at_the_call_not_in_the_scoring_thread():
    # raised on every rank of a model-parallel group before any scoring starts: in the thread it would surface on
    # the source rank only, at result(), while the other ranks wait in the broadcast
    batch = _rollout(["a", "b"], ["1", "2"], ["1"])
    client = LocalRewardClient(TOK, num_workers=1)
    try:
        with pytest.raises(ValueError, match="2 responses but 1 answers"):
            client.infer_rm(batch)
    finally:
        client.close()


def test_only_the_model_parallel_source_rank_scores(monkeypatch):
    batch = _rollout(["a"], ["Answer: 1"], ["1"])
    monkeypatch.setattr(rc, "_mp_group_and_src", lambda: ("mp-group", 4))  # this rank's group, its source rank 4
    scored = {}
    for rank in (4, 5):
        monkeypatch.setattr(rc.dist, "get_rank", lambda rank=rank: rank)
        client = LocalRewardClient(TOK, num_workers=1)

        def score(ids, mask, answers, rank=rank):
            scored[rank] = len(answers)
            return torch.ones(1), torch.ones(1), ["1"]

        client.score = score
        try:
            client.infer_rm(batch)
        finally:
            client.close()  # waits for the scoring thread
    assert scored == {4: 1}  # rank 5 gets rank 4's result by broadcast and scores nothing itself


def test_a_zero_reward_from_a_rewards_only_client_is_not_a_correct_answer():
    class Zero:
        def infer_rm(self, batch):
            return _ScoreOnlyFuture(torch.tensor([0.0, 1.0]))

    _, acc, _ = ClientReward(Zero())(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), ["", ""])
    assert acc.tolist() == [0.0, 1.0]


def test_client_reward_takes_the_accuracy_the_client_reports():
    # a client that reports acc (details) is not second-guessed from the sign of its score
    class Detailed:
        def result(self):
            return torch.tensor([[0.5], [-1.0]])

        def details(self):
            return torch.tensor([0.5, -1.0]), torch.tensor([0.0, 1.0]), ["x", "y"]

    class Client:
        def infer_rm(self, batch):
            return Detailed()

    score, acc, preds = ClientReward(Client())(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), ["", ""])
    assert score.tolist() == [0.5, -1.0] and acc.tolist() == [0.0, 1.0] and preds == ["x", "y"]


def test_client_reward_scores_only_the_masked_tokens_of_a_padded_response():
    # right-padded rows: the tokens after the mask (here digits that would extend the answer) are not the response's
    ids = torch.tensor([TOK.text_to_ids("Answer: 5") + [TOK.eos_id] + TOK.text_to_ids("77"),
                        TOK.text_to_ids("Answer: 6") + [TOK.eos_id] + TOK.text_to_ids("77")])
    mask = torch.ones_like(ids, dtype=torch.float)
    mask[:, -2:] = 0
    client = LocalRewardClient(TOK, num_workers=1)
    try:
        score, acc, preds = ClientReward(client)(ids, mask, ["5", "6"])
    finally:
        client.close()
    assert preds == ["5", "6"] and acc.tolist() == [1.0, 1.0]


@pytest.mark.nemo
def test_nemo_auto_tokenizer_takes_the_fast_decoder_and_it_decodes_as_ids_to_text():
    # the image build's check, here on every run: random ids over a trained tokenizer, special tokens mixed in
    pytest.importorskip("nemo")
    assert rc.check_installed_nemo() == []
