"""DAPO policy loss: token-level clipped surrogate with decoupled clip bounds (Clip-Higher), optional dual-clip,
optional truncated importance sampling, and the sequence-level baselines of the paper's ablation.

Split invariance: every loss here is a sum over tokens divided by a GLOBAL normaliser that the caller computes once
per optimizer step (summed over micro-batches and data-parallel ranks). The returned loss is then this micro-batch's
contribution, and summing the contributions gives the mini-batch loss however the batch was split.

Aggregation modes (``agg``) and their global normaliser:
  "token-mean"              sum_{i,t} l_it / num_tokens                 (DAPO; num_tokens = valid tokens)
  "seq-mean-token-mean"     sum_i mean_t(l_it) / num_seqs               (original GRPO)
  "seq-mean-token-sum"      sum_i sum_t(l_it) / num_seqs
  "seq-mean-token-sum-norm" sum_i sum_t(l_it) / (num_seqs * max_new_tokens)  (Dr. GRPO; the generation cap)
num_seqs counts sequences with at least one valid token; ``loss_normalizer`` gives a micro-batch's share of either,
and a ``LossFn`` calls the global one of its mode ``norm`` (core/types.py).

Masks are float/bool [B, T] with 1 on valid response tokens. Padding positions of logp/old_logp may hold anything:
they are selected away with ``torch.where``, never multiplied, so garbage there cannot turn into NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_dapo.core.overlong import overlong_filter_mask
from nemo_dapo.core.settings import TIS_LEVELS, LossSettings
from nemo_dapo.core.types import LossInput, RolloutBatch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0

# How to combine each metric over micro-batches and ranks. "sum": the metric is already this micro-batch's
# contribution to the mini-batch mean (weighted like the loss, see _metric_mean), so plain sums give the mean.
METRIC_REDUCTION = {
    "loss": "sum",  # the micro-batch's share of the mini-batch loss (the loss functions' normalisers are global)
    "clip_frac_low": "sum",  # tokens whose gradient the 1 - eps_low bound zeroed (A < 0, ratio < 1 - eps_low)
    "clip_frac_high": "sum",  # tokens whose gradient the 1 + eps_high bound zeroed (A > 0, ratio > 1 + eps_high)
    "dual_clip_frac": "sum",  # tokens capped by the dual clip (A < 0, ratio > clip_c)
    "approx_kl": "sum",  # KL(old || new), k3 estimator (r - 1) - log r, non-negative
    "ratio_mean": "sum",
    "ratio_min": "min",  # +inf when the micro-batch has no valid token
    "ratio_max": "max",  # -inf when the micro-batch has no valid token
    "num_tokens": "sum",  # valid tokens of this micro-batch (local count)
    "is_weight_mean": "sum",  # DAPOLossFn with TIS only
    "is_capped": "sum",  # DAPOLossFn with TIS only: share of tokens whose weight tis_cap truncated
    "logp_mismatch": "sum",  # DAPOLossFn with engine_logp present: mean |exp(engine - trainer) - 1|
    "entropy": "sum",  # DAPOLossFn only
    "token_prob": "sum",  # DAPOLossFn only: mean exp(logp)
    "overlong_filtered": "sum",  # DAPOLossFn with overlong_filter: rows masked out
    "rejected": "sum",  # DAPOLossFn with reject_logp_diff: rows masked out (the weights moved on since sampling)
}


def _check_agg(agg: str, num_tokens, num_seqs, max_new_tokens) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not one of {AGG_MODES}")
    if agg == "token-mean" and num_tokens is None:
        raise ValueError("agg='token-mean' needs num_tokens = the global valid-token count of the optimizer step")
    if agg != "token-mean" and num_seqs is None:
        raise ValueError(f"agg={agg!r} needs num_seqs = the global count of sequences with a valid token "
                         "(sum loss_normalizer(mask, agg) over micro-batches and ranks)")
    if agg == "seq-mean-token-sum-norm" and not (max_new_tokens is not None and max_new_tokens > 0):
        raise ValueError(f"agg='seq-mean-token-sum-norm' needs a constant max_new_tokens > 0 (the generation "
                         f"cap), got {max_new_tokens}")


def _check_shapes(logp, old_logp, advantages, mask, is_weights) -> None:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must all be [B, T], got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, got "
                         f"{tuple(advantages.shape)}")
    if is_weights is not None and is_weights.shape != logp.shape:
        raise ValueError(f"is_weights must be [B, T] like logp, got {tuple(is_weights.shape)}")


def _check_clip(eps_low: float, eps_high: float, clip_c: Optional[float]) -> None:
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1) (paper: 0.2), got {eps_low}")
    if not eps_high >= 0:
        raise ValueError(f"eps_high must be >= 0 (paper: 0.28), got {eps_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"clip_c (dual clip) must be > 1 or None to disable it (reference: 10.0), got {clip_c}")


def _masked_sum(x: torch.Tensor, valid: torch.Tensor, dim=None) -> torch.Tensor:
    x = torch.where(valid, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Max over valid entries; -inf (the identity of max) when there are none."""
    return torch.where(valid, x, torch.full_like(x, -torch.inf)).amax() if x.numel() else x.new_tensor(-torch.inf)


def _aggregate(x: torch.Tensor, valid: torch.Tensor, agg: str, norm, max_new_tokens) -> torch.Tensor:
    """This micro-batch's contribution to the mini-batch aggregate of per-token values ``x`` [B, T]."""
    # A global normaliser of 0 means every token of the step is masked; the numerator is then 0 as well.
    if isinstance(norm, torch.Tensor):
        norm = norm.to(x.dtype).clamp(min=1.0)
    else:
        norm = max(float(norm), 1.0)
    if agg == "token-mean":
        return _masked_sum(x, valid) / norm
    if agg == "seq-mean-token-mean":
        per_seq = _masked_sum(x, valid, -1) / valid.sum(-1).clamp(min=1).to(x.dtype)
        return per_seq.sum() / norm
    if agg == "seq-mean-token-sum":
        return _masked_sum(x, valid) / norm
    return _masked_sum(x, valid) / (norm * max_new_tokens)


def _metric_mean(x: torch.Tensor, valid: torch.Tensor, agg: str, norm) -> torch.Tensor:
    """Metrics are means weighted like the loss: per token for token-mean, per sequence for the seq-* modes."""
    return _aggregate(x.detach(), valid, "token-mean" if agg == "token-mean" else "seq-mean-token-mean", norm, None)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, *, eps_low: float, eps_high: float,
                      clip_c: Optional[float] = None):
    """Per-token loss (to minimise) and where each clip zeroed the gradient; all [B, T].

    loss = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 with dual clip additionally
    min(loss, -clip_c A), i.e. the loss of a negative-advantage token never exceeds clip_c |A|.
    """
    surr = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr, clipped)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    if clip_c is None:
        return loss, low, high, torch.zeros_like(low)
    cap = -adv * clip_c
    dual = (adv < 0) & (loss > cap)
    return torch.where(dual, cap, loss), low, high, dual


def dapo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                     eps_low: float, eps_high: float, clip_c: Optional[float] = None, num_tokens,
                     agg: str = "token-mean", is_weights: Optional[torch.Tensor] = None, num_seqs=None,
                     max_new_tokens: Optional[int] = None):
    """(loss, metrics): this micro-batch's share of the DAPO clipped-surrogate loss of one optimizer step.

    logp [B, T] log pi_theta of the response tokens (with grad); old_logp [B, T] log pi_old (no grad needed);
    advantages [B] (broadcast over tokens) or [B, T]; mask [B, T] 1 on valid tokens.
    num_tokens: GLOBAL valid-token count of the optimizer step (all micro-batches and ranks), a number or 0-dim
    tensor; required for "token-mean" and unused (may be None) by the seq-* modes, which need ``num_seqs`` (global
    count of sequences with a valid token) and, for "seq-mean-token-sum-norm", the constant ``max_new_tokens``.
    is_weights [B, T]: optional truncated importance-sampling weights multiplied into the per-token loss (treated as
    constants). The ratio is computed in (at least) fp32 from the log-ratio clamped to [-20, 20].
    A micro-batch without valid tokens returns exactly 0 with a finite (zero) gradient.
    Metrics (0-dim tensors, detached; see METRIC_REDUCTION for how to combine them across micro-batches).
    """
    _check_agg(agg, num_tokens, num_seqs, max_new_tokens)
    _check_shapes(logp, old_logp, advantages, mask, is_weights)
    _check_clip(eps_low, eps_high, clip_c)
    norm = num_tokens if agg == "token-mean" else num_seqs
    dtype = torch.promote_types(logp.dtype, torch.float32)
    valid = mask.bool()
    log_ratio = (logp.to(dtype) - old_logp.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    adv = advantages.detach().to(dtype)
    adv = adv.unsqueeze(-1).expand_as(ratio) if adv.dim() == 1 else adv

    per_token, low, high, dual = clipped_surrogate(ratio, adv, eps_low=eps_low, eps_high=eps_high, clip_c=clip_c)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(dtype)
    loss = _aggregate(per_token, valid, agg, norm, max_new_tokens)

    r = ratio.detach()
    metrics = {
        "clip_frac_low": _metric_mean(low.to(dtype), valid, agg, norm),
        "clip_frac_high": _metric_mean(high.to(dtype), valid, agg, norm),
        "dual_clip_frac": _metric_mean(dual.to(dtype), valid, agg, norm),
        "approx_kl": _metric_mean(r - 1.0 - log_ratio.detach(), valid, agg, norm),
        "ratio_mean": _metric_mean(r, valid, agg, norm),
        "ratio_min": -_masked_max(-r, valid),
        "ratio_max": _masked_max(r, valid),
        "num_tokens": valid.sum().to(dtype),
    }
    return loss, metrics


def loss_normalizer(mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """0-dim float: this micro-batch's share of the global normaliser of ``agg``.

    Sum it over the micro-batches and ranks of an optimizer step (e.g. ``reducer.sum``) and pass the total as
    ``num_tokens`` ("token-mean": valid tokens) or ``num_seqs`` (seq-* modes: sequences with a valid token).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not one of {AGG_MODES}")
    valid = mask.bool()
    if agg == "token-mean":
        return valid.sum().float()
    return valid.any(-1).sum().float()


def truncated_is_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float, level: str = "token") -> torch.Tensor:
    """[B, T] truncated importance weights of the sampled tokens, 0 on padding. No gradient flows through them.

    The engine sampled the tokens with its own numerics, or with older weights (partial rollouts, the overlap); the
    trainer's old_logp is the "behaviour" policy the loss assumes, so the sampling-distribution correction is
    pi_old(trainer) / pi_engine, capped to bound its variance. ``level`` "token": each token's own ratio,
    min(pi_old / pi_engine, cap). "sequence": one weight per row on each of its valid tokens, the ratio of the whole
    response's probabilities, min(prod_t pi_old / pi_engine, cap): the reward comes at the end, so a response that
    older weights sampled is reweighted as a whole (which responses the batch holds), not only token by token.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (TIS commonly uses 2.0), got {cap}")
    if level not in TIS_LEVELS:
        raise ValueError(f"level must be one of {TIS_LEVELS}, got {level!r}")
    valid, log_w = _log_ratio(old_logp, engine_logp, mask)
    if level == "sequence":
        log_w = torch.where(valid, log_w, torch.zeros_like(log_w)).sum(-1, keepdim=True).expand_as(log_w)
    w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)
    return torch.where(valid, w, torch.zeros_like(w))


def rejection_keep(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                   threshold: float) -> torch.Tensor:
    """[B] bool: the rows to keep in the loss, those whose mean |log pi_old - log pi_engine| over their valid tokens
    (``mask`` [B, T], 1 on response tokens) is at most ``threshold``; a row without a valid token is kept (it adds
    nothing). The truncated importance weight corrects a stale response token by token; this leaves out whole the
    responses sampled by weights the trainer's (pi_old) have moved far from.
    """
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    valid, log_w = _log_ratio(old_logp, engine_logp, mask)
    per_row = torch.where(valid, log_w.abs(), torch.zeros_like(log_w)).sum(-1) / valid.sum(-1).clamp(min=1)
    return per_row <= threshold


def _log_ratio(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(valid [B, T] bool, log pi_old - log pi_engine [B, T] in at least float32, without gradient)."""
    if old_logp.shape != engine_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(f"old_logp, engine_logp and mask must share a shape, got {tuple(old_logp.shape)}, "
                         f"{tuple(engine_logp.shape)}, {tuple(mask.shape)}")
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    return mask.bool(), old_logp.detach().to(dtype) - engine_logp.detach().to(dtype)


def logp_mismatch(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim: mean over valid tokens of |exp(engine_logp - trainer_logp) - 1| (0 when no token is valid)."""
    if engine_logp.shape != trainer_logp.shape or mask.shape != engine_logp.shape:
        raise ValueError(f"engine_logp, trainer_logp and mask must share a shape, got {tuple(engine_logp.shape)}, "
                         f"{tuple(trainer_logp.shape)}, {tuple(mask.shape)}")
    valid = mask.bool()
    return _mismatch_per_token(engine_logp, trainer_logp, valid).sum() / valid.sum().clamp(min=1)


def _mismatch_per_token(engine_logp, trainer_logp, valid):
    dtype = torch.promote_types(engine_logp.dtype, torch.float32)
    diff = (engine_logp.detach().to(dtype) - trainer_logp.detach().to(dtype)).clamp(-LOG_RATIO_CLAMP,
                                                                                    LOG_RATIO_CLAMP)
    return torch.where(valid, (diff.exp() - 1.0).abs(), torch.zeros_like(diff))


@dataclass(frozen=True)
class DAPOLossFn:
    """The DAPO loss as a ``LossFn`` (core/types.py): its options are ``settings`` (core/settings.LossSettings, the
    loss keys of the algorithm block, held as given), ``max_new_tokens`` the generation cap (the constant of
    "seq-mean-token-sum-norm"; None is allowed for the other modes).

    Called as ``loss_fn(logp, entropy, inputs, norm)`` with logp/entropy [B, T] aligned with ``inputs``
    (a ``LossInput``). ``norm`` is the GLOBAL normaliser of ``settings.agg``: the sum over the step's micro-batches
    and ranks of ``loss_fn.normalizer(inputs)``. For "token-mean" that is the valid-token count AFTER overlong
    filtering (the raw ``RolloutBatch.num_tokens()`` would over-count when truncated rows are masked out); for the
    seq-* modes it is the number of sequences with a valid token. A new loss option is a field of LossSettings
    (with its rule in core/settings.problems and its key in conf/algorithm/dapo.yaml) read here from ``settings``.
    """

    settings: LossSettings
    max_new_tokens: Optional[int] = None

    def __post_init__(self):
        s = self.settings
        if not isinstance(s, LossSettings):
            raise TypeError(f"DAPOLossFn.settings must be a core.settings.LossSettings, got {type(s).__name__}")
        _check_agg(s.agg, 1, 1, self.max_new_tokens)

    @property
    def tis_cap(self) -> Optional[float]:
        return self.settings.tis_cap

    def loss_mask(self, inputs: LossInput) -> torch.Tensor:
        """[B, T] float: the input's mask, with truncated rows zeroed when overlong filtering is on and rejected rows
        (:func:`rejection_keep`) when ``reject_logp_diff`` is set."""
        return self._mask_and_keep(_as_input(inputs))[0]

    def _mask_and_keep(self, inputs: LossInput) -> tuple:
        """(the loss mask [B, T] float, the rows ``reject_logp_diff`` keeps [B] bool, or None when it is off)."""
        mask, keep = inputs.mask.float(), None
        if self.settings.overlong_filter:
            mask = mask * overlong_filter_mask(inputs.truncated).to(mask.device).unsqueeze(-1)
        if self.settings.reject_logp_diff is not None:
            if inputs.engine_logp is None:
                raise ValueError("reject_logp_diff needs the sampler's log-probs: the step must fill "
                                 "RolloutBatch.engine_logp before the update (or set reject_logp_diff=null)")
            keep = rejection_keep(inputs.old_logp, inputs.engine_logp, inputs.mask,
                                  float(self.settings.reject_logp_diff))
            mask = mask * keep.to(mask.device, mask.dtype).unsqueeze(-1)
        return mask, keep

    def normalizer(self, inputs: LossInput) -> torch.Tensor:
        """0-dim: this micro-batch's share of the global normaliser (sum it over micro-batches and ranks)."""
        return loss_normalizer(self.loss_mask(inputs), self.settings.agg)

    def __call__(self, logp: torch.Tensor, entropy: Optional[torch.Tensor], inputs: LossInput, norm):
        inputs, s = _as_input(inputs), self.settings
        if s.tis_cap is not None and inputs.engine_logp is None:
            raise ValueError("the micro-batch has no engine_logp; the step must fill RolloutBatch.engine_logp "
                             "before the update (or disable TIS: tis_cap=None)")
        mask, keep = self._mask_and_keep(inputs)
        is_weights = None
        if s.tis_cap is not None:
            is_weights = truncated_is_weights(inputs.old_logp, inputs.engine_logp, mask, float(s.tis_cap),
                                              s.tis_level)
        token_mode = s.agg == "token-mean"
        loss, metrics = dapo_policy_loss(
            logp, inputs.old_logp, inputs.advantages, mask, eps_low=float(s.eps_low), eps_high=float(s.eps_high),
            clip_c=None if s.clip_c is None else float(s.clip_c), num_tokens=norm if token_mode else None,
            agg=s.agg, is_weights=is_weights, num_seqs=None if token_mode else norm,
            max_new_tokens=self.max_new_tokens)
        valid = mask.bool()

        def avg(x):
            return _metric_mean(x.float(), valid, s.agg, norm)

        metrics["token_prob"] = avg(logp.detach().float().exp())
        if entropy is not None:
            metrics["entropy"] = avg(entropy)
        if is_weights is not None:
            metrics["is_weight_mean"] = avg(is_weights)
            metrics["is_capped"] = avg((is_weights >= float(s.tis_cap)).float())
        if inputs.engine_logp is not None:
            metrics["logp_mismatch"] = avg(_mismatch_per_token(inputs.engine_logp, inputs.old_logp, valid))
        if s.overlong_filter:
            metrics["overlong_filtered"] = inputs.truncated.float().sum()
        if keep is not None:
            metrics["rejected"] = (inputs.mask.bool().any(-1) & ~keep).float().sum()
        return loss, metrics


def _as_input(inputs) -> LossInput:
    """A ``LossInput``; a core-layout RolloutBatch micro-batch is converted (``LossInput.of``), for the policies
    that still hand the loss their micro-batch."""
    return LossInput.of(inputs) if isinstance(inputs, RolloutBatch) else inputs


def make_loss_fn(*, eps_low: float, eps_high: float, clip_c: Optional[float] = None, agg: str = "token-mean",
                 max_new_tokens: Optional[int] = None, overlong_filter: bool = False,
                 tis_cap: Optional[float] = None, tis_level: str = "token",
                 reject_logp_diff: Optional[float] = None) -> DAPOLossFn:
    """The DAPO loss with the optional techniques off unless named (tests and small scripts; a run builds its loss
    from the algorithm block: core/settings.build_loss). Arguments: the fields of core/settings.LossSettings, and
    ``max_new_tokens`` the generation cap (the constant of "seq-mean-token-sum-norm")."""
    return DAPOLossFn(LossSettings(eps_low=eps_low, eps_high=eps_high, clip_c=clip_c, agg=agg,
                                   overlong_filter=overlong_filter, tis_cap=tis_cap, tis_level=tis_level,
                                   reject_logp_diff=reject_logp_diff), max_new_tokens=max_new_tokens)
