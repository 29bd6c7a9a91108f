"""megatron/step.py in one process: the micro-batcher and its filler (the schedule itself runs in the multi-process
tests: tests/megatron/test_policy.py on a bare GPTModel, tests/aligner/test_actor_loss.py on the NeMo actor)."""
import pytest
import torch

from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.megatron.layout import pack_rollout
from nemo_dapo.megatron.step import microbatches, normalizer_share, row_lengths

PAD = 0


def _batch(p_len, r_len, p_width=5, r_width=6):
    g = torch.Generator().manual_seed(0)
    b = len(p_len)
    prompt_mask = (torch.arange(p_width)[None] >= (p_width - torch.tensor(p_len))[:, None]).long()
    response_mask = (torch.arange(r_width)[None] < torch.tensor(r_len)[:, None]).float()
    return RolloutBatch(prompt_ids=torch.randint(10, 99, (b, p_width), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask,
                        response_ids=(torch.randint(10, 99, (b, r_width), generator=g) * response_mask).long(),
                        response_mask=response_mask, group_ids=torch.arange(b), truncated=torch.zeros(b).bool(),
                        old_logp=torch.randn(b, r_width, generator=g) * response_mask,
                        advantages=torch.randn(b, generator=g))


def test_rows_are_grouped_longest_first_and_cut_to_their_own_length():
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 2, 4]), PAD)  # real lengths 3, 11, 3, 7
    assert row_lengths(packed).tolist() == [3, 11, 3, 7]
    groups, micro = microbatches(packed, multiple=4, pad_id=PAD, max_rows=2)
    assert groups == [[1, 3], [0, 2]]
    assert [mb["response_tokens"].shape for mb in micro] == [(2, 12), (2, 4)]  # 11 -> 12, 3 -> 4
    for g, mb in zip(groups, micro):
        assert mb["mask"].shape[1] == mb["response_tokens"].shape[1] - 1
        w = min(mb["response_tokens"].shape[1], packed["response_tokens"].shape[1])
        assert torch.equal(mb["response_tokens"][:, :w], packed["response_tokens"][g, :w])
        assert mb["mask"].sum() == packed["mask"][g].sum()  # no response token lost, none added
        assert torch.equal(mb["advantages"], packed["advantages"][g])


def test_a_token_budget_packs_short_rows_together():
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 2, 4]), PAD)
    groups, _ = microbatches(packed, multiple=4, pad_id=PAD, max_tokens=16)
    assert groups == [[1], [3, 0], [2]]  # 12 alone; 2 x 8; 3 x 8 would exceed 16


def test_an_empty_rank_runs_one_fully_masked_filler_micro_batch():
    packed = {k: v[:0] for k, v in pack_rollout(_batch([2], [3]), PAD).items()}
    groups, micro = microbatches(packed, multiple=8, pad_id=PAD, max_rows=4)
    assert groups == [] and len(micro) == 1
    filler = micro[0]
    assert set(filler) == set(packed) and filler["response_tokens"].shape == (1, 8)
    assert filler["mask"].sum() == 0 and filler["is_end"].tolist() == [1.0]


def test_the_planner_refuses_a_plan_without_any_bound():
    packed = pack_rollout(_batch([2], [3]), PAD)
    with pytest.raises(ValueError, match="max_tokens"):
        microbatches(packed, multiple=1, pad_id=PAD)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_normalizer_share_is_the_rank_total_over_its_micro_batches(agg):
    """The step's global normaliser is the sum of every rank's share, so a rank's share must be the total over its
    micro-batches (filler included, which adds nothing), whatever the split: valid tokens for token-mean, rows with
    a valid token for the sequence means. Expected values counted from the packed mask directly."""
    from nemo_dapo.core.loss import make_loss_fn

    loss_fn = make_loss_fn(eps_low=0.2, eps_high=0.28, agg=agg, max_new_tokens=6)
    packed = pack_rollout(_batch([2, 5, 1, 3], [1, 6, 0, 4]), PAD)  # row 2 has no response token
    want = packed["mask"].sum() if agg == "token-mean" else (packed["mask"].sum(1) > 0).sum()
    for max_rows in (1, 2, 4):
        _, micro = microbatches(packed, multiple=4, pad_id=PAD, max_rows=max_rows)
        assert float(normalizer_share(loss_fn, micro)) == float(want), max_rows
    empty = {k: v[:0] for k, v in packed.items()}
    assert float(normalizer_share(loss_fn, microbatches(empty, multiple=4, pad_id=PAD, max_rows=2)[1])) == 0.0


def _last_stage(weight, tied):
    """The attributes of a last-stage GPTModel that the log-prob path reads (its output weight, tied or not)."""
    from types import SimpleNamespace

    inner = SimpleNamespace(config=SimpleNamespace(sequence_parallel=False), share_embeddings_and_output_weights=tied,
                            post_process=True)
    if tied:
        inner.shared_embedding_or_output_weight = lambda: weight
    else:
        inner.output_layer = SimpleNamespace(weight=weight)
    return inner


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("with_positions", [False, True])
def test_hidden_logprobs_entropy_reads_the_targets_at_their_positions(gloo_world_of_one, tied, with_positions):
    """From megatron's [S, b, H] final hidden states: target t of row b is scored from the hidden state at
    ``positions[b, t]`` (default t), with the output weight (the embedding when tied), the vocabulary rows beyond
    ``valid_vocab`` left out and ``temperature`` applied. Reference: plain fp64 log_softmax of the full logits."""
    import tests.support.megatron_cpu_shim  # noqa: F401  (megatron's RNG setup asks for CUDA)
    from nemo_dapo.megatron.step import hidden_logprobs_entropy
    from tests.support.megatron_model import destroy_parallel, initialize_parallel

    initialize_parallel()
    try:
        g = torch.Generator().manual_seed(3)
        s, b, h, padded, valid, temperature = 7, 2, 8, 12, 10, 0.8
        hidden, weight = torch.randn(s, b, h, generator=g), torch.randn(padded, h, generator=g)
        targets = torch.randint(0, valid, (b, 4), generator=g)
        positions = torch.tensor([[6, 0, 3, 3], [1, 2, 5, 4]]) if with_positions else None
        logp, ent = hidden_logprobs_entropy(_last_stage(weight, tied), hidden, targets, positions=positions,
                                            temperature=temperature, valid_vocab=valid, chunk_size=3)
        where = positions if with_positions else torch.arange(4).expand(b, 4)
        for row in range(b):
            for t in range(4):
                ref = torch.log_softmax((weight[:valid] @ hidden[where[row, t], row]).double() / temperature, -1)
                assert logp[row, t].item() == pytest.approx(ref[targets[row, t]].item(), abs=1e-5)
                assert ent[row, t].item() == pytest.approx(-(ref.exp() * ref).sum().item(), abs=1e-5)
    finally:
        destroy_parallel()


@pytest.mark.parametrize("saved", [True, False])
def test_hidden_states_only_puts_post_process_back(saved):
    """Inside, the model returns hidden states (post_process False); after, each stage has its own setting back
    (False on every stage but the last), also when the forward raised."""
    from nemo_dapo.megatron.step import hidden_states_only

    inner = _last_stage(torch.zeros(1, 1), False)
    inner.post_process = saved
    with hidden_states_only(inner):
        assert inner.post_process is False
    assert inner.post_process is saved
    with pytest.raises(RuntimeError), hidden_states_only(inner):
        raise RuntimeError("forward failed")
    assert inner.post_process is saved


def test_sequences_already_at_a_multiple_are_not_padded():
    """pad_seq_len pads to the NEXT multiple only when needed: a width that already is one stays (an extra block
    of padding would cost a whole multiple of compute per micro-batch)."""
    from nemo_dapo.megatron.step import pad_seq_len

    packed = pack_rollout(_batch([2, 2], [6, 2]), PAD)  # width 8
    for multiple, want in ((4, 8), (8, 8), (3, 9), (1, 8), (5, 10)):
        out, s = pad_seq_len(packed, multiple, PAD)
        assert s == 8 and out["response_tokens"].shape[1] == want and out["mask"].shape[1] == want - 1
        assert torch.equal(out["response_tokens"][:, :8], packed["response_tokens"])
        assert out["response_tokens"][:, 8:].eq(PAD).all() and out["mask"][:, 7:].eq(0).all()


@pytest.mark.parametrize("multiple", [1, 2, 3, 8, 16])
def test_every_shifted_field_stays_on_its_grid_whatever_the_padding(multiple):
    """Each micro-batch's [b, S'-1] fields (mask, old and engine log-probs) line up with its [b, S'] tokens after
    the cut to the group's longest row AND the padding to ``multiple``, which may add 0, 1 or many columns: entry
    t is token t + 1's, as in the packed batch."""
    batch = _batch([2, 5, 1, 3], [1, 6, 0, 4])
    batch.engine_logp = torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(1)) \
        * batch.response_mask
    packed = pack_rollout(batch, PAD)
    shifted = [k for k, v in packed.items() if v.dim() == 2 and k != "response_tokens"]
    assert sorted(shifted) == ["engine_logprobs", "mask", "prev_logprobs"]
    for max_rows in (1, 2):
        groups, micro = microbatches(packed, multiple=multiple, pad_id=PAD, max_rows=max_rows)
        for g, mb in zip(groups, micro):
            width = mb["response_tokens"].shape[1]
            assert width % multiple == 0
            real = min(width, packed["response_tokens"].shape[1])
            for k in shifted:
                assert mb[k].shape == (len(g), width - 1), (k, multiple, max_rows)
                assert torch.equal(mb[k][:, :real - 1], packed[k][g, :real - 1]), k
                assert mb[k][:, real - 1:].eq(0).all(), k
