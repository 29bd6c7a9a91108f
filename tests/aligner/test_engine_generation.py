"""Engine-server rollouts on the NeMo-Aligner path (aligner/engine_generation.py).

* The row split (pure arithmetic; the rank -> server mapping: test_engine_layout.py).
* End to end on CPU with the real NeMo / NeMo-Aligner stack: two TP ranks train one DAPO rollout step generating
  through a real ``nemo_dapo.engines.server`` process (the local engine, plus a weight dump); the engine's weights
  after the initial push and after the step's update equal the actor's, in Hugging Face names.
"""
import json
import os

import pytest

from nemo_dapo.aligner.engine_generation import split_rows
from nemo_dapo.aligner.engine_layout import EngineLayout
from tests.aligner.conftest import needs_nemo
from tests.support.dist import ROOT, free_port, run_torchrun


def test_server_settings_are_the_yaml_values_and_a_missing_key_is_named():
    from omegaconf import OmegaConf

    from nemo_dapo.cluster.config_load import load_config
    from nemo_dapo.cluster.config_validate import ConfigError
    from nemo_dapo.aligner.engine_generation import SERVER_KEYS, server_settings

    cfg = load_config(None, ["trainer.dapo.engine_server.bucket_mb=64"])
    srv = server_settings(cfg)
    yaml_srv = OmegaConf.load(ROOT / "conf/gpt_dapo_actor.yaml").trainer.dapo.engine_server
    assert {k: srv[k] for k in SERVER_KEYS if k != "bucket_mb"} == {k: yaml_srv[k] for k in SERVER_KEYS
                                                                     if k != "bucket_mb"}
    assert srv["bucket_mb"] == 64 and srv["gpus_per_node"] == cfg.trainer.devices
    del cfg.trainer.dapo.engine_server["sleep_level"]
    with pytest.raises(ConfigError, match=r"trainer\.dapo\.engine_server\.sleep_level is missing"):
        server_settings(cfg)


def test_split_rows_is_contiguous_and_complete():
    for b in range(0, 13):
        for k in range(1, 5):
            parts = split_rows(b, k)
            assert parts[0][0] == 0 and parts[-1][1] == b and len(parts) == k
            assert all(x[1] == y[0] for x, y in zip(parts, parts[1:]))
            assert max(h - lo for lo, h in parts) - min(h - lo for lo, h in parts) <= 1


@needs_nemo
@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.parametrize("layout, mode, steps", [("tp2", "abort", 1), ("tp2", "suspend", 2), ("dp2", "suspend", 2),
                                                 ("dp2_separate", "abort", 1), ("dp2_separate", "overlap", 2),
                                                 ("tp2", "overlap", 2)])
def test_aligner_step_through_a_local_engine_server(tok_dir, tmp_path, layout, mode, steps):
    """tp2: one engine for a TP=2 group (rank 0 owns it); dp2: two data-parallel ranks, an engine each;
    dp2_separate: the same with ``placement: separate``: the engines on TCP addresses (a comma-separated list, one
    per replica) and every refit a gloo broadcast (weight_transport gloo), as on engine nodes of their own.
    overlap: partial rollouts with ``rollout.overlap``: a round runs on the engines while the trainer trains."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import subprocess
    import sys

    from nemo_dapo.engines.client import EngineProcess
    from nemo_dapo.engines.protocol import new_authkey

    # the tiny NeMo GPT of tests/support/nemo_cpu.py as a Hugging Face Llama, randomly initialised: the engine must
    # end up with the actor's weights only through the refit
    tok = AutoTokenizer.from_pretrained(tok_dir)
    hf = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.eos_token_id)
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(hf).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700)  # a key-less engine socket must not be reachable by other users
    engines = 1 if layout == "tp2" else 2
    separate = layout == "dp2_separate"
    addresses = [f"tcp://127.0.0.1:{free_port()}" if separate else f"unix:{sock_dir}/e{i}.sock"
                 for i in range(engines)]
    authkey = new_authkey()  # one key for the job's servers, as the launcher shares it
    procs = []
    for i in range(engines):
        (tmp_path / f"dump{i}").mkdir()
        procs.append(EngineProcess(engine="tests.aligner.workers.engine_dump:DumpingEngine.from_path",
                                   model_dir=str(hf_dir), address=addresses[i],
                                   options={"max_batch_size": 16}, log_path=str(tmp_path / f"engine{i}.log"),
                                   env={"ENGINE_DUMP_DIR": str(tmp_path / f"dump{i}"), "PYTHONPATH": str(ROOT)},
                                   authkey=authkey))
    key = {"NEMO_DAPO_ENGINE_AUTHKEY": os.fsdecode(authkey)}
    try:
        for proc in procs:  # the launcher's health wait (the probe hangs up, so the server accepts the trainer next)
            probe = subprocess.run([sys.executable, "-m", "nemo_dapo.engines.health", "--timeout-s", "180",
                                    "--interval-s", "1", proc.address], capture_output=True, text=True, timeout=240,
                                   env={**os.environ, **key})
            assert probe.returncode == 0 and json.loads(probe.stdout.splitlines()[-1])["weights_ok"], probe.stderr
        run_torchrun(ROOT / "tests/aligner/workers/engine_generation_worker.py", nproc=2, out_dir=tmp_path,
                     env={"TOK_DIR": tok_dir, "HF_DIR": str(hf_dir),
                          "ENGINE_ADDRESS": ",".join(addresses) if separate else f"unix:{sock_dir}/e{{local}}.sock",
                          "ENGINE_DUMP_DIR": str(tmp_path / "dump{rank}"), "ROLLOUT": mode, "STEPS": str(steps),
                          "TP": "2" if layout == "tp2" else "1", "PLACEMENT": "separate" if separate else "colocated",
                          **key})
    finally:
        for proc in procs:
            proc.stop()
    r0 = json.loads((tmp_path / "engine_rank0.json").read_text())
    r1 = json.loads((tmp_path / "engine_rank1.json").read_text())
    if layout == "tp2":
        assert r0["owners"] == r1["owners"] == [0] and r0["owns"] and not r1["owns"]  # one engine, rank 0 sends
    else:
        assert (r0["owners"], r1["owners"]) == ([0], [1]) and r0["owns"] and r1["owns"]  # an engine per DP rank
    for r in (r0, r1)[:engines]:
        for key in ("initial", "after_step"):
            assert r[key]["names_equal"] and r[key]["n"] == 2 + 2 * 9 + 1, r[key]  # embed, 2 x 9, norm, lm_head
            assert r[key]["max_abs_diff"] == 0.0, r[key]
        assert r["updates"] == 1 + steps  # the initial push and one after each step's optimizer updates
        assert (r["last_update"].get("transport") == "group") == separate  # separate: a gloo broadcast, over TCP
    # the actor's log-probs leave Megatron's vocabulary padding out, as the HF-shaped engine does
    assert r0["valid_vocab"] == r1["valid_vocab"] == r0["hf_vocab"] <= r0["padded_vocab"]
    step = next(r for r in r0["records"] if "train/batch_acc" in r or "actor/loss" in r)
    assert step["rollout/trained_tokens"] > 0 and step["actor/grad_norm"] > 0
    assert 0.0 <= step["timing/engine_idle_s"] <= step["timing/step_s"]  # the owner logs its engine's idle time
    # overlap: the round submitted at the full batch is in flight during the first step's update, and no step
    # leaves one behind (the refit and the checkpoint come after its end); the last step draws nothing ahead
    assert any(r0["round_in_flight"][:1]) == any(r1["round_in_flight"][:1]) == (mode == "overlap")
    if mode in ("suspend", "overlap"):  # partial rollouts in rounds: the group left running at step 1 trains at 2
        steps_m = [r for r in r0["records"] if "counters/rollout_steps" in r]
        assert [m["counters/rollout_steps"] for m in steps_m] == [1.0, 2.0]
        assert steps_m[0]["partial/suspended_groups"] >= 1 and steps_m[1]["partial/resumed_groups"] >= 1
        assert steps_m[1]["partial/trained_lag_max"] == 1.0  # tokens of the first weights trained after a refit
        last = steps_m[-1]
        assert last["counters/aborted_tokens"] == 0 and last["partial/stale_tokens"] == 0
        # every generated token was trained or is held for the next step
        assert last["counters/generated_tokens"] == last["counters/trained_tokens"] + last["partial/suspended_tokens"]
        # a checkpoint of the trainer carries the groups still suspended, on every rank
        assert len(r0["saved_suspended"]) == last["partial/suspended_groups"] and r0["saved_suspended"] == \
            r1["saved_suspended"]
        if layout != "tp2":  # both data-parallel ranks hand their filler the same groups: the same counts
            def batch(r):
                return [{k: v for k, v in m.items() if k.split("/")[0] in ("counters", "partial", "filter")}
                        for m in r["records"] if "counters/rollout_steps" in m]
            assert batch(r0) == batch(r1)
    else:
        assert r0["saved_suspended"] is None  # abort keeps no partial state
    assert all(os.path.getsize(tmp_path / f"engine{i}.log") > 0 for i in range(engines))


def test_the_launcher_passes_the_config_to_build_generator():
    # without cfg= build_generator falls back to the legacy engine, whatever trainer.dapo.rollout_engine says
    import ast
    src = open(os.path.join(ROOT, "examples", "train_gpt_dapo.py")).read()
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "build_generator"]
    assert calls and all(any(k.arg == "cfg" for k in c.keywords) for c in calls)


def test_build_generator_follows_the_registry_and_refuses_an_unknown_engine(monkeypatch):
    from omegaconf import OmegaConf

    from nemo_dapo.aligner import engine_generation, generation
    cfg = OmegaConf.create({"trainer": {"dapo": {"rollout_engine": "sglang"}}})
    with pytest.raises(ValueError, match="rollout_engine='sglang'.*engine_registry"):
        generation.build_generator(None, cfg=cfg)
    built = []
    monkeypatch.setattr(engine_generation, "build_engine_generator", lambda actor, c: built.append(c) or "engine")
    for served in ("trtllm", "vllm", "local"):
        cfg.trainer.dapo.rollout_engine = served
        assert generation.build_generator(None, cfg=cfg) == "engine"
    assert len(built) == 3


def test_results_exchange_gives_every_rank_the_owners_parts_in_order(tmp_path):
    # two gloo ranks, no NeMo: each owner's part (different widths, with / without log-probs, 0 rows) reaches
    # both ranks bit for bit, concatenated in owner order and right-padded, as Generation.cat of the parts
    run_torchrun(ROOT / "tests/aligner/workers/results_exchange_worker.py", nproc=2, out_dir=tmp_path)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"exchange_rank{rank}.json").read_text())
        stream = out.pop("stream_requests")
        # stream_requests: the owners' groups on both ranks, keyed in request order, cut-short samples marked
        assert stream["got"] == stream["expected"] and stream["tokens"] == 100 + 101, rank
        assert all(stream["padding_only"]) and len(stream["padding_only"]) == 4
        assert sorted(stream["got"]) == ["10", "11", "12", "14"]  # group 13 had no requests: nothing came back
        assert sorted(out) == ["empty_part", "no_logprobs", "one_owner", "two_owners"]
        for name, case in out.items():
            assert case["got"] == case["expected"], (rank, name)
            assert case["dtypes"] == ["torch.int64", "torch.float32", "torch.bool"], (rank, name)
        assert out["no_logprobs"]["got"]["logprobs"] is None
        assert len(out["two_owners"]["got"]["ids"]) == 5 and len(out["two_owners"]["got"]["ids"][0]) == 7


class _RecordingEngine:
    """An owner's EngineGenerator: records what it was asked for, answers one token per row."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, prompt_mask, **kw):
        import torch

        from nemo_dapo.core.types import Generation

        self.calls.append(dict(kw, rows=prompt_ids[:, -1].tolist()))
        b = prompt_ids.shape[0]
        return Generation(response_ids=prompt_ids[:, -1:].clone(), response_mask=torch.ones(b, 1),
                          truncated=torch.zeros(b, dtype=torch.bool))

    def idle_seconds(self):
        return 0.0


def test_each_owner_generates_its_rows_with_their_budgets_and_a_seed_of_its_own(monkeypatch):
    import torch

    from nemo_dapo.aligner import engine_generation as eg

    monkeypatch.setattr(eg.dist, "get_rank", lambda: 0)
    prompts, mask = torch.arange(5).reshape(5, 1), torch.ones(5, 1)
    budgets = torch.tensor([10, 11, 12, 13, 14])
    seen = {}
    for owners in ([0, 7], [7, 0]):  # this rank is the first, then the second, of two owners
        engine = _RecordingEngine()
        gen = eg.AlignerEngineGenerator(None, engine, owners=owners, mp_group=None, hf_config=None, pad_id=0)
        gen.generate(prompts, mask, max_new_tokens=budgets, seed=123)
        (call,) = engine.calls
        seen[owners.index(0)] = call
    # split_rows(5, 2) = [0, 2), [2, 5): each owner's rows and the per-row budgets of those rows
    assert seen[0]["rows"] == [0, 1] and seen[0]["max_new_tokens"].tolist() == [10, 11]
    assert seen[1]["rows"] == [2, 3, 4] and seen[1]["max_new_tokens"].tolist() == [12, 13, 14]
    # two owners with one seed would sample the same streams for their rows
    assert seen[0]["seed"] != seen[1]["seed"]


def test_a_separate_engine_is_owned_by_the_lowest_rank_of_its_replica(monkeypatch):
    from nemo_dapo.aligner import engine_generation as eg

    monkeypatch.setattr(eg.dist, "get_process_group_ranks", lambda group: [13, 12, 15, 14])
    lay = EngineLayout(world=16, gpus_per_node=8, engine_gpus=4)
    assert eg._engine_owners(lay, "mp-group", True, groups=[]) == [12]


@pytest.mark.parametrize("dtype, torch_dtype, transport", [("bf16", "bfloat16", "shm"), ("fp16", "float16", "gloo"),
                                                        (None, None, "nccl")])
def test_build_engine_generator_wires_the_server_keys_into_the_owners_client(monkeypatch, dtype, torch_dtype,
                                                                            transport):
    # build_engine_generator on rank 1 of a one-node world of 2 GPUs, one engine per GPU, without processes: the
    # client is a recorder, the process groups are answered here; everything between is the real wiring
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as mcore_ps

    from nemo_dapo.aligner import engine_generation as eg
    from nemo_dapo.cluster.config_load import load_config
    from nemo_dapo.engines import client as engine_client

    cfg = load_config(None, ["trainer.devices=2", "trainer.dapo.rollout_engine=local",
                             f"trainer.dapo.engine_server.dtype={'null' if dtype is None else dtype}",
                             f"trainer.dapo.engine_server.weight_transport={transport}"])
    srv = cfg.trainer.dapo.engine_server
    clients = []

    class RecordingClient:
        info = {}

        def __init__(self, address, **kw):
            clients.append(dict(kw, address=address))
            self.name = kw["name"]

    monkeypatch.setattr(engine_client, "EngineClient", RecordingClient)
    monkeypatch.setenv(srv.address_env, "unix:/run/e{local}-r{rank}.sock")  # the launcher's address wins
    monkeypatch.setenv(srv.authkey_env, "s3cret")
    monkeypatch.setattr(mcore_ps, "get_model_parallel_group", lambda: "mp-group-of-rank-1")
    monkeypatch.setattr(eg, "every_group", lambda group: [(0,), (1,)])
    monkeypatch.setattr(eg.dist, "get_process_group_ranks", lambda group: [1])
    monkeypatch.setattr(eg.dist, "get_world_size", lambda group=None: 1)
    pushed = []
    monkeypatch.setattr(eg.AlignerEngineGenerator, "push_initial_weights", lambda self: pushed.append(self))
    actor = SimpleNamespace(cfg=cfg.model, tokenizer=SimpleNamespace(eos_id=2), valid_vocab=None)
    gen = eg.build_engine_generator(actor, cfg, hf_config=SimpleNamespace(vocab_size=300), world=2, rank=1)
    assert clients == [{"address": "unix:/run/e1-r1.sock", "authkey": b"s3cret", "name": "local@unix:/run/e1-r1.sock",
                        "connect_timeout_s": float(srv.connect_timeout_s),
                        "request_timeout_s": float(srv.request_timeout_s),
                        "weight_timeout_s": float(srv.weight_timeout_s),
                        # an engine on another node cannot see this node's /dev/shm, and needs not: no check
                        "check_shared_memory": transport == "shm"}]
    assert gen.owners == [1] and gen.engine.bucket_bytes == int(srv.bucket_mb) * 2 ** 20
    assert gen.engine.sleep_level == int(srv.sleep_level) and gen.engine.weight_transport == transport
    assert gen.engine.top_k == int(cfg.model.dapo.sampling_params.top_k)
    assert gen._weights.dtype == (None if torch_dtype is None else getattr(torch, torch_dtype))  # what the refit sends
    assert actor.valid_vocab == 300 and pushed == [gen]  # the engine's vocabulary; the first push, once


def test_a_part_without_response_tokens_keeps_its_flags_on_every_rank(tmp_path):
    # an owner's rows may hold no token yet (width 0): the other ranks of its model-parallel group must still get
    # its truncated / finished flags, or they hand their filler other groups than the owner does
    run_torchrun(ROOT / "tests/aligner/workers/zero_width_worker.py", nproc=2, out_dir=tmp_path)
    owner, other = (json.loads((tmp_path / f"zero_width_rank{r}.json").read_text()) for r in (0, 1))
    assert owner == {"shape": [3, 0], "truncated": [True, False, False], "finished": [False, False, True]}
    assert other == owner
