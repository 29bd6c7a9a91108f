"""The DAPO algorithm block as typed settings that validate themselves, and the one builder both paths call.

Both configs carry the same keys (CPU: the ``algorithm.*`` block of conf/dapo_base.yaml; NeMo-Aligner:
the one block ``model.dapo.algorithm.*`` of conf/gpt_dapo_actor.yaml, see ``cluster/config_load.ALGORITHM_KEYS``).
Each path reads its YAML strictly into a flat ``{field: value}`` dict whose fields are :data:`FIELDS` (dotted for
the nested blocks: ``dynamic_sampling.max_age``, ``overlong.l_cache``), and then:

  * :func:`problems` lists what cannot train, as ``(field, message)`` pairs; each validator prefixes its own key
    (the CLI's ``local/config_checks.py``, the NeMo-free ``cluster/config_validate.py``), so the rules live once, here;
  * :func:`from_values` builds :class:`AlgorithmSettings` (every field required: the defaults live in the YAML);
  * :func:`build_loop_parts` returns ``(LoopSettings, BatchFiller, DAPOLossFn)``; :func:`build_loss` the loss alone.

Names follow the paper: eps_low / eps_high (decoupled clip), G = group_size, L_max / L_cache (soft overlong
punishment, eq. 13). Importing this module loads no torch (the validators run without it); the builder imports the
torch-side core modules when called.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, get_type_hints

# Mirrors of core.loss.AGG_MODES and core.dynamic_sampling.BUDGET_POLICIES (those modules import torch); the tests
# assert the copies agree.
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
BUDGET_POLICIES = ("raise", "train_partial", "unbounded")
# What one truncated importance weight covers (core/loss.truncated_is_weights): a token, or a whole response.
TIS_LEVELS = ("token", "sequence")
# The most skips in a row of history-based prompt skipping (core/prompt_history.py): with it every prompt is
# generated again within MAX_SKIPS + 1 epochs, a bound a run reaches; 10**12 would mean "skip forever".
MAX_SKIPS = 100
# The smallest temperature above 0 (greedy) a sampler takes (core/sampling.py, the engine servers' requests, both
# validators): below it sampling is greedy in effect, and a tiny one (under ~1e-37 for logits of order 10) divides
# float32 logits into inf, so every log-prob is NaN.
MIN_TEMPERATURE = 1e-4


class ConfigError(ValueError):
    """A config or override that cannot run, on either path (the CLI's and the NeMo-Aligner launch's validators).

    ``problems``: every reason, each naming its key and the fix. Built from one message, that message is the error's
    text; built from a list, the text lists them all under one heading.
    """

    def __init__(self, problems):
        one = isinstance(problems, str)
        self.problems = [problems] if one else [str(p) for p in problems]
        super().__init__(problems if one else "invalid DAPO config:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """Dynamic sampling (keep groups with 0 < accuracy < 1; see core/dynamic_sampling.BatchFiller)."""
    enabled: bool
    max_gen_batches: int
    on_budget_exhausted: str
    max_age: int
    adaptive: bool
    gen_batch_size: Optional[int]
    max_gen_batch_size: Optional[int]
    prior_pass_rate: float
    prior_weight: float
    pass_rate_memory: float
    safety: float


@dataclass(frozen=True)
class SkipHistorySettings:
    """History-based prompt skipping before generation (core/prompt_history.py; keys under
    ``dynamic_sampling.skip_history``): skip a prompt with probability 1 - (1 - skip_prob)^streak after ``streak``
    uninformative groups in a row, but never more than ``max_skips`` times in a row."""
    enabled: bool
    skip_prob: float
    max_skips: int


@dataclass(frozen=True)
class OverlongSettings:
    """Soft overlong punishment: 0 up to L_max - L_cache, ramping to -penalty_factor at L_max (None = the cap)."""
    enabled: bool
    l_max: Optional[int]
    l_cache: int
    penalty_factor: float


@dataclass(frozen=True)
class LossSettings:
    """The clipped policy-gradient loss (core/loss.DAPOLossFn holds it): the part of the block the actor needs alone."""
    eps_low: float
    eps_high: float
    clip_c: Optional[float]
    agg: str
    overlong_filter: bool
    tis_cap: Optional[float]
    tis_level: str
    reject_logp_diff: Optional[float]

    def __post_init__(self):
        _raise(problems({f.name: getattr(self, f.name) for f in fields(self)}), type(self).__name__)


@dataclass(frozen=True)
class AlgorithmSettings:
    """The whole DAPO block. Construct through :func:`from_values` (or with every field given). The loss fields
    are flat keys of the block (``eps_low``, not ``loss.eps_low``): :data:`FIELDS` lists them without a prefix."""
    group_size: int  # G
    loss: LossSettings
    adv_eps: float
    scale_by_std: bool
    dynamic_sampling: DynamicSamplingSettings
    skip_history: SkipHistorySettings
    overlong: OverlongSettings

    def __post_init__(self):
        _raise(problems(flatten(self)), type(self).__name__)


# sub-blocks: (class, key prefix in the flat view); the loss's keys carry none
_NESTED = {"loss": (LossSettings, ""), "dynamic_sampling": (DynamicSamplingSettings, "dynamic_sampling."),
           "skip_history": (SkipHistorySettings, "dynamic_sampling.skip_history."),
           "overlong": (OverlongSettings, "overlong.")}


def _flat_names():
    for f in fields(AlgorithmSettings):
        if f.name in _NESTED:
            cls, prefix = _NESTED[f.name]
            yield from (prefix + g.name for g in fields(cls))
        else:
            yield f.name


FIELDS = tuple(_flat_names())
LOSS_FIELDS = tuple(f.name for f in fields(LossSettings))


def field_types() -> dict:
    """``{field: type}`` of every field in :data:`FIELDS` (the type hints of the settings classes), in that order:
    what a config schema of the block is derived from (local/config_schema.py)."""
    hints = {}
    for f in fields(AlgorithmSettings):
        if f.name in _NESTED:
            cls, prefix = _NESTED[f.name]
            hints.update({prefix + name: t for name, t in get_type_hints(cls).items()})
        else:
            hints[f.name] = get_type_hints(AlgorithmSettings)[f.name]
    return {name: hints[name] for name in FIELDS}


def flatten(settings: AlgorithmSettings) -> dict:
    """The flat ``{field: value}`` view (:data:`FIELDS`) of ``settings``."""
    out = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name in _NESTED:
            prefix = _NESTED[f.name][1]
            out.update({prefix + g.name: getattr(value, g.name) for g in fields(value)})
        else:
            out[f.name] = value
    return out


def from_values(values: Mapping[str, Any]) -> AlgorithmSettings:
    """:class:`AlgorithmSettings` from a flat ``{field: value}`` of every field in :data:`FIELDS` (a missing or
    unknown field is an error naming it; the readers have already named their YAML key for a missing one)."""
    missing, unknown = [k for k in FIELDS if k not in values], [k for k in values if k not in FIELDS]
    if missing or unknown:
        raise ValueError(f"AlgorithmSettings: missing fields {missing}, unknown fields {unknown}")
    nested = {name: cls(**{g.name: values[prefix + g.name] for g in fields(cls)})
              for name, (cls, prefix) in _NESTED.items()}
    plain = {f.name: values[f.name] for f in fields(AlgorithmSettings) if f.name not in _NESTED}
    return AlgorithmSettings(**plain, **nested)


# ---- the rules (shared by both validators) -----------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def problems(values: Mapping[str, Any], max_new_tokens: Optional[int] = None) -> list:
    """``(field, message)`` for every value of ``values`` (any subset of :data:`FIELDS`) that cannot train; the
    message follows ``<key> = <value>`` in the validators' output. ``max_new_tokens``: the generation cap, which
    ``overlong.l_max: null`` stands for (None: a null l_max bounds nothing)."""
    out = []
    _loss_problems(values, out)
    _sampling_problems(values, out)
    _overlong_problems(values, out, max_new_tokens)
    return out


def _checker(values: Mapping[str, Any], out: list):
    """check(name, ok, message): appends (name, message) when ``values`` has ``name`` and ``ok`` rejects it."""
    def check(name, ok, message):
        if name in values and not ok(values[name]):
            out.append((name, message))
    return check


def _loss_problems(values: Mapping[str, Any], out: list) -> None:
    """The loss's keys: group size, clip, aggregation, importance weights, advantage epsilon."""
    check = _checker(values, out)
    check("group_size", lambda v: _is_int(v) and v >= 2,
          "must be an integer >= 2: with 1 response per prompt every group advantage is 0 and nothing trains "
          "(fix: 16, the paper's G)")
    check("eps_low", lambda v: _is_num(v) and 0 <= v < 1, "must be in [0, 1) (paper: 0.2)")
    check("eps_high", lambda v: _is_num(v) and v >= 0, "must be >= 0 (paper: 0.28; = eps_low is the symmetric clip)")
    check("clip_c", lambda v: v is None or (_is_num(v) and v > 1),
          "(dual clip) must be > 1, or null to disable it (reference: 10.0)")
    check("agg", lambda v: v in AGG_MODES, f"is not one of {AGG_MODES} (DAPO: token-mean)")
    check("tis_cap", lambda v: v is None or (_is_num(v) and v > 0),
          "must be > 0, or null to disable truncated importance sampling")
    check("tis_level", lambda v: v in TIS_LEVELS, f"is not one of {TIS_LEVELS} (token: each token's own weight)")
    if values.get("tis_level") == "sequence" and "tis_cap" in values and values["tis_cap"] is None:
        out.append(("tis_level", "weights nothing without tis_cap: the sequence-level weight is truncated at it "
                                 "(fix: tis_cap=2.0, or tis_level=token)"))
    check("reject_logp_diff", lambda v: v is None or (_is_num(v) and v > 0),
          "must be > 0, or null to keep every response (docs/async.md measured 0.05 and 0.1)")
    if values.get("reject_logp_diff") is not None and "tis_cap" in values and values["tis_cap"] is None:
        out.append(("reject_logp_diff", "needs tis_cap: it reads the sampler's log-probs, which a step keeps for "
                                        "truncated importance sampling (fix: tis_cap=2.0, or reject_logp_diff=null)"))
    check("adv_eps", lambda v: _is_num(v) and v > 0, "is out of range: it must be > 0 (a small epsilon, 1e-6)")


def _sampling_problems(values: Mapping[str, Any], out: list) -> None:
    """The switches and dynamic sampling's keys (over-sampling, carry-over, prompt skipping)."""
    check = _checker(values, out)
    for name in ("overlong_filter", "scale_by_std", "dynamic_sampling.enabled", "dynamic_sampling.adaptive",
                 "dynamic_sampling.skip_history.enabled", "overlong.enabled"):
        check(name, lambda v: isinstance(v, bool), "must be true or false")
    ds = "dynamic_sampling."
    check(ds + "max_gen_batches", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1 (reference: 10)")
    check(ds + "on_budget_exhausted", lambda v: v in BUDGET_POLICIES, f"is not one of {BUDGET_POLICIES}")
    check(ds + "max_age", lambda v: _is_int(v) and v >= 0,
          "must be an integer >= 0 (0 discards surplus groups like the reference)")
    for name in ("gen_batch_size", "max_gen_batch_size"):
        check(ds + name, lambda v: v is None or (_is_int(v) and v >= 1), "must be an integer >= 1 or null")
    gen, cap = values.get(ds + "gen_batch_size"), values.get(ds + "max_gen_batch_size")
    if _is_int(gen) and _is_int(cap) and gen > cap:
        check(ds + "max_gen_batch_size", lambda v: False,
              f"is below gen_batch_size={gen}: the bound would not hold (the fixed size wins). Fix: raise it, or "
              "lower gen_batch_size")
    check(ds + "prior_pass_rate", lambda v: _is_num(v) and 0 < v < 1, "is out of range: it must be in (0, 1)")
    check(ds + "prior_weight", lambda v: _is_num(v) and v > 0, "is out of range: it must be > 0 (in groups)")
    check(ds + "pass_rate_memory", lambda v: _is_num(v) and 0 <= v < 1, "is out of range: it must be in [0, 1)")
    check(ds + "safety", lambda v: _is_num(v) and v >= 1,
          "is out of range: it must be >= 1 (the over-draw factor on the estimated need)")
    sh = ds + "skip_history."
    check(sh + "skip_prob", lambda v: _is_num(v) and 0 <= v < 1,
          "is out of range: it must be in [0, 1) (the skip probability after one uninformative group; 0 "
          "never skips)")
    check(sh + "max_skips", lambda v: _is_int(v) and 1 <= v <= MAX_SKIPS,
          f"must be an integer in [1, {MAX_SKIPS}]: the skips in a row after which a prompt is generated again, so "
          f"every prompt is generated at least once every max_skips + 1 epochs (a larger value would skip it for "
          "the whole run)")


def _overlong_problems(values: Mapping[str, Any], out: list, max_new_tokens: Optional[int]) -> None:
    """Overlong reward shaping's keys; l_cache must fit below l_max (null: ``max_new_tokens``)."""
    check = _checker(values, out)
    ov = "overlong."
    check(ov + "penalty_factor", lambda v: _is_num(v) and v >= 0, "is out of range: it must be >= 0")
    check(ov + "l_max", lambda v: v is None or (_is_int(v) and v >= 1), "must be an integer >= 1 or null")
    if values.get(ov + "enabled", True):
        l_max = values.get(ov + "l_max")
        l_max = max_new_tokens if l_max is None else l_max
        bound = l_max if _is_int(l_max) else math.inf
        check(ov + "l_cache", lambda v: _is_int(v) and 0 < v < bound,
              f"must be an integer in (0, l_max={l_max}): the buffer before the cap where the soft penalty ramps "
              "(paper: 4096 of 20480)")
        l_cache = values.get(ov + "l_cache")
        if _is_int(max_new_tokens) and _is_int(l_max) and _is_int(l_cache) and l_max - l_cache >= max_new_tokens:
            check(ov + "l_max", lambda v: False,
                  f"puts the soft penalty's start (l_max - l_cache = {l_max - l_cache}) at or past the generation "
                  f"cap {max_new_tokens}: no response reaches it, so overlong shaping is off. Fix: null (the cap, "
                  "as in the paper)")


def _raise(found: list, where: str) -> None:
    if found:
        raise ValueError("; ".join(f"{where}.{name} {message}" for name, message in found))


# ---- the builder -------------------------------------------------------------------------------------------------
def build_loss(loss: LossSettings, *, max_new_tokens: int):
    """The loss of the block, built once: ``core.loss.DAPOLossFn`` holding ``loss`` as given (a new loss option is a
    field of LossSettings that DAPOLossFn reads; nothing between them copies fields); ``max_new_tokens`` is the
    generation cap, the constant of seq-mean-token-sum-norm."""
    from nemo_dapo.core.loss import DAPOLossFn

    return DAPOLossFn(loss, max_new_tokens=int(max_new_tokens))


def build_loop_parts(a: AlgorithmSettings, *, train_batch_size: int, mini_batch_size: int, ppo_epochs: int,
                     shuffle_minibatches: bool, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                     streaming: bool, on_filler_full: str, fill_order: str) -> tuple:
    """``(LoopSettings, BatchFiller, loss_fn)`` for the step loop (core/loop.DAPOLoop), from the algorithm block
    and each path's batch and rollout keys.

    ``train_batch_size``: prompt groups per rollout step; ``mini_batch_size``: samples per optimizer update; the
    rollout numbers (``max_new_tokens`` the generation cap, temperature, top_p, streaming, on_filler_full,
    fill_order) come from each path's own
    generation keys. The loop and the loss hold the block's sub-settings as they are (no field is renamed)."""
    from nemo_dapo.core.dynamic_sampling import BatchFiller
    from nemo_dapo.core.loop import LoopSettings

    _raise(problems(flatten(a), max_new_tokens), "AlgorithmSettings")
    ds = a.dynamic_sampling
    settings = LoopSettings(group_size=a.group_size, mini_batch_size=int(mini_batch_size),
                            max_new_tokens=int(max_new_tokens), ppo_epochs=int(ppo_epochs),
                            temperature=float(temperature), top_p=float(top_p), adv_eps=float(a.adv_eps),
                            scale_by_std=a.scale_by_std, overlong=a.overlong, skip_history=a.skip_history,
                            shuffle_minibatches=bool(shuffle_minibatches), seed=int(seed), streaming=bool(streaming),
                            on_filler_full=on_filler_full, fill_order=fill_order)
    filler = BatchFiller(int(train_batch_size), enabled=ds.enabled, max_gen_batches=ds.max_gen_batches,
                         on_budget_exhausted=ds.on_budget_exhausted, max_age=ds.max_age,
                         gen_batch_size=ds.gen_batch_size, adaptive=ds.adaptive,
                         max_gen_batch_size=ds.max_gen_batch_size, prior_pass_rate=float(ds.prior_pass_rate),
                         prior_weight=float(ds.prior_weight), pass_rate_memory=float(ds.pass_rate_memory),
                         safety=float(ds.safety))
    return settings, filler, build_loss(a.loss, max_new_tokens=max_new_tokens)
