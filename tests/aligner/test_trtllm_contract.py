"""Contract test: how TRTLLMGenerator drives NeMo-Aligner's GPTGenerateTRTLLM, against a fake that records calls.

TensorRT-LLM cannot run on this machine; tests/gpu/test_aligner_trtllm.py runs the real engine on a GPU. Here the
fake reproduces the real class's interface and observable behaviour (static batches of generation_batch_size, rows
returned as prompt + response padded with EOS, total lengths including the prompt, per-sample seeds drawn from
``rng_generator``), and the test checks what our wrapper sends and how it reads the answer. The constructor keywords
our wrapper passes are checked against the installed NeMo-Aligner source (parsed, not imported: importing it needs
TensorRT-LLM).
"""
import ast
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from nemo_dapo.aligner import compat
from nemo_dapo.aligner.generation import TRTLLMGenerator, build_trtllm_engine
from tests.aligner._fakes import CharTokenizer
from tests.aligner.conftest import needs_nemo

pytestmark = [needs_nemo, pytest.mark.nemo]
TOK = CharTokenizer()
EOS = TOK.eos_id


class FakeSamplingConfig:
    def __init__(self):
        self.updates = []

    def update(self, **kw):
        self.updates.append(kw)
        for k, v in kw.items():
            setattr(self, k, v)


class FakeGPTGenerateTRTLLM:
    """Records refit / generate / free calls and answers like the real GPTGenerateTRTLLM."""

    def __init__(self, max_generation_length=6, max_input_len=12, generation_batch_size=4):
        self.max_generation_length, self.max_input_len = max_generation_length, max_input_len
        self.generation_batch_size = generation_batch_size
        self.sampling_config = FakeSamplingConfig()
        self.rng_generator = torch.Generator().manual_seed(123)
        self.trt_llm_exporter = SimpleNamespace(gather_and_reshard_model="exporter's own")
        self.calls = []
        self.expected = []  # per generate call: the response (without prompt) of every row

    def refit(self, model):
        self.calls.append(("refit", model))

    def free(self):
        self.calls.append(("free",))

    def generate(self, inputs):
        tokens, lengths = inputs
        self.calls.append(("generate", tokens.clone(), lengths.clone()))
        assert tokens.shape[0] == self.generation_batch_size, "TRT-LLM engines take static batches"
        seeds = torch.randint(0, 2 ** 32, (tokens.shape[0],), dtype=torch.long, generator=self.rng_generator)
        cap = self.sampling_config.max_new_tokens
        rows, responses = [], []
        for b in range(tokens.shape[0]):
            g = torch.Generator().manual_seed(int(seeds[b]))
            n = int(torch.randint(1, cap + 1, (1,), generator=g))
            resp = torch.randint(40, 120, (n,), generator=g).tolist()
            if n < cap or int(seeds[b]) % 2:  # ended with EOS (an EOS at the cap also counts as ended)
                resp[-1] = EOS
            responses.append(resp)
            rows.append(tokens[b, :lengths[b]].tolist() + resp)
        width = max(len(r) for r in rows)
        out = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])  # the real one maps its pad id to EOS
        self.expected.append(responses)
        return {"response_tokens": out, "response_lengths": torch.tensor([len(r) for r in rows])}


class FakeActor:
    def __init__(self, **trt):
        self.cfg = OmegaConf.create({"encoder_seq_length": 32, "seed": 1, "dapo": {
            "length_params": {"max_length": 6}, "sampling_params": {"temperature": 1.0, "top_p": 1.0,
                                                                    "end_strings": []},
            "rollout_micro_batch_size": 4, "trt_llm": dict({"enable": True}, **trt)}})
        self.tokenizer, self.model, self.training = TOK, SimpleNamespace(name="mcore model"), False
        self._sampling_params = {"end_strings": []}
        self.calls = []

    def prepare_for_inference(self):
        self.calls.append("prepare_for_inference")

    def finish_inference(self):
        self.calls.append("finish_inference")

    def eval(self):
        pass


def _prompts(texts):
    ids = [TOK.text_to_ids(t) for t in texts]
    width = max(len(x) for x in ids)
    prompt_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    return prompt_ids, (prompt_ids != 0).long(), ids


def _names(engine):
    return [c[0] for c in engine.calls]


def test_engine_is_built_once_and_refit_once_per_weight_update():
    engine, actor = FakeGPTGenerateTRTLLM(), FakeActor()
    gen = TRTLLMGenerator(actor, engine)
    ids, mask, _ = _prompts(["ab", "cde"])
    gen.generate(ids, mask, max_new_tokens=6, seed=1)
    gen.generate(ids, mask, max_new_tokens=6, seed=2)  # same weights: no refit
    gen.update_weights(policy=None)
    gen.update_weights(policy=None)  # two updates before the next generation: one refit
    gen.generate(ids, mask, max_new_tokens=6, seed=3)
    assert _names(engine) == ["refit", "generate", "free", "generate", "free", "refit", "generate", "free"]
    assert engine.calls[0][1] is actor.model  # refit reads the actor's Megatron model
    assert actor.calls == ["prepare_for_inference", "finish_inference"] * 3


def test_prompts_go_in_right_padded_in_static_batches_and_responses_come_back_in_core_layout():
    engine, actor = FakeGPTGenerateTRTLLM(generation_batch_size=4), FakeActor()
    texts = ["ab", "cdefg", "h", "ijk", "lmnop", "qr"]  # 6 prompts: batches of 4 + 2 (padded to 4)
    ids, mask, real = _prompts(texts)
    out = TRTLLMGenerator(actor, engine).generate(ids, mask, max_new_tokens=5, temperature=0.7, top_p=0.9, seed=7)
    sent = [c for c in engine.calls if c[0] == "generate"]
    assert len(sent) == 2 and all(c[1].shape[0] == 4 for c in sent)
    rows = torch.cat([c[1] for c in sent])[:6]
    lengths = torch.cat([c[2] for c in sent])[:6]
    for b, x in enumerate(real):
        assert lengths[b] == len(x) and rows[b, :len(x)].tolist() == x
    assert lengths[6:].numel() == 0 or True
    expected = [r for call in engine.expected for r in call][:6]
    for b, resp in enumerate(expected):
        n = int(out.response_mask[b].sum())
        assert out.response_ids[b, :n].tolist() == resp
        assert bool(out.truncated[b]) == (resp[-1] != EOS)
    assert out.response_ids.shape[0] == 6 and out.logprobs is None
    assert engine.sampling_config.temperature == 0.7 and engine.sampling_config.top_p == 0.9
    assert engine.sampling_config.max_new_tokens == 5


def test_seed_makes_generation_reproducible():
    ids, mask, _ = _prompts(["ab", "cd", "ef"])
    a = TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM()).generate(ids, mask, max_new_tokens=6, seed=11)
    b = TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM()).generate(ids, mask, max_new_tokens=6, seed=11)
    c = TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM()).generate(ids, mask, max_new_tokens=6, seed=12)
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)


def test_greedy_maps_to_top_k_1():
    engine = FakeGPTGenerateTRTLLM()
    ids, mask, _ = _prompts(["ab"])
    TRTLLMGenerator(FakeActor(), engine).generate(ids, mask, max_new_tokens=3, temperature=0.0, seed=1)
    assert engine.sampling_config.top_k == 1 and engine.sampling_config.temperature == 1.0


def test_limits_are_checked_with_the_key_to_change():
    gen = TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM(max_input_len=3))
    ids, mask, _ = _prompts(["abcd"])
    with pytest.raises(ValueError, match="max_input_len"):
        gen.generate(ids, mask, max_new_tokens=3)
    ids, mask, _ = _prompts(["ab"])
    with pytest.raises(ValueError, match="length_params.max_length"):
        gen.generate(ids, mask, max_new_tokens=7)


def test_refit_gather_replaces_the_exporter_gather():
    engine = FakeGPTGenerateTRTLLM()

    def expert_aware(model_config, model, storage_dtype):
        return {}

    TRTLLMGenerator(FakeActor(), engine, refit_gather=expert_aware)
    assert engine.trt_llm_exporter.gather_and_reshard_model is expert_aware


def test_reshard_splits_prompts_over_pipeline_stages(monkeypatch):
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: "pp-group")
    gen = TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM(), reshard=True)
    shares = []
    for r in (0, 1):
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda r=r: r)
        rows, group = gen._my_rows(5)
        shares.append(rows)
        assert group == "pp-group"
    assert shares == [[0, 1], [2, 3, 4]]
    assert TRTLLMGenerator(FakeActor(), FakeGPTGenerateTRTLLM(), reshard=False)._my_rows(5) == ([0, 1, 2, 3, 4], None)


def _real_init_parameters():
    """Keyword names of the installed NeMo-Aligner GPTGenerateTRTLLM.__init__, read from its source."""
    spec = importlib.util.find_spec("nemo_aligner")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "trt_llm.py")
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTGenerateTRTLLM")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args[1:]}


def test_engine_is_built_with_keywords_the_installed_nemo_aligner_accepts(monkeypatch):
    accepted = _real_init_parameters()
    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            unknown = set(kwargs) - accepted
            assert not unknown, f"GPTGenerateTRTLLM does not take {unknown}"
            seen.update(kwargs)

    monkeypatch.setattr(compat, "trtllm_generator_class", lambda: Recorder)
    build_trtllm_engine(FakeActor(max_input_len=20, model_type="qwen", reshard=True))
    assert seen["max_generation_length"] == 6 and seen["max_input_len"] == 20 and seen["generation_batch_size"] == 4
    assert seen["trt_model_type"] == "qwen" and seen["reshard_model"] is True and seen["tokenizer"] is TOK


def test_expert_parallel_refit_gathers_through_the_megatron_layer(monkeypatch):
    """With EP > 1 the engine refit reads the Megatron layer's expert-aware buckets, cut for the engine's TP rank."""
    import nemo_dapo.megatron.refit_gather as rg
    from megatron.core import parallel_state as ps
    from nemo_dapo.aligner.generation import build_generator

    seen = {}

    def fake_buckets(model, *, bucket_bytes, infer_tp_size, infer_tp_rank, dtype):
        seen.update(model=model, tp=infer_tp_size, rank=infer_tp_rank, dtype=dtype)
        yield [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", torch.zeros(2))]
        yield [("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", torch.ones(2))]

    monkeypatch.setattr(rg, "iter_refit_buckets", fake_buckets)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)
    actor = FakeActor()
    actor.cfg.expert_model_parallel_size = 4
    engine = FakeGPTGenerateTRTLLM()
    monkeypatch.setattr("nemo_dapo.aligner.generation.build_trtllm_engine", lambda a: engine)
    build_generator(actor)
    gather = engine.trt_llm_exporter.gather_and_reshard_model
    state = gather({"precision": "bf16"}, actor.model, torch.bfloat16)
    assert seen == {"model": actor.model, "tp": 2, "rank": 1, "dtype": torch.bfloat16}
    assert sorted(state) == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                             "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
