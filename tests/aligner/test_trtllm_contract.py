"""Contract test: how TRTLLMGenerator drives NeMo-Aligner's GPTGenerateTRTLLM, against a fake that records calls.

TensorRT-LLM cannot run on this machine; tests/gpu/test_aligner_trtllm.py runs the real engine on a GPU. Here the
fakes reproduce, one level below our call, what the real code does (read from the installed NeMo-Aligner 0.7.0,
NeMo 2.1.0 and megatron-core 0.10.0 sources; each test names the lines it relies on, and ``test_the_sources_*``
checks that those lines are still there, parsed, not imported):

* ``FakeGPTGenerateTRTLLM`` = nemo_aligner/utils/trt_llm.py: ``refit`` builds on the first call
  (``self.trt_llm_exporter.build(..., tokenizer=self.tokenizer, ...)``) and calls ``exporter.refit`` after;
  ``free`` unloads only with ``unload_engine_train``; ``generate`` draws per-sample seeds from ``rng_generator`` and
  runs ``tensorrt_llm_worker_context.decoder.generate`` (None once unloaded), static batches, rows = prompt +
  response padded with EOS, lengths including the prompt.
* ``FakeExporter`` = nemo/export/tensorrt_llm.py (mcore path): ``build`` gathers weights through
  ``self.gather_and_reshard_model``, imports ``TRTLLMHelper`` from its module at call time and asks it for the
  engine config with ``vocab_size=self.tokenizer.vocab_size``; ``refit`` reloads an unloaded engine
  (``load_distributed``) and converts with ``tokenizer_vocab_size=self.tokenizer.vocab_size``.
* ``FakeHelper`` = megatron/core/export/trtllm/trtllm_helper.py + the on-device converter: the vocabulary is split
  with ``divide(vocab, tp)`` (asserts), the LLaMA config gets ``bias`` = ``add_bias_linear`` and LLaMAConfig's
  defaults ``attn_bias = mlp_bias = False``; an engine without ``attn_bias`` has no QKV bias to load (silently
  dropped), one with it requires the output-projection bias too (TensorRT-LLM's load: "Required but not provided").
* ``FakeSamplingConfig`` = tensorrt_llm.runtime.SamplingConfig: ``update`` takes only its own field names
  (``SAMPLING_CONFIG_FIELDS``; the real one silently returns unknown keys, the fake refuses them).
"""
import ast
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nemo_dapo.aligner import compat
from nemo_dapo.aligner.generation import TRTLLMGenerator, build_generator, build_trtllm_engine
from tests.aligner._fakes import CharTokenizer
from tests.aligner.conftest import needs_nemo

pytestmark = [needs_nemo, pytest.mark.nemo]
TOK = CharTokenizer()
EOS = TOK.eos_id

# tensorrt_llm/runtime/generation.py, ``@dataclass class SamplingConfig`` (NVIDIA/TensorRT-LLM, stored version at
# commit 2340c776201e4dba9aa625b8615e3e6ca9d7a7f6): the fields a SamplingConfig.update can set.
SAMPLING_CONFIG_FIELDS = frozenset({
    "end_id", "pad_id", "max_new_tokens", "num_beams", "max_attention_window_size", "sink_token_length",
    "output_sequence_lengths", "return_dict", "stop_words_list", "bad_words_list", "temperature", "top_k", "top_p",
    "top_p_decay", "top_p_min", "top_p_reset_ids", "length_penalty", "repetition_penalty", "min_length",
    "presence_penalty", "frequency_penalty", "use_beam_hyps", "beam_search_diversity_rate", "random_seed",
    "output_cum_log_probs", "output_log_probs"})


def _site(*parts) -> str:
    spec = importlib.util.find_spec(parts[0])
    return open(os.path.join(spec.submodule_search_locations[0], *parts[1:])).read()


class FakeSamplingConfig:
    def __init__(self, **fields):
        self.updates = []
        for k, v in fields.items():
            setattr(self, k, v)

    def update(self, **kw):
        unknown = set(kw) - SAMPLING_CONFIG_FIELDS
        assert not unknown, f"tensorrt_llm SamplingConfig has no field(s) {unknown}"
        self.updates.append(kw)
        for k, v in kw.items():
            setattr(self, k, v)


class FakeHelper:
    """megatron-core's TRTLLMHelper as NeMo's build uses it (constructor + the on-device config/weights call)."""

    built = []  # (config, state dict) per get_trtllm_pretrained_config_and_model_weights call
    tp_size = 1  # what the real converter reads from megatron's parallel_state

    def __init__(self, transformer_config=None, **kwargs):
        self.transformer_config = transformer_config

    def get_trtllm_pretrained_config_and_model_weights(self, model_state_dict, dtype, export_config=None,
                                                       on_device_distributed_conversion=False, vocab_size=None,
                                                       gpus_per_node=None, state_dict_split_by_layer_numbers=True):
        assert on_device_distributed_conversion and vocab_size is not None
        tp_size = FakeHelper.tp_size
        assert vocab_size % tp_size == 0, f"{vocab_size} is not divisible by {tp_size}"  # megatron.core.utils.divide
        config = SimpleNamespace(vocab_size=vocab_size, bias=self.transformer_config.add_bias_linear,
                                 attn_bias=False, mlp_bias=False)
        FakeHelper.built.append((config, model_state_dict))
        return [dict(model_state_dict)], [config]


class FakeExporter:
    """NeMo 2.1's TensorRTLLM exporter: build / refit / unload_engine as GPTGenerateTRTLLM calls them."""

    def __init__(self, tp: int):
        self.tp, self.calls, self.decoder, self.engine_config = tp, [], None, None

    def gather_and_reshard_model(self, model_config, model, storage_dtype):
        """A two-layer model's state dict (megatron names), with QKV bias when the model has it."""
        state = {"embedding.word_embeddings.weight": torch.zeros(512, 8)}
        for i in range(2):
            state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.ones(24, 8)
            if model_config.get("qkv_bias"):
                state[f"decoder.layers.{i}.self_attention.linear_qkv.bias"] = torch.ones(24)
        return state

    def _load(self, state):
        c = self.engine_config
        for i in range(2):
            has_qkv = f"decoder.layers.{i}.self_attention.linear_qkv.bias" in state
            has_dense = f"decoder.layers.{i}.self_attention.linear_proj.bias" in state
            if c.attn_bias:
                assert has_qkv and has_dense, f"Required but not provided tensors: layer {i} attention biases"
            elif has_qkv:
                self.calls.append(("qkv bias dropped", i))
        self.state = state

    def build(self, model, model_config, model_type, gpus_per_node, tokenizer, max_input_len, max_output_len,
              max_batch_size, use_refit, reshard_model):
        self.tokenizer = tokenizer  # nemo_file.build_tokenizer returns a non-TokenizerSpec unchanged
        state = self.gather_and_reshard_model(model_config, model, torch.float32)
        from megatron.core.export.trtllm.trtllm_helper import TRTLLMHelper  # at call time, as NeMo's build

        FakeHelper.tp_size = self.tp
        helper = TRTLLMHelper(transformer_config=SimpleNamespace(add_bias_linear=model_config.get("bias")))
        _, configs = helper.get_trtllm_pretrained_config_and_model_weights(
            model_state_dict=state, dtype="float32", state_dict_split_by_layer_numbers=True,
            on_device_distributed_conversion=True, vocab_size=self.tokenizer.vocab_size, gpus_per_node=1)
        self.engine_config = configs[0]
        self._load(state)
        self.decoder = "runner"
        self.calls.append(("build", model))

    def refit(self, model, model_config):
        state = self.gather_and_reshard_model(model_config, model, torch.float32)
        assert self.tokenizer.vocab_size % self.tp == 0, "divide(tokenizer_vocab_size, tp)"
        if self.decoder is None:  # load_distributed: reload the engine file
            self.decoder = "runner"
            self.calls.append(("load_distributed",))
        self._load(state)
        self.calls.append(("refit", model))

    def unload_engine(self):
        self.decoder = None
        self.calls.append(("unload",))


class FakeGPTGenerateTRTLLM:
    """Records refit / generate / free calls and answers like the real GPTGenerateTRTLLM."""

    def __init__(self, max_generation_length=6, max_input_len=12, generation_batch_size=4, *, tokenizer=TOK,
                 tp=1, top_k=0, unload_engine_train=False, honour_bad_words=True):
        self.max_generation_length, self.max_input_len = max_generation_length, max_input_len
        self.generation_batch_size, self.unload_engine_train = generation_batch_size, unload_engine_train
        self.tokenizer, self.honour_bad_words = tokenizer, honour_bad_words
        self.sampling_config = FakeSamplingConfig(temperature=1.0, top_k=top_k, top_p=1.0,
                                                  max_new_tokens=max_generation_length)
        self.rng_generator = torch.Generator().manual_seed(123)
        self.trt_llm_exporter = FakeExporter(tp)
        self._compiled = False
        self.calls = []
        self.expected = []  # per generate call: the response (without prompt) of every row
        self.seen = []  # per generate call: (temperature, top_k, top_p) the engine sampled with

    def refit(self, model):
        self.calls.append(("refit", model))
        if not self._compiled:
            self.trt_llm_exporter.build(model=model, model_config=self.model_cfg, model_type="llama", gpus_per_node=1,
                                        tokenizer=self.tokenizer, max_input_len=self.max_input_len,
                                        max_output_len=self.max_generation_length,
                                        max_batch_size=self.generation_batch_size, use_refit=True,
                                        reshard_model=False)
            self._compiled = True
        else:
            self.trt_llm_exporter.refit(model, self.model_cfg)

    def free(self):
        self.calls.append(("free",))
        if self.unload_engine_train:
            self.trt_llm_exporter.unload_engine()

    def _allowed_ids(self):
        vocab = self.trt_llm_exporter.engine_config.vocab_size
        allowed = set(range(40, 120)) | set(range(vocab - 8, vocab))  # the top ids: padding rows, if any
        banned = self.sampling_config.__dict__.get("bad_words_list")
        if banned is not None and self.honour_bad_words:
            ids, offsets = banned[0]
            allowed -= {int(i) for i, o, prev in zip(ids, offsets, [0, *offsets[:-1]]) if o - prev == 1}
        return sorted(allowed)

    def generate(self, inputs):
        if self.trt_llm_exporter.decoder is None:  # tensorrt_llm_worker_context.decoder.generate after unload
            raise AttributeError("'NoneType' object has no attribute 'generate'")
        tokens, lengths = inputs
        self.calls.append(("generate", tokens.clone(), lengths.clone()))
        assert tokens.shape[0] == self.generation_batch_size, "TRT-LLM engines take static batches"
        sc = self.sampling_config
        self.seen.append((sc.temperature, sc.top_k, sc.top_p))
        seeds = torch.randint(0, 2 ** 32, (tokens.shape[0],), dtype=torch.long, generator=self.rng_generator)
        cap, allowed = sc.max_new_tokens, torch.tensor(self._allowed_ids())
        rows, responses = [], []
        for b in range(tokens.shape[0]):
            g = torch.Generator().manual_seed(int(seeds[b]))
            n = int(torch.randint(1, cap + 1, (1,), generator=g))
            resp = allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist()
            if n < cap or int(seeds[b]) % 2:  # ended with EOS (an EOS at the cap also counts as ended)
                resp[-1] = EOS
            responses.append(resp)
            rows.append(tokens[b, :lengths[b]].tolist() + resp)
        width = max(len(r) for r in rows)
        out = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])  # the real one maps its pad id to EOS
        self.expected.append(responses)
        return {"response_tokens": out, "response_lengths": torch.tensor([len(r) for r in rows])}


class FakeActor:
    """Every key the generators read strictly, with conf/gpt_dapo_actor.yaml's values except: a dense model without
    biases (bias/qkv_bias: a checkpoint's keys), sizes for the fakes, no end strings, and reshard False (the YAML's
    True needs megatron's parallel state; the reshard tests pass it)."""

    def __init__(self, tokenizer=TOK, model=None, **trt):
        model = dict(model or {})
        trt_llm = dict({"enable": True, "reshard": False, "max_input_len": 26, "seed": 1, "model_type": "llama",
                        "unload_engine_train": False, "model_dir": "/tmp/trt_llm_model"}, **trt)
        self.cfg = OmegaConf.create(dict({"encoder_seq_length": 32, "seed": 1, "hidden_size": 8, "bias": False,
                                          "qkv_bias": False, "dapo": {
            "length_params": {"max_length": 6},
            "sampling_params": {"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                "repetition_penalty": 1.0, "end_strings": []},
            "rollout_micro_batch_size": 4, "trt_llm": trt_llm}}, **model))
        self.tokenizer, self.model, self.training = tokenizer, SimpleNamespace(name="mcore model"), False
        self._sampling_params = {"end_strings": []}
        self.calls = []

    def prepare_for_inference(self):
        self.calls.append("prepare_for_inference")

    def finish_inference(self):
        self.calls.append("finish_inference")

    def eval(self):
        pass


def _engine(actor, **kw):
    engine = FakeGPTGenerateTRTLLM(tp=int(actor.cfg.get("tensor_model_parallel_size", 1)), **kw)
    engine.model_cfg = actor.cfg
    return engine


@pytest.fixture(autouse=True)
def fake_helper(monkeypatch):
    """megatron.core.export.trtllm.trtllm_helper (which imports tensorrt_llm) as a module holding FakeHelper."""
    import sys
    import types

    import megatron.core.export.trtllm as package

    module = types.ModuleType("megatron.core.export.trtllm.trtllm_helper")
    module.TRTLLMHelper = FakeHelper
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(package, "trtllm_helper", module, raising=False)
    FakeHelper.built = []
    return module


def _prompts(texts):
    ids = [TOK.text_to_ids(t) for t in texts]
    width = max(len(x) for x in ids)
    prompt_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    return prompt_ids, (prompt_ids != 0).long(), ids


def _names(engine):
    return [c[0] for c in engine.calls]


def test_engine_is_built_once_and_refit_once_per_weight_update():
    actor = FakeActor()
    engine = _engine(actor)
    gen = TRTLLMGenerator(actor, engine)
    ids, mask, _ = _prompts(["ab", "cde"])
    gen.generate(ids, mask, max_new_tokens=6, seed=1)
    gen.generate(ids, mask, max_new_tokens=6, seed=2)  # same weights: no refit
    gen.update_weights(policy=None)
    gen.update_weights(policy=None)  # two updates before the next generation: one refit
    gen.generate(ids, mask, max_new_tokens=6, seed=3)
    assert _names(engine) == ["refit", "generate", "free", "generate", "free", "refit", "generate", "free"]
    assert engine.calls[0][1] is actor.model  # refit reads the actor's Megatron model
    assert [c[0] for c in engine.trt_llm_exporter.calls] == ["build", "refit"]
    assert actor.calls == ["prepare_for_inference", "finish_inference"] * 3


def test_prompts_go_in_right_padded_in_static_batches_and_responses_come_back_in_core_layout():
    actor = FakeActor()
    engine = _engine(actor, generation_batch_size=4)
    texts = ["ab", "cdefg", "h", "ijk", "lmnop", "qr"]  # 6 prompts: batches of 4 + 2 (padded to 4)
    ids, mask, real = _prompts(texts)
    out = TRTLLMGenerator(actor, engine).generate(ids, mask, max_new_tokens=5, temperature=0.7, top_p=0.9, seed=7)
    sent = [c for c in engine.calls if c[0] == "generate"]
    assert len(sent) == 2 and all(c[1].shape[0] == 4 for c in sent)
    rows = torch.cat([c[1] for c in sent])[:6]
    lengths = torch.cat([c[2] for c in sent])[:6]
    for b, x in enumerate(real):
        assert lengths[b] == len(x) and rows[b, :len(x)].tolist() == x
    expected = [r for call in engine.expected for r in call][:6]
    for b, resp in enumerate(expected):
        n = int(out.response_mask[b].sum())
        assert out.response_ids[b, :n].tolist() == resp
        assert bool(out.truncated[b]) == (resp[-1] != EOS)
    assert out.response_ids.shape[0] == 6 and out.logprobs is None
    assert engine.seen == [(0.7, 0, 0.9)] * 2 and engine.sampling_config.max_new_tokens == 5


def test_seed_makes_generation_reproducible():
    ids, mask, _ = _prompts(["ab", "cd", "ef"])

    def run(seed):
        actor = FakeActor()
        return TRTLLMGenerator(actor, _engine(actor)).generate(ids, mask, max_new_tokens=6, seed=seed)

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("configured_top_k", [0, 5])
def test_greedy_sets_top_k_1_for_that_call_only(configured_top_k):
    """GPTGenerateTRTLLM keeps ONE SamplingConfig for all calls (trt_llm.py: ``self.sampling_config =
    tensorrt_llm.runtime.SamplingConfig(..., top_k=sample_top_k, ...)``, read by every ``_generate``), so a greedy
    call's top_k=1 stays unless the next call sets top_k back to the configured value."""
    actor = FakeActor()
    engine = _engine(actor, top_k=configured_top_k)
    gen = TRTLLMGenerator(actor, engine)
    ids, mask, _ = _prompts(["ab"])
    gen.generate(ids, mask, max_new_tokens=3, temperature=0.0, seed=1)
    gen.generate(ids, mask, max_new_tokens=3, temperature=0.8, top_p=0.95, seed=1)
    gen.generate(ids, mask, max_new_tokens=3, temperature=0.0, seed=1)
    assert engine.seen == [(1.0, 1, 1.0), (0.8, configured_top_k, 0.95), (1.0, 1, 1.0)]


def test_vocabulary_is_padded_to_the_tp_size_and_padding_ids_are_never_emitted():
    """Relies on nemo/export/tensorrt_llm.py ``build``: ``self.tokenizer = build_tokenizer(tokenizer)`` and
    ``vocab_size=self.tokenizer.vocab_size`` (refit: ``tokenizer_vocab_size=self.tokenizer.vocab_size``), with the
    tokenizer GPTGenerateTRTLLM.refit passes (``tokenizer=self.tokenizer``); megatron-core's
    distributed_trtllm_model_weights_converter.py ``_get_remove_vocab_padding`` splits that size with
    ``VocabUtility.vocab_range_from_global_vocab_size(tokenizer_vocab_size, self.tp_rank, self.inference_tp_size)``
    -> ``divide`` (asserts). V = 253 at TP 8 stands for Qwen2.5's 151,665."""
    tok = SimpleNamespace(**{k: getattr(TOK, k) for k in ("bos_id", "eos_id", "pad_id", "text_to_ids",
                                                          "ids_to_text")}, vocab_size=253)
    actor = FakeActor(tokenizer=tok, model={"tensor_model_parallel_size": 8})
    engine = _engine(actor, tokenizer=tok, generation_batch_size=8)
    out = TRTLLMGenerator(actor, engine).generate(*_prompts(["ab"] * 64)[:2], max_new_tokens=6, seed=3)
    assert engine.trt_llm_exporter.engine_config.vocab_size == 256
    assert engine.trt_llm_exporter.tokenizer.eos_id == EOS  # everything else is the real tokenizer
    banned = engine.sampling_config.bad_words_list
    assert banned.shape == (8, 2, 3) and banned.dtype == np.int32
    assert banned[0].tolist() == [[253, 254, 255], [1, 2, 3]]
    emitted = {i for call in engine.expected for r in call for i in r}
    assert emitted & set(range(248, 253)) and not emitted & {253, 254, 255}  # top ids, but no padding
    assert int(out.response_ids.max()) < 253

    # without the ban (the engine ignoring it) an id >= V is cut off, never clamped into a token
    actor = FakeActor(tokenizer=tok, model={"tensor_model_parallel_size": 8})
    engine = _engine(actor, tokenizer=tok, generation_batch_size=8, honour_bad_words=False)
    out = TRTLLMGenerator(actor, engine).generate(*_prompts(["ab"] * 64)[:2], max_new_tokens=6, seed=3)
    hit = 0
    for b, resp in enumerate(r for call in engine.expected for r in call):
        cut = next((j for j, i in enumerate(resp) if i >= 253), None)
        n = int(out.response_mask[b].sum())
        if cut is not None:
            hit += 1
            assert n == cut and bool(out.truncated[b]), (resp, out.response_ids[b])
        assert out.response_ids[b, :n].tolist() == resp[:n]
    assert hit > 0 and int((out.response_ids * out.response_mask.long()).max()) < 253


def test_vocabulary_needs_the_padding_at_tp_8():
    """Without the padding the build asserts exactly as megatron-core's ``divide`` does (the fake's helper)."""
    tok = SimpleNamespace(eos_id=EOS, vocab_size=253)
    actor = FakeActor(tokenizer=tok, model={"tensor_model_parallel_size": 8})
    engine = _engine(actor, tokenizer=tok)
    with pytest.raises(AssertionError, match="253 is not divisible by 8"):
        engine.refit(actor.model)


def test_qkv_bias_reaches_the_engine_as_attn_bias_with_a_zero_output_bias(fake_helper):
    """Relies on nemo/export/tensorrt_llm.py ``build``: ``from megatron.core.export.trtllm.trtllm_helper import
    TRTLLMHelper`` inside the method and ``self.trtllm_helper.get_trtllm_pretrained_config_and_model_weights(``;
    megatron-core trtllm_helper.py ``_get_trtllm_config``: ``'bias': self.transformer_config.add_bias_linear`` is
    the only bias key (LLaMAConfig's own fields are ``attn_bias`` / ``mlp_bias``, default False); NeMo's exporter
    gathers through ``self.gather_and_reshard_model(model_config, model, storage_dtype)``."""
    ids, mask, _ = _prompts(["ab"])
    # today's behaviour, without the override: the engine has no attention bias and the QKV bias is dropped
    actor = FakeActor(model={"qkv_bias": True, "bias": False})
    engine = _engine(actor)
    engine.refit(actor.model)
    assert engine.trt_llm_exporter.engine_config.attn_bias is False
    assert ("qkv bias dropped", 0) in engine.trt_llm_exporter.calls

    actor = FakeActor(model={"qkv_bias": True, "bias": False})
    engine = _engine(actor)
    gen = TRTLLMGenerator(actor, engine)
    gen.generate(ids, mask, max_new_tokens=3, seed=1)
    gen.update_weights(None)
    gen.generate(ids, mask, max_new_tokens=3, seed=1)  # refit: the zero output bias again
    config, state = FakeHelper.built[-1]
    assert (config.attn_bias, config.mlp_bias, config.bias) == (True, False, False)
    for i in range(2):
        assert torch.equal(state[f"decoder.layers.{i}.self_attention.linear_proj.bias"], torch.zeros(8))
    assert [c[0] for c in engine.trt_llm_exporter.calls] == ["build", "refit"]
    assert "qkv bias dropped" not in {c[0] for c in engine.trt_llm_exporter.calls}
    assert fake_helper.TRTLLMHelper is FakeHelper  # the subclass lives only for the build

    actor = FakeActor(model={"qkv_bias": False, "bias": False})  # dense without bias: no override, no extra keys
    engine = _engine(actor)
    TRTLLMGenerator(actor, engine).generate(ids, mask, max_new_tokens=3, seed=1)
    config, state = FakeHelper.built[-1]
    assert config.attn_bias is False and not any(k.endswith("bias") for k in state)

    with pytest.raises(ValueError, match="model_type: llama"):
        TRTLLMGenerator(FakeActor(model={"qkv_bias": True}, model_type="gptnext"), _engine(actor))


def test_unloaded_engine_is_reloaded_and_refit_by_the_next_call():
    """Relies on nemo_aligner/utils/trt_llm.py ``free``: ``self.trt_llm_exporter.unload_engine()`` with
    ``unload_engine_train``; nemo/export/trt_llm/tensorrt_llm_run.py ``unload_engine``:
    ``tensorrt_llm_worker_context.decoder = None`` (``_generate`` then calls ``decoder.generate``); NeMo's
    ``TensorRTLLM.refit`` calls ``load_distributed(...)``, which reloads when the decoder is not a ModelRunner, then
    ``refit(weights_dict)``."""
    ids, mask, _ = _prompts(["ab", "cd"])
    actor = FakeActor(unload_engine_train=True)
    engine = _engine(actor, unload_engine_train=True)
    gen = TRTLLMGenerator(actor, engine)
    for seed in (1, 2, 3):  # no weight update in between: the reload alone makes the refit necessary
        gen.generate(ids, mask, max_new_tokens=4, seed=seed)
    assert _names(engine) == ["refit", "generate", "free"] * 3
    assert [c[0] for c in engine.trt_llm_exporter.calls] == [
        "build", "unload", "load_distributed", "refit", "unload", "load_distributed", "refit", "unload"]

    # the defect: a generator that trusts the engine to stay loaded dereferences the freed session
    stale = TRTLLMGenerator(FakeActor(unload_engine_train=True), _engine(actor, unload_engine_train=True))
    stale.generate(ids, mask, max_new_tokens=4, seed=1)
    stale._stale = False
    with pytest.raises(AttributeError, match="NoneType"):
        stale.generate(ids, mask, max_new_tokens=4, seed=2)


def test_a_config_without_bias_keys_gets_nemo_defaults():
    # NeMo 2.1 builds linear biases when the model config lacks ``bias`` (megatron_base_model.py:
    # ``add_bias_linear = self.cfg.get('bias', True)``) and no QKV bias without ``qkv_bias``; the engine must keep
    # what NeMo built (the old code default bias=False dropped those biases from the engine)
    from nemo_dapo.aligner.legacy_export import attention_bias_overrides

    assert attention_bias_overrides(OmegaConf.create({}), "llama") == {"attn_bias": True, "mlp_bias": True}
    assert attention_bias_overrides(OmegaConf.create({"bias": False}), "llama") == {}


@pytest.mark.parametrize("drop", ["dapo.trt_llm.enable", "dapo.trt_llm.reshard", "dapo.rollout_micro_batch_size",
                                  "dapo.sampling_params.end_strings", "dapo.sampling_params.top_k",
                                  "dapo.trt_llm.model_dir"])
def test_a_missing_yaml_key_is_an_error_naming_it(drop, monkeypatch):
    """No code default for a key of conf/gpt_dapo_actor.yaml (the old defaults of enable, reshard, end_strings and
    rollout_micro_batch_size disagreed with the YAML's)."""
    from nemo_dapo.cluster.config_validate import ConfigError

    monkeypatch.setattr(compat, "trtllm_generator_class", lambda: lambda **kw: pytest.fail(f"built with {kw}"))
    actor = FakeActor()
    parent, _, leaf = drop.rpartition(".")
    del OmegaConf.select(actor.cfg, parent)[leaf]
    with pytest.raises(ConfigError, match=rf"model\.{drop.replace('.', '[.]')} is missing.*gpt_dapo_actor\.yaml"):
        if drop.endswith("enable"):
            build_generator(actor)
        else:
            build_trtllm_engine(actor)


def test_moe_models_are_refused_with_the_engine_that_can_refit_them():
    actor = FakeActor(model={"num_moe_experts": 8, "expert_model_parallel_size": 2})
    with pytest.raises(NotImplementedError, match="rollout_engine: trtllm"):
        TRTLLMGenerator(actor, _engine(FakeActor()))
    with pytest.raises(NotImplementedError, match="num_moe_experts=8"):
        build_generator(actor)


def test_limits_are_checked_with_the_key_to_change():
    actor = FakeActor()
    gen = TRTLLMGenerator(actor, _engine(actor, max_input_len=3))
    ids, mask, _ = _prompts(["abcd"])
    with pytest.raises(ValueError, match="max_input_len"):
        gen.generate(ids, mask, max_new_tokens=3)
    ids, mask, _ = _prompts(["ab"])
    with pytest.raises(ValueError, match="length_params.max_length"):
        gen.generate(ids, mask, max_new_tokens=7)


def test_refit_gather_replaces_the_exporter_gather():
    actor = FakeActor()
    engine = _engine(actor)

    def custom(model_config, model, storage_dtype):
        return {}

    TRTLLMGenerator(actor, engine, refit_gather=custom)
    assert engine.trt_llm_exporter.gather_and_reshard_model is custom


def test_reshard_splits_prompts_over_pipeline_stages(monkeypatch):
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group", lambda: "pp-group")
    gen = TRTLLMGenerator(FakeActor(), _engine(FakeActor()), reshard=True)
    shares = []
    for r in (0, 1):
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda r=r: r)
        rows, group = gen._my_rows(5)
        shares.append(rows)
        assert group == "pp-group"
    assert shares == [[0, 1], [2, 3, 4]]
    assert TRTLLMGenerator(FakeActor(), _engine(FakeActor()), reshard=False)._my_rows(5) == ([0, 1, 2, 3, 4], None)


def _real_init_parameters():
    """Keyword names of the installed NeMo-Aligner GPTGenerateTRTLLM.__init__, read from its source."""
    tree = ast.parse(_site("nemo_aligner", "utils", "trt_llm.py"))
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


@pytest.mark.parametrize("package,path,line", [
    # GPTGenerateTRTLLM: the tokenizer the exporter gets, the engine's single SamplingConfig, unload in free()
    ("nemo_aligner", "utils/trt_llm.py", "tokenizer=self.tokenizer,"),
    ("nemo_aligner", "utils/trt_llm.py", "self.trt_llm_exporter.refit(model, self.model_cfg)"),
    ("nemo_aligner", "utils/trt_llm.py", "self.trt_llm_exporter.unload_engine()"),
    ("nemo_aligner", "utils/trt_llm.py", "sampling_config=self.sampling_config"),
    # NeMo 2.1 exporter: where the vocabulary size and the weights come from, the helper imported at call time
    ("nemo", "export/tensorrt_llm.py", "self.tokenizer = build_tokenizer(tokenizer)"),
    ("nemo", "export/tensorrt_llm.py", "vocab_size=self.tokenizer.vocab_size,"),
    ("nemo", "export/tensorrt_llm.py", "tokenizer_vocab_size=self.tokenizer.vocab_size,"),
    ("nemo", "export/tensorrt_llm.py", "from megatron.core.export.trtllm.trtllm_helper import TRTLLMHelper"),
    ("nemo", "export/tensorrt_llm.py", "self.trtllm_helper.get_trtllm_pretrained_config_and_model_weights("),
    ("nemo", "export/tensorrt_llm.py", "model_state_dict = self.gather_and_reshard_model(model_config, model, "
                                       "storage_dtype)"),
    ("nemo", "export/tensorrt_llm.py", "load_distributed(self.model_dir, self.mp_rank, self.gpus_per_node)"),
    ("nemo", "export/trt_llm/tensorrt_llm_run.py", "tensorrt_llm_worker_context.decoder = None"),
    ("nemo", "export/trt_llm/nemo_ckpt_loader/nemo_file.py",
     "if isinstance(tokenizer, nemo_tokenizers.TokenizerSpec):"),
    # megatron-core 0.10: the divide on the tokenizer's size, the only bias key of the engine config
    ("megatron", "core/export/trtllm/trtllm_weights_converter/distributed_trtllm_model_weights_converter.py",
     "tokenizer_vocab_size, self.tp_rank, self.inference_tp_size"),
    ("megatron", "core/tensor_parallel/utils.py", "per_partition_vocab_size = divide(global_vocab_size, world_size)"),
    ("megatron", "core/export/trtllm/trtllm_helper.py", "'bias': self.transformer_config.add_bias_linear,"),
    ("megatron", "core/export/trtllm/model_to_trllm_mapping/default_conversion_dict.py",
     "'decoder.layers.self_attention.linear_proj.bias': TRTLLMLayers.attention_dense_bias,"),
])
def test_the_sources_the_fakes_copy_still_say_so(package, path, line):
    assert line in _site(package, *path.split("/")), f"{package}/{path} no longer contains {line!r}"


def test_a_response_is_cut_before_its_first_id_outside_the_vocabulary_negative_ids_included():
    from nemo_dapo.aligner.generation import _cut_at_out_of_vocab

    rows = torch.tensor([[5, 6, -1, 7, 8], [5, 9, 10, 7, 8], [5, 6, 7, 8, 11]])
    # row 0: -1 at position 2; row 1: 10 (= V) at 2; row 2: 11 lies past its total length 4, so nothing is cut
    assert _cut_at_out_of_vocab(rows, torch.tensor([5, 5, 4]), 10).tolist() == [2, 2, 4]


def test_responses_longer_than_the_cap_are_cut_to_it():
    from nemo_dapo.aligner.generation import _response_from_rows

    rows = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])  # prompt of 2, then 7 response tokens
    gen = _response_from_rows(rows, torch.tensor([2]), torch.tensor([9]), torch.tensor([False]), max_new_tokens=5,
                              pad_id=0)
    assert gen.response_ids[0][gen.response_mask[0].bool()].tolist() == [3, 4, 5, 6, 7]
    assert bool(gen.truncated[0])


def test_the_legacy_engine_tells_the_actor_which_ids_it_samples(monkeypatch):
    # the log-probs leave out Megatron's padding rows exactly when the engine cannot emit them
    actor = FakeActor()
    monkeypatch.setattr(compat, "trtllm_generator_class", lambda: lambda **kw: _engine(actor))
    actor.valid_vocab = None
    assert isinstance(build_generator(actor), TRTLLMGenerator) and actor.valid_vocab == TOK.vocab_size


def test_the_zero_output_bias_never_replaces_a_real_one():
    from nemo_dapo.aligner.legacy_export import with_zero_dense_bias

    qkv, proj = "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.self_attention.linear_proj.bias"
    real = torch.full((4,), 0.5)
    state = with_zero_dense_bias(lambda *a: {qkv: torch.ones(12), proj: real}, 4)(None, None, None)
    assert state[proj] is real


def test_no_banned_word_list_when_the_vocabulary_needs_no_padding():
    from nemo_dapo.aligner.legacy_export import banned_ids_list

    assert banned_ids_list(256, 256, 4) is None  # an empty [batch, 2, 0] list is not what TensorRT-LLM takes
    assert banned_ids_list(255, 256, 2).tolist() == [[[255], [1]], [[255], [1]]]
