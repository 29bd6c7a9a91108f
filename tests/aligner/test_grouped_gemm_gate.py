"""The actor refuses grouped-GEMM experts below TE 1.9 (NeMo-Aligner 0.7.0's image has TE 1.8.0.dev0, where
megatron-core 0.10 would build the legacy GroupedMLP the refit cannot map), before NeMo builds anything. Runs the
real actor class in a NeMo process of its own (tests/support/nemo_cpu.py patches that process)."""
from tests.aligner.conftest import needs_nemo
from tests.support.dist import run_json

SCRIPT = r'''
import json, sys
from types import SimpleNamespace
from tests.support import nemo_cpu  # noqa: F401  (first)
from nemo_dapo.aligner import actor as actor_mod

out = {}
for te, grouped, use_te in [("1.8.0.dev0", True, True), ("1.13.0", True, True), ("1.8.0.dev0", False, True),
                            ("1.8.0.dev0", True, False)]:
    actor_mod.te_version = lambda te=te: te
    fake = SimpleNamespace(transformer_config=SimpleNamespace(moe_grouped_gemm=grouped, qk_layernorm=False),
                           transformer_engine=use_te)
    try:  # past the gate, NeMo's own model_provider_func runs on the stand-in and fails: any other error = passed
        actor_mod.MegatronGPTDAPOActorModel.model_provider_func(fake, True, True)
        out[f"{te} {grouped} {use_te}"] = "built"
    except ValueError as e:
        out[f"{te} {grouped} {use_te}"] = str(e) if "moe_grouped_gemm" in str(e) else "past the gate"
    except Exception:
        out[f"{te} {grouped} {use_te}"] = "past the gate"
print(json.dumps(out))
'''


@needs_nemo
def test_grouped_gemm_is_refused_below_te_1_9():
    out = run_json("-c", SCRIPT)
    refused = out["1.8.0.dev0 True True"]
    assert "needs Transformer Engine >= 1.9 (found 1.8.0.dev0)" in refused and "moe_grouped_gemm=False" in refused
    assert out["1.13.0 True True"] == "past the gate"
    assert out["1.8.0.dev0 False True"] == "past the gate"
    # without TE's spec the validator refuses grouped GEMM already (config_validate._layer_spec); no second check
    assert out["1.8.0.dev0 True False"] == "past the gate"


