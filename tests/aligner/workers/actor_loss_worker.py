"""torchrun worker: the DAPO actor's loss, gradients and old log-probs against a plain reference.

Env: TP, PP (world = TP x PP x DP), SP (1: sequence parallelism, needs TP > 1), TOK_DIR (tokenizer), OUT_DIR. Every rank builds the same tiny NeMo actor and
the same global batch of 8 samples. DP rank d trains on an uneven share of it (3 / 5 rows at DP=2, with all of
rank 0's rows truncated, so under overlong filtering that rank holds no valid token).

Reference, per rank, on the FULL batch in ONE micro-batch: vocab-parallel logits gathered to the full vocabulary,
``torch.log_softmax``, then ``core.loss.dapo_policy_loss`` with the global token count. The actor computes the same
objective through vocab-parallel log-probs, micro-batches of 2 and the DP split; loss, gradients (after NeMo's DP
gradient reduction) and metrics must agree. Last, the debug sampler (generation.MegatronSampler) generates from the
same prompts; its tokens and log-probs are recorded (not under SP: the debug sampler does not pad sequences).
Writes ``rank<r>.json`` with the measured differences.

Under SP the packed batch has an odd sequence length (15), which megatron-core's split along the sequence cannot
take: the actor must pad it. The reference pads its one forward itself (trailing tokens, cut off again: causal
attention keeps them from changing earlier positions).
"""
import json
import os

from tests.support import nemo_cpu  # noqa: F401  (patches first)

import torch  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402

from nemo_aligner.utils.distributed import broadcast_tensor_within_pp  # noqa: E402
from nemo_dapo.megatron.layout import pack_rollout, unpack_response  # noqa: E402
from nemo_dapo.core.loss import make_loss_fn  # noqa: E402
from nemo_dapo.aligner.generation import MegatronSampler  # noqa: E402
from nemo_dapo.megatron.reduction import DPReducer  # noqa: E402
from nemo_dapo.aligner.trainer import ActorPolicy  # noqa: E402
from nemo_dapo.core.loop import _POLICY_METRIC_REDUCTION  # noqa: E402
from nemo_dapo.core.metrics import reduce_over_ranks  # noqa: E402
from nemo_dapo.core.loss import dapo_policy_loss, rejection_keep, truncated_is_weights  # noqa: E402
from nemo_dapo.core.types import RolloutBatch  # noqa: E402
from tests.support.policy_inputs import NoSchedule  # noqa: E402

TP, PP = int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
SP = os.environ.get("SP", "0") == "1"


def _sequence_parallel_torch_norm() -> None:
    """megatron-core's local-spec norm (WrappedTorchNorm) refuses sequence parallelism, which on GPUs the TE / apex
    norms provide. A torch norm is correct under SP once its weights carry ``sequence_parallel`` (what those norms
    set): NeMo's grad_reductions then all-reduces their partial (sequence-sharded) gradients over TP."""
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        norm_cls = torch.nn.LayerNorm if config.normalization == "LayerNorm" else torch.nn.RMSNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


if SP:
    _sequence_parallel_torch_norm()
ptl_trainer, actor = nemo_cpu.build_actor(TP, PP, mbs=2, gbs=4, tokenizer_dir=os.environ["TOK_DIR"],
                                          sequence_parallel=SP)
RANK, DP, DP_RANK = torch.distributed.get_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
EOS = actor.tokenizer.eos_id


def global_batch() -> RolloutBatch:
    """8 samples: left-padded prompts of 2-6 tokens, responses of 1-9 tokens, 3 truncated, random advantages."""
    g = torch.Generator().manual_seed(7)
    b, p_w, r_w = 8, 6, 9
    p_len = torch.tensor([2, 6, 3, 5, 4, 6, 2, 3])
    r_len = torch.tensor([9, 4, 1, 7, 9, 2, 5, 8])
    prompt_ids = torch.randint(3, 250, (b, p_w), generator=g)
    prompt_mask = (torch.arange(p_w)[None] >= (p_w - p_len)[:, None]).long()
    prompt_ids = prompt_ids * prompt_mask
    response_mask = (torch.arange(r_w)[None] < r_len[:, None]).float()
    response_ids = (torch.randint(3, 250, (b, r_w), generator=g) * response_mask).long()
    truncated = torch.tensor([True, True, True, False, False, False, False, False])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, group_ids=torch.arange(b) // 4, truncated=truncated,
                        advantages=torch.randn(b, generator=g))


def split_ready(tokens: torch.Tensor) -> torch.Tensor:
    """The reference's own padding under SP: EOS columns up to a multiple of TP (none without SP)."""
    extra = (-tokens.shape[1]) % TP if SP else 0
    return torch.cat([tokens, tokens.new_full((tokens.shape[0], extra), EOS)], 1)


def full_vocab_logp(tokens: torch.Tensor, vocab_limit=None) -> tuple:
    """Reference log-probs / entropies [B, S-1] by gathering the vocabulary and using torch.log_softmax; with
    ``vocab_limit`` the ids >= it (Megatron's vocabulary padding) are excluded, as the sampler does."""
    s = tokens.shape[1]
    tokens = split_ready(tokens)
    attn, _, pos = actor.get_ltor_masks_and_position_ids(tokens)

    def fwd(it, model):
        mb = next(it)
        logits = model(mb["t"], mb["p"], mb["a"], labels=None)

        def collect(logits, non_loss_data=True):
            full = gather_from_tensor_model_parallel_region(logits).float().clone()
            if vocab_limit is not None:
                full[..., vocab_limit:] = float("-inf")
            lp_all = torch.log_softmax(full, -1)[:, :s - 1]
            return torch.stack([lp_all.gather(-1, mb["t"][:, 1:s, None]).squeeze(-1),
                                -(lp_all.exp() * lp_all).sum(-1)])

        return logits, collect

    out = get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([{"t": tokens, "p": pos, "a": attn}]),
                                      model=actor.model, num_microbatches=1, forward_only=True,
                                      seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                      collect_non_loss_data=True)
    out = broadcast_tensor_within_pp(out[0] if out else None, dtype=torch.float32)
    return out[0], out[1]


def reference_grads(packed: dict, loss_kw: dict, tis_cap, reject=None, tis_level="token") -> tuple:
    """Core loss on the full batch in one micro-batch (gathered vocab); returns (loss, grads) after DP reduction."""
    tokens = packed["response_tokens"]
    s = tokens.shape[1]
    padded = split_ready(tokens)
    attn, _, pos = actor.get_ltor_masks_and_position_ids(padded)
    mask = packed["mask"] * (packed["is_end"][:, None] if loss_kw["overlong_filter"] else 1.0)
    if reject is not None:  # whole rows out, decided on the full batch
        keep = rejection_keep(packed["prev_logprobs"], packed["engine_logprobs"], packed["mask"], reject)
        mask = mask * keep[:, None]
    holder = {}

    def fwd(it, model):
        mb = next(it)
        logits = model(mb["t"], mb["p"], mb["a"], labels=None)

        def loss_func(logits):
            lp_all = torch.log_softmax(gather_from_tensor_model_parallel_region(logits).float(), -1)[:, :s - 1]
            logp = lp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
            w = None if tis_cap is None else truncated_is_weights(packed["prev_logprobs"], packed["engine_logprobs"],
                                                                  mask, tis_cap, tis_level)
            loss, m = dapo_policy_loss(logp, packed["prev_logprobs"], packed["advantages"], mask,
                                       eps_low=loss_kw["eps_low"], eps_high=loss_kw["eps_high"],
                                       clip_c=loss_kw["clip_c"], num_tokens=mask.sum(), is_weights=w)
            holder.update(loss=float(loss), **{k: float(v) for k, v in m.items()})
            return loss, {}

        return logits, loss_func

    for m in actor.get_model_module_list():
        m.zero_grad()
    get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([{"t": padded, "p": pos, "a": attn}]),
                                model=actor.model, num_microbatches=1, forward_only=False,
                                seq_length=padded.shape[1], micro_batch_size=tokens.shape[0])
    actor.finish_training_step()
    box = [holder]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_world_size() - 1)
    return box[0], {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}


def share_of(batch: RolloutBatch) -> list:
    if DP == 1:
        return list(range(len(batch)))
    cut = [0, 3, 8]  # uneven: rank 0 gets the three truncated rows
    return list(range(cut[DP_RANK], cut[DP_RANK + 1]))


def logged_metrics(batch: RolloutBatch, loss_fn) -> dict:
    """What the trainer logs for one update of ``batch``: ActorPolicy.train_step on this rank's share (an lr=0
    optimizer keeps the weights), then the step loop's combination over DP (core.metrics.reduce_over_ranks with
    the loop's table)."""
    params = [p for p in actor.parameters() if p.requires_grad]
    # no clipping: NeMo's clip needs the optimizer PTL sets up, and the logged metrics do not depend on it
    policy = ActorPolicy(actor, torch.optim.SGD(params, lr=0.0), NoSchedule(), gradient_clip_val=None)
    reducer = DPReducer()
    num_tokens = float(reducer.sum(loss_fn.normalizer(batch.select(share_of(batch)))))
    out = policy.train_step(batch.select(share_of(batch)), norm=num_tokens, loss_fn=loss_fn)
    return reduce_over_ranks(out, reducer, _POLICY_METRIC_REDUCTION)


METRIC_KEYS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "num_tokens", "entropy", "approx_kl")


def actor_update(local: dict, loss_fn) -> tuple:
    """(loss, metrics, grads after the DP reduction) of the actor's training step on this rank's share."""
    actor.prepare_for_training_step()
    for m in actor.get_model_module_list():
        m.zero_grad()
    loss, metrics = actor.get_loss_and_metrics(local, forward_only=False, loss_fn=loss_fn)
    actor.finish_training_step()
    return loss, metrics, {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}


def run_case(name: str, loss_kw: dict, tis_cap, batch: RolloutBatch, ref_lp: torch.Tensor, reject=False,
             tis_level="token") -> dict:
    """``reject``: also leave out the rows whose mean |old - engine| log-prob difference is above the batch's median
    (reject_logp_diff halfway between the two middle rows', so that no row sits on the threshold). ``tis_level``:
    the loss key of that name (sequence: one weight per row, so the rows must reach the loss unpacked)."""
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(batch.response_ids.shape, generator=g) * 0.9
    batch.old_logp = (ref_lp + noise) * batch.response_mask  # ratios spread over ~[0.15, 6]: every clip fires
    batch.engine_logp = (ref_lp + 0.3 * torch.randn(batch.response_ids.shape, generator=g)) * batch.response_mask
    threshold = None
    if reject:
        m = batch.response_mask
        per_row = ((batch.old_logp - batch.engine_logp).abs() * m).sum(-1) / m.sum(-1).clamp(min=1)
        mid = per_row.sort().values[len(per_row) // 2 - 1:len(per_row) // 2 + 1]
        threshold = float(mid.mean())
    packed_full = pack_rollout(batch, EOS)
    ref, ref_grads = reference_grads(packed_full, loss_kw, tis_cap, threshold, tis_level)

    loss_fn = make_loss_fn(eps_low=loss_kw["eps_low"], eps_high=loss_kw["eps_high"], clip_c=loss_kw["clip_c"],
                           overlong_filter=loss_kw["overlong_filter"], tis_cap=tis_cap, tis_level=tis_level,
                           reject_logp_diff=threshold)
    local = pack_rollout(batch.select(share_of(batch)), EOS)
    loss, metrics, grads = actor_update(local, loss_fn)
    assert grads.keys() == ref_grads.keys() and grads, (sorted(grads), sorted(ref_grads))
    gdiff = max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads)
    gscale = max(float(ref_grads[n].abs().max()) for n in grads)
    # the former path (NeMo's [b, S, V/tp] logits) on the same batch and micro-batches
    actor.logprobs_from_logits = True
    loss_l, metrics_l, grads_l = actor_update(local, loss_fn)
    actor.logprobs_from_logits = False
    # micro-batches packed by a token budget (3 rows of <= 16 tokens each, not micro_batch_size=2): same update
    with open_dict(actor.cfg):
        actor.cfg.dapo.micro_batch_tokens = 48
    loss_p, metrics_p, grads_p = actor_update(local, loss_fn)
    with open_dict(actor.cfg):
        actor.cfg.dapo.micro_batch_tokens = None
    logged = logged_metrics(batch, loss_fn)
    return {"case": name, "loss": loss, "ref_loss": ref["loss"], "grad_max_abs_diff": gdiff, "grad_max_abs": gscale,
            "logits_path": {"loss": loss_l, "metrics": {k: metrics_l[k] for k in metrics_l if k in METRIC_KEYS},
                            "grad_max_abs_diff": max(float((grads[n] - grads_l[n]).abs().max()) for n in grads)},
            "packed": {"loss": loss_p, "metrics": {k: metrics_p[k] for k in metrics_p if k in METRIC_KEYS},
                       "grad_max_abs_diff": max(float((grads_p[n] - ref_grads[n]).abs().max()) for n in grads)},
            "logged": {k: logged[k] for k in ("loss", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                                                "num_tokens", "approx_kl") if k in logged},
            "metrics": {k: metrics[k] for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "num_tokens",
                                                 "entropy", "approx_kl") if k in metrics},
            "ref_metrics": {k: ref[k] for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "num_tokens",
                                                "approx_kl")}}


batch = global_batch()
packed = pack_rollout(batch, EOS)
ref_lp_shift, ref_ent_shift = full_vocab_logp(packed["response_tokens"])
lp_shift, ent_shift = actor.get_logprobs_and_entropy(packed["response_tokens"])
actor.logprobs_from_logits = True  # the former path: NeMo's [b, S, V/tp] logits
lp_logits, ent_logits = actor.get_logprobs_and_entropy(packed["response_tokens"])
actor.logprobs_from_logits = False
# each micro-batch cut to its own longest row (what ActorPolicy.logprobs does)
lp_trim, ent_trim = actor.get_logprobs_and_entropy(packed["response_tokens"], lengths=packed["response_lengths"])
p_len = packed["prompt_lengths"]
ref_lp = unpack_response(ref_lp_shift, p_len, batch.response_ids.shape[1]) * batch.response_mask
lp = unpack_response(lp_shift, p_len, batch.response_ids.shape[1]) * batch.response_mask
ent = unpack_response(ent_shift, p_len, batch.response_ids.shape[1]) * batch.response_mask
ref_ent = unpack_response(ref_ent_shift, p_len, batch.response_ids.shape[1]) * batch.response_mask
valid_ent = (ref_ent * batch.response_mask).sum() / batch.response_mask.sum()

result = {"rank": RANK, "tp": TP, "pp": PP, "dp": DP, "sp": SP, "seq_len": int(packed["response_tokens"].shape[1]),
          "logp_max_abs_diff": float((lp - ref_lp).abs().max()),
          "entropy_max_abs_diff": float((ent - ref_ent).abs().max()),
          "ref_entropy_mean": float(valid_ent), "cases": [],
          # all S-1 positions of every row (no lengths given: nothing trimmed), hidden-state vs logits path
          "paths_logp_max_abs_diff": float((lp_shift - lp_logits).abs().max()),
          "paths_entropy_max_abs_diff": float((ent_shift - ent_logits).abs().max()),
          "trimmed_logp_max_abs_diff": float(((unpack_response(lp_trim, p_len, batch.response_ids.shape[1]) *
                                               batch.response_mask) - lp).abs().max()),
          "trimmed_entropy_max_abs_diff": float(((unpack_response(ent_trim, p_len, batch.response_ids.shape[1]) *
                                                  batch.response_mask) - ent).abs().max())}
base = {"eps_low": 0.2, "eps_high": 0.28, "clip_c": 3.0}
result["cases"].append(run_case("filter+dualclip", dict(base, overlong_filter=True), None, batch, ref_lp))
result["cases"].append(run_case("tis", dict(base, clip_c=None, overlong_filter=False), 2.0, batch, ref_lp))
result["cases"].append(run_case("tis+reject", dict(base, clip_c=None, overlong_filter=False), 2.0, batch, ref_lp,
                                reject=True))
result["cases"].append(run_case("tis-seq", dict(base, clip_c=None, overlong_filter=False), 2.0, batch, ref_lp,
                                tis_level="sequence"))

with open(os.path.join(os.environ["OUT_DIR"], f"rank{RANK}.json"), "w") as f:
    json.dump(result, f, indent=1)
if SP:  # the debug sampler's forwards are not padded for the sequence split
    torch.distributed.barrier()
    raise SystemExit(0)
# The debug sampler: same tokens on every rank (same seed); its log-probs are those of the model's distribution
# restricted to the tokenizer's vocabulary (it never samples Megatron's padding ids).
gen = MegatronSampler(actor).generate(batch.prompt_ids, batch.prompt_mask, max_new_tokens=5, temperature=1.0,
                                      top_p=1.0, seed=3)
sampled = RolloutBatch(prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask, response_ids=gen.response_ids,
                       response_mask=gen.response_mask, group_ids=batch.group_ids, truncated=gen.truncated)
lp_ref = full_vocab_logp(pack_rollout(sampled, EOS)["response_tokens"], actor.tokenizer.vocab_size)[0]
lp_ref = unpack_response(lp_ref, p_len, gen.response_ids.shape[1]) * gen.response_mask
result["sampler_tokens"] = gen.response_ids.tolist()
result["sampler_lengths"] = gen.response_mask.sum(-1).tolist()
result["sampler_logp_max_abs_diff"] = float((gen.logprobs - lp_ref).abs().max())
result["sampler_max_id"] = int(gen.response_ids.max())
result["vocab_size"] = int(actor.tokenizer.vocab_size)
with open(os.path.join(os.environ["OUT_DIR"], f"rank{RANK}.json"), "w") as f:
    json.dump(result, f, indent=1)
torch.distributed.barrier()
