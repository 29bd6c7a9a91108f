"""Megatron -> refit -> engine server -> vLLM's CPU engine, under torchrun (2 ranks, gloo, fp32):

    torchrun --nproc_per_node 2 tests/megatron/workers/refit_vllm_worker.py FAMILY:LAYOUT[,LAYOUT] ...
        (env: OUT_DIR, VLLM_PYTHON; e.g. qwen2:tp2,pp2 mixtral:ep2,tp2,pp2)

Rank 0 makes the tiny random checkpoints of each FAMILY (tests/support/hf_tiny.py, in the vLLM venv: one per layout
seed, plus a "base" the engine starts from) and starts one vLLM engine server per family on its base through
EngineProcess / EngineClient (weights cross over shared memory; the next family's engine boots while one serves).
Then, for each LAYOUT (tp2, pp2, ep2 on the 2 ranks), every rank loads its shards of the layout's checkpoint
(convert.hf_to_megatron + convert_shard) into convert_build's GPTModel behind a MegatronPolicy, and:

  1. ``before``: the engine (still holding other weights) samples; Megatron's log-probs of those tokens must differ
     (negative control: the comparison sees a model that was not pushed);
  2. ``initial``: the whole model is pushed in SMALL buckets (policy.hf_weight_buckets: the refit gather and the HF
     name map), so fused groups (q/k/v, gate/up, w1/w3) are split across buckets; the engine samples 8 rows of 8
     tokens at temperature 1 (its log-probs are then the model's log_softmax); Megatron scores the same tokens;
  3. one DAPO update (core.loss, Adam, the DP share of the rows on each rank), then the push again and ``updated``
     (not for MoE at TP=2: megatron-core 0.10 trains MoE under TP only with sequence parallelism, which needs TE):
     new samples, Megatron's new log-probs, and its OLD (pre-update) log-probs of the same tokens (the update must
     have moved them, so an engine that kept the old weights would fail);
  4. transformers (vLLM venv) scores every ``initial`` / ``updated`` sample: on the layout's checkpoint, and on the
     updated model merged from the ranks' shards (convert_shard.merge_state_dicts + megatron_to_hf: not the refit
     path).
A layout or family that fails is recorded as ``{"error": traceback}`` and the next one runs. Results:
$OUT_DIR/result.json (rank 0), with the bucket layout of every push and the engine log's MoE backend lines.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import tests.support.megatron_cpu_shim  # noqa: F401  (before megatron)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from nemo_dapo.core.loss import make_loss_fn
from nemo_dapo.core.types import RolloutBatch
from nemo_dapo.engines.base import Request
from nemo_dapo.engines.client import EngineClient, EngineProcess
from nemo_dapo.megatron.convert import conversion_rules, hf_arch, load_hf_config
from tests.support.megatron_convert import hf_to_megatron, megatron_to_hf
from nemo_dapo.megatron.convert_build import gpt_model_from_hf
from nemo_dapo.megatron.convert_shard import Parallel
from tests.support.megatron_convert import merge_state_dicts, shard_state_dict
from tests.support.megatron_model import destroy_parallel, initialize_parallel
from tests.support.megatron_policy import MegatronPolicy

ROOT = Path(__file__).resolve().parents[3]
HELPER = ROOT / "tests" / "support" / "hf_tiny.py"
PARALLEL = {"tp2": Parallel(tp=2), "pp2": Parallel(pp=2), "ep2": Parallel(ep=2)}
SEEDS = {"base": 1000, "tp2": 1, "pp2": 2, "ep2": 3}
PADDED_VOCAB = 256  # megatron's padding of the 250-token vocabulary (a multiple of 128 at TP=2)
SMALL = 20_000  # bytes a bucket: below every attention / MLP / expert matrix of the tiny models
PROMPT_LENS, N, R = (3, 5, 8, 11), 2, 8
LR = 1e-2


def coords():
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]


def sample(client, tag, seed):
    """Rank 0: N samples of R tokens per prompt at temperature 1; [(prompt, tokens, engine log-probs)]."""
    ps_ = prompts(seed)
    reqs = [Request(id=f"{tag}/{i}", prompt_ids=p, n=N, max_new_tokens=R, temperature=1.0, seed=seed * 100 + i,
                    ignore_eos=True) for i, p in enumerate(ps_)]
    client.submit(reqs)
    done = {}
    while len(done) < len(reqs):
        c = client.next_completion(timeout_s=300)
        done[c.id] = c
    return [(r.prompt_ids, s.token_ids, s.logprobs) for r in reqs for s in done[r.id].samples]


def shared(fn):
    """``fn()`` run on rank 0 (engine work), its result on every rank; its exception raised on every rank (so the
    ranks leave the layout together instead of one waiting in a collective)."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            box = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise RuntimeError(f"engine side (rank 0): {value}")
    return value


def batch_of(rows):
    """RolloutBatch of [(prompt, tokens, ...)]: prompts left-padded, responses all R long."""
    p = max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), p, dtype=torch.long)
    mask = torch.zeros(len(rows), p, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, p - len(r[0]):] = torch.tensor(r[0])
        mask[i, p - len(r[0]):] = 1
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=torch.tensor([r[1] for r in rows]),
                        response_mask=torch.ones(len(rows), R), group_ids=torch.arange(len(rows)) // N,
                        truncated=torch.zeros(len(rows), dtype=torch.bool))


def max_diff(a, b):
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


def push(client, policy, log):
    """Every rank streams the model (its collectives); rank 0 sends it to the engine, and on an engine error keeps
    draining the stream so that the other rank's collectives complete. ``log``: the HF names of each bucket."""
    buckets = policy.hf_weight_buckets(SMALL)
    if dist.get_rank() != 0:
        for _ in buckets:
            pass
        return shared(None)

    def recorded():
        for b in buckets:
            log.append([n for n, _ in b])
            yield b

    try:
        stats, error = client.update_weights(recorded()), None
    except Exception as e:  # noqa: BLE001 - shared below
        stats, error = None, e
        for _ in buckets:
            pass

    def result():
        if error is not None:
            raise error
        return stats
    return shared(result)


def split_groups(cfg, log):
    """{kind: (fused groups whose HF pieces landed in more than one bucket, all fused groups)}."""
    where = {n: k for k, names in enumerate(log) for n in names}
    out = {}
    for rule in conversion_rules(hf_arch(cfg)):
        if len(rule.hf) < 2:
            continue
        kind = rule.kind + ("_expert" if ".experts." in rule.mc else "") + ("_bias" if rule.mc.endswith("bias")
                                                                               else "")
        split, total = out.get(kind, (0, 0))
        out[kind] = (split + (len({where[n] for n in rule.hf}) > 1), total + 1)
    return out


def train_once(policy, rows, logp):
    """One DAPO update on the rows (advantages +-1), each DP rank on its share; the global token count."""
    batch = batch_of(rows)
    batch.old_logp = logp.clone()
    batch.advantages = torch.tensor([1.0, -1.0] * (len(rows) // 2))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select(torch.arange(dp_rank, len(rows), dp))
    return policy.train_step(share, norm=batch.num_tokens(), loss_fn=make_loss_fn(eps_low=0.2, eps_high=0.28))


def megatron_logp(policy, rows):
    return policy.logprobs(batch_of(rows))[0]


def save_hf(policy, cfg, parallel, src_dir, out_dir):
    """The model merged from every rank's shards, as a HF checkpoint (rank 0 writes it)."""
    local = {n: t.detach().clone() for n, t in policy.inner.state_dict().items() if not n.endswith("_extra_state")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coords(), local))
    if dist.get_rank() != 0:
        return
    from safetensors.torch import save_file

    merged = merge_state_dicts(dict(gathered), parallel, tied=hf_arch(cfg).tied)
    hf = {n: t.clone().contiguous() for n, t in megatron_to_hf(merged, cfg).items()}
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(src_dir, "config.json"), out_dir)
    save_file(hf, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def run_layout(client, family, layout, ckpt, out_dir):
    parallel = PARALLEL[layout]
    initialize_parallel(parallel.tp, parallel.pp, parallel.ep)
    cfg = load_hf_config(ckpt)
    from safetensors.torch import load_file

    full = hf_to_megatron(load_file(os.path.join(ckpt, "model.safetensors")), cfg, padded_vocab=PADDED_VOCAB)
    tp, pp, ep = coords()
    model = gpt_model_from_hf(cfg, padded_vocab=PADDED_VOCAB, use_cpu_initialization=True,
                              params_dtype=torch.float32, moe_token_dispatcher_type="alltoall")
    model.load_state_dict(shard_state_dict(full, parallel, tp_rank=tp, pp_rank=pp, ep_rank=ep), strict=True)
    policy = MegatronPolicy(model, torch.optim.Adam(model.parameters(), lr=LR), micro_batch_size=4, hf_config=cfg,
                            max_grad_norm=None)
    res, seed = {}, 10 * SEEDS[layout]

    rows = shared(lambda: sample(client, f"{layout}/before", seed))
    res["before"] = dict(vllm_vs_megatron=max_diff([r[2] for r in rows], megatron_logp(policy, rows)))

    phases = ("initial", "updated")
    if hf_arch(cfg).num_experts and parallel.tp > 1:
        # megatron-core 0.10's MoELayer refuses to train under TP without sequence parallelism, which its torch
        # norms (no TE / apex on CPU) refuse: this layout checks the push only
        phases, res["updated_skipped"] = ("initial",), "MoE training at TP > 1 needs sequence parallelism"
    for phase in phases:
        if phase == "updated":
            old = [p.detach().clone() for p in policy.inner.parameters()]
            res["train"] = train_once(policy, rows, megatron_logp(policy, rows))
        log = []
        t0 = time.perf_counter()
        stats = push(client, policy, log)
        push_s = time.perf_counter() - t0
        rows = shared(lambda: sample(client, f"{layout}/{phase}", seed + (phase == "updated")))
        lp = megatron_logp(policy, rows)
        r = dict(rows=[[p, t] for p, t, _ in rows], vllm=[x[2] for x in rows], megatron=lp.tolist(),
                 vllm_vs_megatron=max_diff([x[2] for x in rows], lp), push=stats, push_s=round(push_s, 3))
        if dist.get_rank() == 0:
            r.update(buckets=len(log), bucket_tensors=[len(b) for b in log], split=split_groups(cfg, log),
                     names=sorted(n for b in log for n in b))
        if phase == "updated":
            new = [p.detach().clone() for p in policy.inner.parameters()]
            with torch.no_grad():
                for p, o in zip(policy.inner.parameters(), old):
                    p.copy_(o)
            r["megatron_before_update"] = megatron_logp(policy, rows).tolist()
            r["update_moved"] = max_diff(r["megatron_before_update"], lp)
            with torch.no_grad():
                for p, n in zip(policy.inner.parameters(), new):
                    p.copy_(n)
            r["hf_model"] = os.path.join(out_dir, f"{family}-{layout}-updated")
            save_hf(policy, cfg, parallel, ckpt, r["hf_model"])
        else:
            r["hf_model"] = ckpt
        res[phase] = r
    destroy_parallel()
    return res


def helper(*args):
    """Run tests/support/hf_tiny.py in the vLLM venv (rank 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([os.environ["VLLM_PYTHON"], str(HELPER), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"hf_tiny {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def references(out, out_dir):
    """transformers' log-probs of every initial / updated sample of every family (rank 0, one helper run)."""
    jobs = [r for fam in out["families"].values() for res in fam.get("layouts", {}).values()
            for phase, r in res.items() if phase in ("initial", "updated") and "rows" in r]
    with open(os.path.join(out_dir, "jobs.json"), "w") as f:
        json.dump([{"model": r["hf_model"], "rows": r["rows"]} for r in jobs], f)
    helper("logprobs", os.path.join(out_dir, "jobs.json"), os.path.join(out_dir, "ref.json"))
    with open(os.path.join(out_dir, "ref.json")) as f:
        ref = json.load(f)
    for r, lp in zip(jobs, ref):
        r["transformers"] = lp
        r["vllm_vs_transformers"] = max_diff(r["vllm"], lp)
        r["megatron_vs_transformers"] = max_diff(r["megatron"], lp)


def start_engine(family, out_dir):
    return EngineProcess(engine="vllm", model_dir=os.path.join(out_dir, f"{family}-{SEEDS['base']}"),
                         address=f"unix:{out_dir}/{family}.sock", python=os.environ["VLLM_PYTHON"],
                         log_path=os.path.join(out_dir, f"{family}-engine.log"),
                         options=dict(max_batch_size=16, max_seq_len=64, kv_cache_gb=0.05, num_threads=1),
                         threads=1, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})


def run_family(family, layouts, proc, out_dir):
    """Every layout of ``family`` against the engine ``proc`` (rank 0; None elsewhere)."""
    out, engine = {"layouts": {}}, {}

    def connect():
        t0 = time.perf_counter()
        engine["client"] = EngineClient(proc.address, name=f"vllm-{family}", connect_timeout_s=900,
                                        request_timeout_s=300, process=proc)
        return round(time.perf_counter() - t0, 1)

    try:
        out["engine_connect_s"] = shared(connect)
        client = engine.get("client")
        for layout in layouts:
            t0 = time.perf_counter()
            try:
                out["layouts"][layout] = run_layout(client, family, layout,
                                                    os.path.join(out_dir, f"{family}-{SEEDS[layout]}"), out_dir)
            except Exception:  # noqa: BLE001 - raised on both ranks (see shared); the next layout still runs
                out["layouts"][layout] = {"error": traceback.format_exc()[-3000:]}
                if ps.model_parallel_is_initialized():
                    destroy_parallel()
            out["layouts"][layout]["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        if proc is not None:
            proc.stop(engine.get("client"))
    return out


def main():
    cases = dict((arg.split(":")[0], arg.split(":")[1].split(",")) for arg in sys.argv[1:])
    families = list(cases)
    dist.init_process_group("gloo")
    out_dir = os.environ["OUT_DIR"]
    rank0 = dist.get_rank() == 0
    out, procs = {"families": {}}, {}
    if rank0:
        t0 = time.perf_counter()
        helper("make", out_dir, ",".join(families), *sorted(set(SEEDS.values())))
        out["make_s"] = round(time.perf_counter() - t0, 1)
        procs[families[0]] = start_engine(families[0], out_dir)
    dist.barrier()
    for i, family in enumerate(families):
        if rank0 and i + 1 < len(families):  # the next engine boots while this one serves
            procs[families[i + 1]] = start_engine(families[i + 1], out_dir)
        try:
            out["families"][family] = run_family(family, cases[family], procs.get(family), out_dir)
        except Exception:  # noqa: BLE001 - this family fails, the others still run
            out["families"][family] = {"error": traceback.format_exc()[-3000:]}
            if ps.model_parallel_is_initialized():
                destroy_parallel()
        if rank0:
            with open(os.path.join(out_dir, f"{family}-engine.log"), errors="replace") as f:
                out["families"][family]["engine_moe_backend"] = [ln.strip()[-120:] for ln in f if "MoE backend" in ln]
    if rank0:
        with open(os.path.join(out_dir, "result_no_reference.json"), "w") as f:
            json.dump(out, f, indent=1)
        references(out, out_dir)
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
